"""The ssd bench's mamba-ssm anchor (issue 35) on the CPU: the loader (a source tree named by
$ONBOARD_ANCHOR_MAMBA_SSM, the package's __init__ never run), the rows only on request, the
missing-anchor skip, and the anchor's own check through the harness. mamba-ssm's Triton kernels
are not run here (the interpreter does not run them reliably): the fake tree's
`mamba_chunk_scan_combined` is a per-token fp32 scan written for this test."""

from __future__ import annotations

import dataclasses
import sys
import textwrap

import pytest
import torch

from onboarding.families import family_module

FAKE = '''
import torch
from torch.nn import functional as F

from mamba_ssm.ops.triton.helper import SCALE


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                              initial_states=None, seq_idx=None, cu_seqlens=None,
                              dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False):
    CALLS.append(chunk_size)
    dt = dt.float() + dt_bias.float()
    dt = F.softplus(dt) if dt_softplus else dt
    b, t, h, p = x.shape
    rep = h // B.shape[2]
    Bh, Ch = (v.float().repeat_interleave(rep, dim=2) for v in (B, C))
    state = x.new_zeros(b, h, p, B.shape[-1], dtype=torch.float32)
    ys = []
    for i in range(t):
        decay = torch.exp(dt[:, i] * A.float())[..., None, None]
        state = state * decay + (dt[:, i, :, None, None] * x[:, i].float()[..., None]
                                 * Bh[:, i, :, None, :])
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, i]) + D.float()[:, None] * x[:, i].float())
    return (SCALE * torch.stack(ys, 1)).to(x.dtype)


CALLS = []
'''


def _tree(root, scale: float = 1.0):
    """A fake mamba_ssm source tree under `root`: the package's __init__ raises (as the real one
    fails without its CUDA extensions); ops/triton/ssd_combined.py is a per-token scan."""
    pkg = root / "mamba_ssm"
    (pkg / "ops" / "triton").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('selective_scan_cuda: not here')\n")
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "ops" / "triton" / "__init__.py").write_text("")
    (pkg / "ops" / "triton" / "helper.py").write_text(f"SCALE = {scale}\n")
    (pkg / "ops" / "triton" / "ssd_combined.py").write_text(textwrap.dedent(FAKE))
    return root


@pytest.fixture
def bench(monkeypatch):
    """The ssd bench module, with no mamba_ssm in sys.modules before or after the test."""
    for name in [m for m in sys.modules if m == "mamba_ssm" or m.startswith("mamba_ssm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delenv("ONBOARD_ANCHOR_MAMBA_SSM", raising=False)
    yield sys.modules[family_module("ssd").__package__ + ".bench"]
    for name in [m for m in sys.modules if m == "mamba_ssm" or m.startswith("mamba_ssm.")]:
        del sys.modules[name]


def test_loader_reads_the_env_tree_without_its_init(bench, tmp_path, monkeypatch):
    root = _tree(tmp_path / "src")
    monkeypatch.setenv("ONBOARD_ANCHOR_MAMBA_SSM", str(root))
    mod = bench.mamba_ssm_module()
    assert mod.__file__ == str((root / "mamba_ssm/ops/triton/ssd_combined.py").resolve())
    assert sys.modules["mamba_ssm"].__path__ == [str((root / "mamba_ssm").resolve())]
    # a plain import runs the __init__, which raises: the loader did not
    del sys.modules["mamba_ssm"]
    monkeypatch.syspath_prepend(str(root))
    with pytest.raises(ImportError, match="selective_scan_cuda"):
        __import__("mamba_ssm")
    # the call passes the models' chunk and the rest by keyword
    sys.modules.pop("mamba_ssm", None)
    call = bench.mamba_ssm_path()
    x = torch.randn(1, 5, 4, 3)
    y = call(x, torch.randn(1, 5, 4), -torch.rand(4), torch.randn(1, 5, 2, 6),
             torch.randn(1, 5, 2, 6), torch.ones(4), torch.zeros(4))
    assert y.shape == x.shape and sys.modules["mamba_ssm.ops.triton.ssd_combined"].CALLS == [
        bench.MODEL_CHUNK]


def test_loader_refuses_a_different_loaded_mamba_ssm(bench, tmp_path, monkeypatch):
    monkeypatch.setenv("ONBOARD_ANCHOR_MAMBA_SSM", str(_tree(tmp_path / "a")))
    bench.mamba_ssm_module()
    monkeypatch.setenv("ONBOARD_ANCHOR_MAMBA_SSM", str(_tree(tmp_path / "b")))
    with pytest.raises(RuntimeError, match="already imported"):
        bench.mamba_ssm_module()


def test_missing_anchor_is_unavailable(bench, tmp_path, monkeypatch):
    from onboarding.bench.harness import Unavailable

    monkeypatch.setenv("ONBOARD_ANCHOR_MAMBA_SSM", str(tmp_path))  # no mamba_ssm/ in it
    with pytest.raises(Unavailable, match="holds no mamba_ssm/ folder"):
        bench.mamba_ssm_module()
    broken = _tree(tmp_path / "broken")
    (broken / "mamba_ssm/ops/triton/helper.py").write_text("import einops_not_carried\n")
    monkeypatch.setenv("ONBOARD_ANCHOR_MAMBA_SSM", str(broken))
    with pytest.raises(Unavailable, match="failed: ModuleNotFoundError: No module named 'einops_not"):
        bench.mamba_ssm_module()
    for name in [m for m in sys.modules if m.startswith("mamba_ssm")]:
        del sys.modules[name]
    monkeypatch.delenv("ONBOARD_ANCHOR_MAMBA_SSM")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p])  # nothing installed either
    import importlib.util

    if importlib.util.find_spec("mamba_ssm") is not None:
        pytest.skip("a mamba_ssm is installed here")
    with pytest.raises(Unavailable, match="not installed, and \\$ONBOARD_ANCHOR_MAMBA_SSM"):
        bench.mamba_ssm_module()


