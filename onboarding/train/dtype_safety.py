"""Naming a training failure that is the model's own: its code mixes dtypes in 16-bit training.

Some models' code cannot run in bf16 at all: transformers' MiniMax lightning attention multiplies
bf16 scores by a float32 decay it builds itself, and raises "expected scalar type Float but
found BFloat16". onboard's patches calibrate such a block in float32 (`onboarding.patching`), but
the baseline role (the model + PEFT, none of onboard's kernels) and any block left unpatched run
the model's code as written, and the worker died with a bare traceback. `dtype_failure` tells
that case apart, by where the error was raised and what it says, so that the worker can name it:
a dtype mismatch raised from a frame of the model's code (not onboard's) while training in a
16-bit dtype.
"""

from __future__ import annotations

import re
import traceback
from types import TracebackType

from onboarding.families.discover import PACKAGE
from onboarding.generate.templating import MODULE_PREFIX

# what torch says when the operands of one op disagree in dtype (matched on the first line)
_MISMATCH = re.compile(r"expected scalar type|same dtype|Input type \(.*\) and (weight|bias) type"
                       r"|found dtype \w+ but expected|is not the same as|dtype mismatch",
                       re.IGNORECASE)
# top-level packages of the frames that are machinery, never the model's own code, by the module
# a frame runs in (not its file's path: a checkout may sit in a folder of any name)
_LIBRARIES = ("torch", "triton", "peft", "accelerate")
# onboard's own code: the library, its rendered kernel modules and the family folders it imports
# (built-in, plugins, LLM-written)
_ONBOARD = ("onboarding", MODULE_PREFIX, PACKAGE)


def _frames(exc: BaseException) -> list[tuple[str, traceback.FrameSummary]]:
    """The traceback's frames, outermost first, each with the top-level package of its module."""
    out, tb = [], exc.__traceback__
    while isinstance(tb, TracebackType):
        name = tb.tb_frame.f_globals.get("__name__") or ""
        out.append((name.split(".")[0], traceback.FrameSummary(
            tb.tb_frame.f_code.co_filename, tb.tb_lineno, tb.tb_frame.f_code.co_name,
            lookup_line=False)))
        tb = tb.tb_next
    return out


def _where(frames: list[tuple[str, traceback.FrameSummary]]) -> traceback.FrameSummary | None:
    """The deepest frame outside the libraries and onboard: the model's code that called the op."""
    model = [f for top, f in frames if top not in _LIBRARIES + _ONBOARD]
    return model[-1] if model else None


def _from_onboard(frames: list[tuple[str, traceback.FrameSummary]]) -> bool:
    """Whether the deepest frame outside torch and triton is onboard's own (a patch, a kernel)."""
    top = next((t for t, _ in reversed(frames) if t not in ("torch", "triton")), None)
    return top in _ONBOARD


def dtype_failure(exc: BaseException, dtype: str, role: str) -> str | None:
    """The message for a dtype mismatch raised in the model's own code during 16-bit training, or
    None when ``exc`` is anything else (then it is reported as it is)."""
    if dtype == "fp32" or not isinstance(exc, (RuntimeError, TypeError)):
        return None
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else ""
    frames = _frames(exc)
    if not _MISMATCH.search(first) or _from_onboard(frames):
        return None
    frame = _where(frames)
    if frame is None:
        return None
    where = (f"{frame.filename}:{frame.lineno} (in {frame.name}) raised {type(exc).__name__}: "
             f"{first}")
    if role == "baseline":  # the model as written plus PEFT: nothing of onboard's runs in it
        return (f"the model's own code cannot train in {dtype}: {where}. The baseline runs the "
                f"model as written with PEFT's adapters and none of onboard's kernels, so the "
                f"model itself mixes dtypes in {dtype}. Drop --baseline, or train in fp32 "
                f"(--dtype fp32)")
    return (f"{dtype} training failed in the model's own code, not in onboard's: {where}. If the "
            f"model also fails so without onboard's kernels (--no-kernels), its code does not "
            f"run in {dtype}: train in fp32 (--dtype fp32)")
