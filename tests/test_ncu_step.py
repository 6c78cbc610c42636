""".ci/h200/ncu_step.py (the driver h37_ncu.sh runs under Nsight Compute): its summaries of ncu's csv
pages, on made-up pages in the layouts ncu exports, and its run mode at a tiny case of each profiled
bucket under the interpreter, which must launch the kernel the script profiles."""

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _driver():
    spec = importlib.util.spec_from_file_location("ncu_step", ROOT / ".ci" / "h200" / "ncu_step.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _csv(*rows):
    return "".join(",".join(f'"{c}"' for c in r) + "\n" for r in rows)


STALLED = "smsp__pcsamp_warps_issue_stalled_"
SOURCE_CSV = _csv(
    ("Kernel Name", "ssd_bwd_split_fused_kernel"),
    ("# Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
     STALLED + "barrier", STALLED + "long_scoreboard", STALLED + "barrier_not_issued"),
    ("0x7f00", "      BAR.SYNC.DEFER_BLOCKING 0x0 ", "1,200", "1,100", "1,000", "0", "900"),
    ("0x7f10", "      LDG.E.128 R4, desc[UR4][R2.64] ", "600", "500", "0", "550", "0"),
    ("0x7f20", "  @P0 HMMA.16816.F32.BF16 R8, R12, R16, R8 ", "200", "20", "0", "0", "0"))

AVG = "smsp__average_warps_issue_stalled_"
RAW_CSV = _csv(
    ("ID", "Process ID", "Kernel Name", "gpu__time_duration.sum", "launch__registers_per_thread",
     AVG + "barrier_per_issue_active.ratio", AVG + "long_scoreboard_per_issue_active.ratio", STALLED + "barrier"),
    ("", "", "", "ms", "register/thread", "ratio", "ratio", ""),
    ("0", "123", "ssd_bwd_split_fused_kernel", "1.02", "255", "6.5", "1.5", "1,000"))


def test_summarize_source_ranks_reasons_opcodes_and_lines(tmp_path):
    path = tmp_path / "sass.csv"
    path.write_text(SOURCE_CSV)
    text = _driver().summarize_source(str(path), top=2)
    assert "3 rows, 2000 samples" in text
    # the reasons' shares exclude the *_not_issued columns: 1000 barrier, 550 long_scoreboard
    assert "by reason: barrier 64.5%, long_scoreboard 35.5%" in text
    # opcodes by samples, a predicate (@P0) skipped
    assert "by opcode: BAR 60.0%, LDG 30.0%, HMMA 10.0%" in text
    lines = text.splitlines()
    top = lines.index("top 2 rows by samples (%, top reasons, address, source):")
    assert "BAR.SYNC.DEFER_BLOCKING" in lines[top + 1] and "barrier:83%" in lines[top + 1]
    assert "LDG.E.128" in lines[top + 2] and len(lines) == top + 3


def test_summarize_source_without_a_header_says_so(tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text("==ERROR== nothing\n")
    assert "no source-page header" in _driver().summarize_source(str(path))


def test_summarize_raw_prints_key_metrics_and_stalls(tmp_path):
    path = tmp_path / "raw.csv"
    path.write_text(RAW_CSV)
    text = _driver().summarize_raw(str(path))
    assert "kernel ssd_bwd_split_fused_kernel" in text
    assert "gpu__time_duration.sum" in text and "1.02 ms" in " ".join(text.split())
    assert "barrier" in text and "81.2%" in text  # 6.5 of 8.0 cycles per issued instruction
    assert "warp samples" in text


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the --cpu mode runs under the interpreter")
@pytest.mark.parametrize("family, mode, kernel", [
    ("ssd", "fwdbwd", "ssd_bwd_split_fused_kernel"),
    ("kimi_delta", "fwdbwd", "kda_chunk_bwd_wy[tvk]p?_kernel"),
    ("gated_delta", "fwd", "gdn_prepare_fwd_kernel"),
])
def test_cpu_run_launches_the_profiled_kernel(family, mode, kernel, capsys):
    """h37_ncu.sh's rows: the bench's default module at a tiny case of the bench case's bucket launches
    the kernel its ncu regex names (the count per step is its --launch-count)."""
    rc = _driver().main(["--cpu", "--family", family, "--mode", mode, "--steps", "2", "--profile-from", "1",
                         "--expect", kernel])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "step 1 (profiled)" in out and "EXPECT OK" in out


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the kernel runs under the interpreter")
def test_launches_counts_by_name_leaves_warmups_out_and_restores_run():
    """ncu_step's launch counts (onboarding.testing.launches, shared with the runtime Monitor): each
    launch by kernel name, a warm-up (compile only) not counted, nested uses (Launches inside the
    Monitor) both see the launch, and run is the original again afterwards."""
    import torch
    import triton
    import triton.language as tl

    from onboarding.generate.llm.runtime import Monitor
    from onboarding.testing.launches import Launches, _classes

    @triton.jit
    def _twice(p_x, p_y, N, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        tl.store(p_y + o, 2.0 * tl.load(p_x + o, mask=o < N), mask=o < N)

    before = {cls: cls.__dict__["run"] for cls in _classes()}
    x = torch.randn(10)
    y = torch.zeros(10)
    with Monitor(poison=False) as mon, Launches() as launches:
        _twice[(1,)](x, y, 10, BLOCK=16)
        _twice[(1,)](x, y, 10, BLOCK=16)
        _twice.warmup(x, y, 10, BLOCK=16, grid=(1,))
        assert launches.take() == {"_twice": 2} and not launches.counts
    assert torch.equal(y, 2 * x)
    assert mon.record.kernels == ["_twice"] * 3  # the Monitor counts every run call, a warm-up too
    assert {cls: cls.__dict__["run"] for cls in _classes()} == before


def _host_step():
    import sys

    sys.path.insert(0, str(ROOT / ".ci" / "h200"))  # host_step imports ncu_step's tiny cases
    try:
        spec = importlib.util.spec_from_file_location("host_step", ROOT / ".ci" / "h200" / "host_step.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / ".ci" / "h200"))
    return mod


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the kernels run under the interpreter")
def test_host_step_reports_each_row_and_refuses_an_unknown_one(capsys):
    """.ci/h200/host_step.py (is a bench row's wall its host's or its kernels'?): at ssd's tiny case on the
    CPU it prints one line per row with host / gpu / wall ms (gpu nan off CUDA), and a row the case lacks
    is exit code 2 naming it, not a silent skip."""
    hs = _host_step()
    rc = hs.main(["--cpu", "--family", "ssd", "--impl", "ours", "--steps", "1", "--rounds", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    row = [ln.split() for ln in out.splitlines() if ln.startswith("ours ")]
    assert len(row) == 1 and float(row[0][1]) > 0 and row[0][2] == "nan" and float(row[0][3]) > 0, out
    rc = hs.main(["--cpu", "--family", "ssd", "--impl", "ours,ours@no_such_key=1", "--steps", "1", "--rounds", "1"])
    assert rc == 2 and "ours@no_such_key=1" in capsys.readouterr().err


def test_launch_cost_times_every_piece():
    """.ci/h200/launch_cost.py (the host pieces of a kernel call, bare): on the CPU (the interpreter) it
    times the Triton launch, torch.empty, a custom op with autograd and an autograd.Function, each a
    positive number of microseconds (the compiled-launcher row is GPU only)."""
    spec = importlib.util.spec_from_file_location("launch_cost", ROOT / ".ci" / "h200" / "launch_cost.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.main(["--cpu", "--n", "3", "--rounds", "1", "--args", "2"])
    assert set(rows) == {"triton launch, JIT path", "torch.empty (1 MiB)", "custom op with autograd (no-op body)",
                         "autograd.Function (no-op body)", "plain empty_like (the body alone)"}, rows
    assert all(v > 0 for v in rows.values()), rows


def test_par_pytest_reports_each_group(tmp_path):
    """.ci/h200/par_pytest.sh (pytest groups as parallel processes on the device): each group's summary,
    a failure's first assertion line, a group cut by its timeout, and the exit status counting the groups
    that did not pass (a -k expression quoted inside its group)."""
    import subprocess
    import sys

    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_t.py").write_text(
        "import time\n"
        "def test_ok(): assert 1\n"
        "def test_bad(): assert 2 + 2 == 5\n"
        "def test_also_ok(): assert 1\n"
        "def test_slow(): time.sleep(30)\n")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "TRITON_CACHE_DIR": str(tmp_path / "tc"),
           # the groups need no plugin: without autoloading them a pytest start takes ~0.8 s instead
           # of ~5 s on a loaded 2-core host, where three such starts had overrun the 8 s cut
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    run = subprocess.run(["bash", str(ROOT / ".ci" / "h200" / "par_pytest.sh"), "8", "tests/test_t.py::test_ok",
                          'tests/test_t.py -k "also_ok or bad"', "tests/test_t.py::test_slow"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    out = run.stdout
    assert run.returncode == 2, (run.returncode, out, run.stderr)
    lines = out.splitlines()
    assert lines[0] == "p1  tests/test_t.py::test_ok" and "1 passed" in lines[1], out
    assert lines[2] == 'p2  tests/test_t.py -k "also_ok or bad"' and "1 failed, 1 passed" in lines[3], out
    assert "assert (2 + 2) == 5" in lines[4] or "assert 4 == 5" in lines[4], out
    assert lines[5] == "p3  tests/test_t.py::test_slow" and "no summary: cut at 8 s" in lines[6], out
    assert sorted(p.name for p in (tmp_path / "out" / "r").iterdir()) == ["p1.txt", "p2.txt", "p3.txt"]
