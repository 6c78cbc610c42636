"""The agent's typed state. Nodes return partial updates; loop caps live in `RunConfig`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from onboarding.align.verdicts import strict_line
from onboarding.load.spec import ModelSpec


class RunConfig(BaseModel):
    """Everything a run needs to be re-created on resume (stored in the checkpoint)."""

    model: ModelSpec = ModelSpec()
    batch: int = Field(1, ge=1)
    seq: int = Field(64, ge=1)
    seed: int = 0
    align_kernels: list[str] | None = None  # families patched for alignment (None: all)
    align_dtype: str = "fp32"
    align_reference: str = "fp64"
    # a failed alignment loops back to generate at most this often
    max_align_retries: int = Field(2, ge=0)
    # any coverable block left unpatched (not checked by alignment) fails the run (exit 3)
    strict: bool = False
    # tune node: Optuna trials per study (one per kernel and shape bucket). None: 20 on a GPU;
    # on the CPU the interpreter's timings mean nothing, so None skips tuning there (set it to
    # tune anyway: each trial costs seconds).
    tune_trials: int | None = Field(None, ge=0)
    # seconds for the whole tune stage, split over its studies (kernel x bucket); None: the
    # default (`onboarding.policy.DEFAULT_TUNE_BUDGET_S`); 0: no time limit
    tune_budget_s: float | None = Field(None, ge=0)
    tune_kernels: list[str] | None = None  # families to tune (None: those patched for align)
    tune_workers: int = Field(1, ge=1)
    # studies tuned at once (None: three per four cores on a GPU host, one on the CPU)
    tune_parallel: int | None = Field(None, ge=1)
    # how the tune stage's checks and timings share the GPU (`TuneConfig.gpu_gate`)
    tune_gpu_gate: Literal["strict", "overlap"] = "strict"
    # prune configs that cannot compile for sm_90 before running them; None: where kernels run in
    # the interpreter (on a GPU host the check's own builds are judged instead)
    tune_aot: bool | None = None
    # build a trial's kernels before its check, outside the GPU gate (`TuneConfig.compile_ahead`);
    # None: on a GPU host
    tune_compile_ahead: bool | None = None
    # a study thread with no study left to start joins the searches still running
    # (`TuneConfig.join_studies`)
    tune_join_studies: bool = True
    # how the tune stage times a trial on a GPU (`TuneConfig.timing`)
    tune_timing: Literal["events", "graph"] = "graph"
    # plan node: the full-size model's memory, communication and step time on plan_gpus GPUs
    # (None: this machine's, 8 without a GPU) at plan_seq tokens per sequence, LoRA
    plan_gpus: int | None = Field(None, ge=1)
    plan_seq: int = Field(4096, ge=1)
    # train node: LoRA steps of the FSDP2 x EP setup plus its single-process reference. None:
    # 20 on a GPU, skipped on the CPU (set it to train there: gloo, seconds per step).
    train_steps: int | None = Field(None, ge=0)
    train_nproc: int | None = Field(None, ge=1)  # None: the GPUs on this machine (2 on the CPU)
    # the review gate (`agents.review`): after the report, open the kernel PR in
    # `review_repo` (None: this checkout) onto `review_base` (None: its current branch) and
    # wait for a human's answer
    review: bool = False
    review_repo: str | None = None
    review_base: str | None = None
    # generate node's decision loop for blocks no family serves (`onboarding.generate.decide`):
    # the LLM path only with `llm` (an OpenAI-compatible server's URL; None: off), key from
    # ONBOARD_LLM_API_KEY or OPENAI_API_KEY; then Inductor; `generate_budget_s` bounds the loop
    llm: str | None = None
    llm_model: str | None = None
    llm_attempts: int = Field(3, ge=1)
    generate_budget_s: float | None = Field(None, ge=0)


class RunState(BaseModel):
    config: RunConfig
    run_dir: str
    model_name: str | None = None
    completed: list[str] = Field(default_factory=list)
    artifacts: dict[str, str] = Field(default_factory=dict)
    summary: dict[str, Any] = Field(default_factory=dict)
    # one entry per alignment attempt: passed, culprits, kernels excluded before it
    align_attempts: list[dict[str, Any]] = Field(default_factory=list)
    excluded_kernels: list[list[str]] = Field(default_factory=list)  # [block path, family]
    # one entry per tune node run: trials per study, studies, best vs default per study
    tune_attempts: list[dict[str, Any]] = Field(default_factory=list)
    # one entry per train node run: the layout, exit code and the loss comparison's verdict
    train_attempts: list[dict[str, Any]] = Field(default_factory=list)
    # the decision loop's outcome per uncovered block (`onboarding.generate.decide.Decision`)
    generate_decisions: list[dict[str, Any]] = Field(default_factory=list)
    # the review gate: the PR's branch and repo, the answer, what the pr node did with it
    review: dict[str, Any] = Field(default_factory=dict)

    def verdict(self) -> tuple[bool, str]:
        """(passed, one line): the run's checks, the last alignment and training attempts.

        A check that did not run (training skipped on a CPU) is said as such, never as passed.
        """
        lines, passed = [], True
        if self.align_attempts:
            a = self.align_attempts[-1]
            what = a.get("checked") or ""
            if a["passed"] and self.config.strict and a.get("not_checked"):
                passed = False
                lines.append(f"alignment FAILED under --strict (attempt {a['attempt']}): "
                             + strict_line(a["not_checked"]))
            elif a["passed"]:
                lines.append(f"alignment passed (attempt {a['attempt']})"
                             + (f": {what}" if what else ""))
            else:
                passed = False
                blamed = ", ".join(a["culprits"]) or "no single block"
                lines.append(f"alignment FAILED after {a['attempt']} attempt(s): {blamed}"
                             + (f"; {a['stop']}" if a.get("stop") else "")
                             + (f"; {what}" if what else ""))
        else:
            lines.append("alignment not run")
        if self.train_attempts:
            t = self.train_attempts[-1]
            if t.get("skipped"):
                lines.append("training not run (" + t["skipped"] + ")")
            elif t.get("single") and t.get("exit_code") == 0:
                lines.append("training ran, loss not compared (" + t["single"] + ")")
            elif t.get("passed"):
                lines.append("training loss matches its reference")
            else:
                passed = False
                lines.append("training loss check FAILED"
                             + (f": {t['summary']}" if t.get("summary") else
                                f" (exit code {t.get('exit_code')}, no verdict written)"))
        return passed, "; ".join(lines)
