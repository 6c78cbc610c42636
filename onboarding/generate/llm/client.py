"""A thin client over any OpenAI-compatible chat endpoint (vLLM, SGLang, ollama, OpenAI).

`LLMClient` is built from options (`LLMConfig`) and handed to whoever asks the model (never a
module global). It asks for structured output first (``response_format`` with the answer's JSON
schema); a server that answers that request with an error saying it does not support it is asked
again in JSON mode, then as plain text, and the client remembers what worked. Every failure is an
`LLMError` with a `kind` and a one-line reason: a wrong model name (404), another HTTP status, a
timeout, a refused connection, an empty reply. The openai client's own retries are off
(``max_retries=0``): an attempt that fails is recorded and the caller decides what comes next.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from onboarding.errors import InputError

ENV_KEYS = ("ONBOARD_LLM_API_KEY", "OPENAI_API_KEY")
ErrorKind = Literal["model_not_found", "http", "timeout", "connection", "empty", "unsupported"]
Mode = Literal["json_schema", "json_object", "text"]
_FORMAT_WORDS = ("response_format", "json_schema", "structured", "guided", "not supported",
                 "unsupported", "json_object")


@dataclass(kw_only=True, slots=True)
class LLMConfig:
    """Where and how to ask: `url` the server's base URL (``http://host:port`` or ending in
    ``/v1``), `model` the model name it serves (None: the first model its ``/v1/models`` lists,
    as a vLLM or SGLang server serves one), `api_key` (None: from ONBOARD_LLM_API_KEY or
    OPENAI_API_KEY, else a placeholder local servers ignore), `timeout_s` per request."""

    url: str
    model: str | None = None
    api_key: str | None = None
    timeout_s: float = 600.0
    temperature: float = 0.0
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise InputError(f"--llm {self.url!r}: expected an http(s) URL of an OpenAI-compatible "
                             "server, or 'off'")
        if self.timeout_s <= 0:
            raise InputError(f"LLM timeout must be positive, got {self.timeout_s}")

    @property
    def base_url(self) -> str:
        url = self.url.rstrip("/")
        return url if url.endswith("/v1") else url + "/v1"

    def key(self) -> str:
        if self.api_key:
            return self.api_key
        for name in ENV_KEYS:
            if os.environ.get(name):
                return os.environ[name]
        return "none"  # local servers take any key; the openai client insists on one


class LLMError(RuntimeError):
    """A request that produced no usable reply: `kind` says which failure, the message why."""

    def __init__(self, kind: ErrorKind, reason: str, status: int | None = None):
        super().__init__(reason)
        self.kind, self.reason, self.status = kind, reason, status


@dataclass(kw_only=True, slots=True)
class Reply:
    text: str
    mode: Mode  # how the answer was asked for
    model: str  # the model the server says answered
    seconds: float
    usage: dict[str, int] = field(default_factory=dict)
    fallbacks: list[str] = field(default_factory=list)  # format errors that made it fall back


class LLMClient:
    """Chat completions against one server and model; see the module docstring."""

    def __init__(self, config: LLMConfig, *, openai_client: Any = None):
        self.config = config
        if openai_client is None:
            import openai

            openai_client = openai.OpenAI(base_url=config.base_url, api_key=config.key(),
                                          max_retries=0, timeout=config.timeout_s)
        self._client = openai_client
        self.mode: Mode = "json_schema"

    def model(self) -> str:
        """The model asked: the configured one, or the first the server lists (asked once)."""
        if self.config.model is None:
            import openai

            try:
                listed = [m.id for m in self._client.models.list().data]
            except openai.APIConnectionError as exc:
                raise LLMError("connection", f"cannot reach {self.config.base_url}: {exc}") from exc
            except openai.APIStatusError as exc:
                raise LLMError("model_not_found", f"no --llm-model given and {self.config.base_url}"
                               f"/models failed (HTTP {exc.status_code}: {_message(exc)})", exc.status_code) from exc
            if not listed:
                raise LLMError("model_not_found", f"no --llm-model given and {self.config.base_url}"
                               "/models lists no model")
            self.config.model = listed[0]
        return self.config.model

    def complete(self, messages: list[dict[str, str]], schema_format: dict[str, Any]) -> Reply:
        """The reply's text to `messages`, asking for `schema_format` (a `response_format`) first."""
        fallbacks: list[str] = []
        while True:
            t0 = time.perf_counter()
            try:
                resp = self._create(messages, schema_format)
            except LLMError as exc:
                nxt = {"json_schema": "json_object", "json_object": "text"}.get(self.mode)
                if exc.kind == "unsupported" and nxt is not None:
                    fallbacks.append(f"{self.mode}: {exc.reason}")
                    self.mode = nxt  # remembered: the next request starts here
                    continue
                raise
            seconds = time.perf_counter() - t0
            text = _content(resp)
            if text is None or not text.strip():
                raise LLMError("empty", f"empty answer from {self.config.model!r} "
                               f"(finish_reason: {_finish(resp)})")
            usage = getattr(resp, "usage", None)
            return Reply(text=text, mode=self.mode, model=str(getattr(resp, "model", "") or ""),
                         seconds=round(seconds, 3), fallbacks=fallbacks,
                         usage={k: int(v) for k, v in (usage.model_dump() if usage else {}).items()
                                if isinstance(v, int)})

    def _create(self, messages: list[dict[str, str]], schema_format: dict[str, Any]) -> Any:
        import openai

        kwargs: dict[str, Any] = {"model": self.model(), "messages": messages,
                                  "temperature": self.config.temperature}
        if self.config.max_tokens:
            kwargs["max_tokens"] = self.config.max_tokens
        if self.mode == "json_schema":
            kwargs["response_format"] = schema_format
        elif self.mode == "json_object":
            kwargs["response_format"] = {"type": "json_object"}
        try:
            return self._client.chat.completions.create(**kwargs)
        except openai.APITimeoutError as exc:
            raise LLMError("timeout", f"no reply within {self.config.timeout_s:g} s "
                           f"from {self.config.base_url}") from exc
        except openai.APIConnectionError as exc:
            raise LLMError("connection", f"cannot reach {self.config.base_url}: {exc}") from exc
        except openai.NotFoundError as exc:
            raise LLMError("model_not_found", f"model {self.config.model!r} not found at "
                           f"{self.config.base_url} (HTTP 404: {_message(exc)})", 404) from exc
        except openai.APIStatusError as exc:
            msg = _message(exc)
            if exc.status_code in (400, 422) and self.mode != "text" and \
                    any(w in msg.lower() for w in _FORMAT_WORDS):
                raise LLMError("unsupported", f"HTTP {exc.status_code}: {msg}", exc.status_code) from exc
            raise LLMError("http", f"HTTP {exc.status_code} from {self.config.base_url}: {msg}",
                           exc.status_code) from exc


def _message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:300]
    return str(getattr(exc, "message", exc))[:300]


def _content(resp: Any) -> str | None:
    choices = getattr(resp, "choices", None) or []
    if not choices:
        return None
    return getattr(choices[0].message, "content", None)


def _finish(resp: Any) -> str:
    choices = getattr(resp, "choices", None) or []
    return str(getattr(choices[0], "finish_reason", None)) if choices else "no choices"
