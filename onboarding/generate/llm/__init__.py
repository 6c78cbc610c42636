"""The LLM path for uncovered blocks: an OpenAI-compatible client (`LLMClient`, built from
`LLMConfig` and injected), the answer contract (a JSON schema: one whole kernel family), the
gate every answer passes (render, sm_90 compile, numerics against the block's own forward and
every gradient at odd sizes in a subprocess, static and runtime anti-cheat checks), and
`propose`, the loop of attempts with every one recorded (docs/generate.md)."""

from onboarding.generate.llm.client import LLMClient, LLMConfig, LLMError, Reply
from onboarding.generate.llm.contract import Answer, AnswerError, answer_schema, parse_answer
from onboarding.generate.llm.attempts import Attempt, LLMOutcome, propose
from onboarding.generate.llm.gate import GateVerdict

__all__ = ["Answer", "AnswerError", "Attempt", "GateVerdict", "LLMClient", "LLMConfig", "LLMError",
           "LLMOutcome", "Reply", "answer_schema", "parse_answer", "propose"]
