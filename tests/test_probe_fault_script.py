""".ci/h200/probe_fault.py (names the kernel behind a GPU fault in `onboard train`'s export probe),
run here on the CPU under the interpreter so that it does not rot: a config-less tiny model (any
MODEL `onboard train` takes) with no training step, the probe traced module by module and launch by
launch into the JSON; and a simulated fault at one kernel's synchronize, which the JSON must name."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
# a plain nn.Module class (no transformers config) with RMSNorm and SwiGLU: kernels patch in
MODEL = f"{FIXTURES / 'compressed_attention_models.py'}:CompressedTopkMaskLM"


def _script():
    spec = importlib.util.spec_from_file_location("probe_fault", ROOT / ".ci" / "h200" / "probe_fault.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _argv(tmp_path):
    return [MODEL, "--set", "vocab=256", "--device", "cpu", "--dtype", "fp32", "--seq", "16",
            "--steps", "0", "--lora-rank", "4", "--tokens", "8", "--quiet",
            "--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "probe.json")]


def test_probe_traced_module_by_module_and_launch_by_launch(tmp_path):
    from triton.runtime.jit import JITFunction

    from onboarding.train import peft_export, worker

    before = (JITFunction.run, worker.prepare, peft_export.export_run, peft_export.PROBE_TOKENS)
    assert _script().main(_argv(tmp_path)) == 0
    out = json.loads((tmp_path / "probe.json").read_text())
    assert out["ok"] and out["phase"] == "done" and out["steps"] == 0 and out["tokens"] == 8
    assert out["probe"]["logits"] == [1, 8, 256] and out["probe"]["finite"]
    seq = out["sequence"]
    # children complete before their parents; the whole model last; kernels inside modules
    assert seq[-1] == "module <model>" and "module layers.0" in seq
    assert seq.index("module layers.0.norm1") < seq.index("module layers.0")
    assert out["launches"] and all(f"triton {k}" in seq for k in out["launches"])
    assert out["kernels"] and out["last_completed"]["name"] == "<model>"
    # every patch undone: the test's process runs on unpatched
    assert before == (JITFunction.run, worker.prepare, peft_export.export_run,
                      peft_export.PROBE_TOKENS)


def test_a_fault_at_a_kernels_synchronize_is_named(tmp_path, monkeypatch):
    mod = _script()
    sync = mod.Tracer.sync
    seen = []

    def faulting(self):  # the sync after the probe's second Triton launch raises, as CUDA does
        cur = self.current
        if self.record and cur and cur["kind"] == "triton" and cur["stage"] == "sync after":
            seen.append(cur["name"])
            if len(seen) == 2:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
        sync(self)
    monkeypatch.setattr(mod.Tracer, "sync", faulting)
    assert mod.main(_argv(tmp_path)) == 1
    out = json.loads((tmp_path / "probe.json").read_text())
    assert not out["ok"] and out["phase"] == "probe" and "illegal memory access" in out["error"]
    failing = out["failing"]
    assert failing["kind"] == "triton" and failing["stage"] == "sync after"
    assert failing["name"] == seen[1] and failing["in"] and failing["args"]
    assert out["culprit"].startswith(f"the Triton kernel {seen[1]} (")
    assert out["sequence"].count(f"triton {seen[0]}") >= 1
    assert out["last_completed"]["kind"] in ("module", "triton") and out["open_modules"]
