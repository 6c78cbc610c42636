"""Installed kernel packages never choose the model's code path (`onboarding.optional_kernels`).

A fake `fla` on the path stands in for flash-linear-attention: transformers' Qwen3-Next module
imports it and keeps its `chunk_gated_delta_rule` when it can, and must not once `hide` ran. (From
transformers 5.25 the kernel is called for tensors on its own devices only; the probe lists the
CPU among fla's, as a GPU machine's tensors would be.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

FAKE_FLA = '''
__version__ = "0.6.0"
def chunk_gated_delta_rule(*args, **kwargs):
    raise RuntimeError("the installed fla ran")
fused_recurrent_gated_delta_rule = chunk_gated_delta_rule
'''

PROBE = textwrap.dedent('''
    import json, sys
    sys.path.insert(0, sys.argv[1])
    hidden = {}
    if sys.argv[2] == "hide":
        from onboarding.optional_kernels import hide
        hidden = hide()
    import torch
    import transformers.integrations.hub_kernels as hub_kernels
    # From transformers 5.25 a package's function only gets tensors on the devices listed for
    # it (fla: GPUs), CPU tensors take the torch path: the probe's CPU stands in for fla's GPU
    devices = getattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", None)
    if isinstance(devices, dict) and "fla" in devices:
        devices["fla"] = (*devices["fla"], "cpu")
    from transformers.models.qwen3_next import modeling_qwen3_next as m
    fla = sys.modules.get("fla")
    q = torch.randn(1, 8, 2, 4)
    try:  # the wrapped function transformers' layer calls
        m.torch_chunk_gated_delta_rule(q, q, q, g=torch.zeros(1, 8, 2), beta=torch.ones(1, 8, 2),
                                       chunk_size=4, use_qk_l2norm_in_kernel=True)
        ran = "torch"
    except RuntimeError as exc:
        ran = str(exc)
    print(json.dumps({"fla_loaded": fla is not None, "ran": ran, "hidden": hidden}))
''')


def _probe(tmp_path: Path, mode: str) -> dict:
    pkg = tmp_path / "site" / "fla"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(FAKE_FLA)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "site"), mode],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_installed_fla_is_hidden_from_model_code(tmp_path):
    pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    control = _probe(tmp_path, "keep")
    # without onboard's choice, transformers takes whatever imports (the premise of the fix)
    assert control == {"fla_loaded": True, "ran": "the installed fla ran", "hidden": {}}
    chosen = _probe(tmp_path, "hide")
    assert chosen["fla_loaded"] is False and chosen["ran"] == "torch"
    assert list(chosen["hidden"]) == ["fla"]
    assert chosen["hidden"]["fla"].endswith("installed, hidden from model code")