def test_rows_only_on_request(bench):
    """Without --impl the anchor's rows are not set up (the harness drops `on_request` impls);
    named in --impl they are kept."""
    from onboarding.bench.cases import select_cases

    case = bench.ssd_case(1, 40, 4, 16, 2, 16)
    assert set(case.on_request) == {"mamba_ssm", "mamba_ssm_fwd"}
    assert select_cases([case])[0].on_request == case.on_request
    picked = select_cases([case], None, ["ours", "mamba_ssm_fwd"])[0]
    assert picked.on_request == ("mamba_ssm",)


def _run(case, monkeypatch):
    """The harness on the CPU (interpreter), timers replaced: which rows were timed, and how."""
    from onboarding.bench.harness import Timing, run_cases

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    timed = []

    def timer(step):
        timed.append(step)
        return Timing(median_ms=1.0, p20_ms=1.0, p80_ms=1.0, repeats=1)

    res = run_cases([case], torch.device("cpu"), log=lambda s: None, timer=timer,
                    round_timer=lambda step: 1.0, graph_timer=None, ceilings={"copy_tb_s": 4.0})
    return {r["impl"]: r for r in res["rows"]}


@pytest.mark.parametrize("scale, ok", [(1.0, True), (1.1, False)])
def test_anchor_check_guards_its_rows(bench, tmp_path, monkeypatch, scale, ok):
    """The anchor's check (y and every gradient against ours, the same inputs) is on its rows;
    an anchor computing another function (y x 1.1) is not timed. Also checks the fake's scan
    against our kernel in the interpreter (it passes at scale 1)."""
    from onboarding.bench.cases import select_cases

    monkeypatch.setenv("ONBOARD_ANCHOR_MAMBA_SSM", str(_tree(tmp_path / "src", scale)))
    case = select_cases([bench.ssd_case(1, 12, 4, 8, 2, 8)], None,
                        ["ours_fwd", "mamba_ssm", "mamba_ssm_fwd"])[0]
    case = dataclasses.replace(case, check=None)  # the torch path's check: tests/kernel_tests/test_ssd.py
    rows = _run(case, monkeypatch)
    assert set(rows) == {"ours_fwd", "mamba_ssm", "mamba_ssm_fwd"}
    chk = rows["mamba_ssm"]["check"]
    assert set(chk) == {"y", *bench.NAMES, "ok"} and chk == rows["mamba_ssm_fwd"]["check"]
    if ok:
        assert chk["ok"] == 1.0 and max(v for k, v in chk.items() if k != "ok") < 0.01, chk
        assert rows["mamba_ssm"]["status"] == "ok" and rows["mamba_ssm"]["timing"]
        assert rows["ours_fwd"]["ratios"] == {"mamba_ssm_fwd": 1.0}
    else:
        assert chk["ok"] == 0.0 and chk["y"] > 0.05, chk
        for impl in ("mamba_ssm", "mamba_ssm_fwd"):
            assert rows[impl]["status"] == "check failed" and rows[impl]["timing"] is None
            assert rows[impl]["error"].startswith("check failed: y=")
        assert rows["ours_fwd"]["ratios"] == {}


def test_missing_anchor_rows_are_skipped(bench, tmp_path, monkeypatch):
    from onboarding.bench.cases import select_cases
    from onboarding.bench.harness import format_table

    monkeypatch.setenv("ONBOARD_ANCHOR_MAMBA_SSM", str(tmp_path))
    case = select_cases([bench.ssd_case(1, 12, 4, 8, 2, 8)], None, ["mamba_ssm", "mamba_ssm_fwd"])[0]
    case = dataclasses.replace(case, check=None)
    rows = _run(case, monkeypatch)
    for impl in ("mamba_ssm", "mamba_ssm_fwd"):
        assert rows[impl]["status"] == "skipped" and rows[impl]["timing"] is None
        assert "holds no mamba_ssm/ folder" in rows[impl]["error"]
    table = format_table({"rows": list(rows.values())})
    assert "SKIPPED: mamba_ssm: $ONBOARD_ANCHOR_MAMBA_SSM=" in table
