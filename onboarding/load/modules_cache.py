"""A private Hugging Face modules cache per onboard process.

To import a model's own code (``--trust-remote-code``, and the built-in examples, loaded the same
way) transformers copies its ``.py`` files into ``HF_MODULES_CACHE`` (by default
``~/.cache/huggingface/modules``), even when the run then fails. onboard points that cache at a
temporary folder of its own, removed when the process ends: running a model leaves no copy of its
code in the user's cache, and no stale copy from there is imported. A ``HF_MODULES_CACHE`` the
user set is kept; the processes onboard starts (training ranks) inherit the folder.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile


def use_private_modules_cache() -> str | None:
    """Point ``HF_MODULES_CACHE`` at a fresh temporary folder (removed at exit) unless it is set
    or transformers is already imported in this process (its cache path is fixed then); returns
    the folder, or None where it changed nothing."""
    if os.environ.get("HF_MODULES_CACHE") or "transformers" in sys.modules:
        return None
    folder = tempfile.mkdtemp(prefix="onboard-hf-modules-")
    os.environ["HF_MODULES_CACHE"] = folder
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder
