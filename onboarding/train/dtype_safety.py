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

# what torch says when the operands of one op disagree in dtype (matched on the first line)
_MISMATCH = re.compile(
    r"expected (scalar type|both vectors to have same dtype|mat1 and mat2 to have the same dtype"
    r"|m1 and m2 to have the same dtype|self and mat2 to have the same dtype)"
    r"|must have the same dtype|same dtype|Input type \(.*\) and (weight|bias) type"
    r"|found dtype \w+ but expected|is not the same as|dtype mismatch", re.IGNORECASE)
# frames of these packages are the machinery, never the model's own code
_MACHINERY = ("/torch/", "/triton/", "/peft/", "/onboarding/", "/accelerate/")


def _where(exc: BaseException) -> traceback.FrameSummary | None:
    """The deepest frame of the traceback outside the machinery: the code that called the op."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not any(m in f.filename.replace("\\", "/") for m in _MACHINERY)]
    return frames[-1] if frames else None


def _from_onboard(exc: BaseException) -> bool:
    """Whether the deepest frame outside torch and triton is onboard's own (a patch, a kernel)."""
    for f in reversed(traceback.extract_tb(exc.__traceback__)):
        path = f.filename.replace("\\", "/")
        if "/torch/" in path or "/triton/" in path:
            continue
        return "/onboarding/" in path or "/kernel_templates/" in path
    return False


def dtype_failure(exc: BaseException, dtype: str, role: str) -> str | None:
    """The message for a dtype mismatch raised in the model's own code during 16-bit training, or
    None when ``exc`` is anything else (then it is reported as it is)."""
    if dtype == "fp32" or not isinstance(exc, (RuntimeError, TypeError)):
        return None
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else ""
    if not _MISMATCH.search(first) or _from_onboard(exc):
        return None
    frame = _where(exc)
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
