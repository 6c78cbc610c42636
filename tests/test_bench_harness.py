"""Benchmark ratios from interleaved rounds (`onboarding.bench.harness`), with a fake timer
whose GPU drifts: no GPU needed."""

from __future__ import annotations

import pytest

from onboarding.bench.harness import interleaved_rounds, paired_ratios


class DriftingTimer:
    """Times `cost` ms steps on a device that gets `drift` slower with every timing."""

    def __init__(self, drift: float):
        self.factor, self.drift, self.order = 1.0, drift, []

    def __call__(self, step) -> float:
        self.order.append(step.name)
        t = step.cost * self.factor
        self.factor *= 1 + self.drift
        return t


class FakeStep:
    def __init__(self, name: str, cost: float):
        self.name, self.cost = name, cost

    def __call__(self, i: int):
        raise AssertionError("the timer runs the step, not the test")


def test_paired_ratios_survive_a_drift_that_sequential_timing_takes_for_speed():
    steps = {"ours": FakeStep("ours", 1.0), "anchor": FakeStep("anchor", 1.2)}  # truly 1.2x
    drift = 0.04
    seq = DriftingTimer(drift)  # sequential: all of ours, then all of the anchor
    ours_t = sorted(seq(steps["ours"]) for _ in range(3))[1]
    anchor_t = sorted(seq(steps["anchor"]) for _ in range(3))[1]
    assert anchor_t / ours_t == pytest.approx(1.2 * 1.04 ** 3)  # 12% too high
    timer = DriftingTimer(drift)
    rounds = interleaved_rounds(steps, 3, timer)
    assert timer.order == ["ours", "anchor", "anchor", "ours", "ours", "anchor"]  # rotated
    assert {n: len(t) for n, t in rounds.items()} == {"ours": 3, "anchor": 3}
    ratio = paired_ratios(rounds, "ours")["anchor"]
    assert abs(ratio - 1.2) <= 1.2 * drift + 1e-9  # at most one timing's drift off


def test_paired_ratios_take_the_median_round():
    rounds = {"ours": [1.0, 1.0, 1.0], "a": [2.0, 1.5, 9.0], "b": [0.5, 0.5, 0.5]}
    assert paired_ratios(rounds, "ours") == {"a": 2.0, "b": 0.5}  # one outlier round ignored


def test_frozen_experts_cases_leave_the_expert_weights_without_gradients():
    """`fwdbwd_frozen` (anchor, Qwen3-Next): gradients to x and the routing weights only, twice
    the forward's FLOPs (the dx GEMMs); the plain `fwdbwd` sets still make every input a leaf."""
    import torch

    from onboarding.bench.cases import cases_for
    from onboarding.families import family_module

    _moe_sets = family_module("moe_experts").bench._moe_sets
    moe = {c.name: c for c in cases_for(["moe_experts"])}
    fwd = moe["qwen3_next/E512K10D2048F512N8192/uniform/fwd"]
    assert moe["qwen3_next/E512K10D2048F512N8192/uniform/fwdbwd_frozen"].flops == 2 * fwd.flops
    assert not any(n.endswith("fwdbwd_frozen") and "deepseek" in n for n in moe)
    cpu = torch.device("cpu")
    frozen = _moe_sets(6, 2, 16, 12, 37, "uniform", cpu, grad=True, frozen=True)[0]
    trained = _moe_sets(6, 2, 16, 12, 37, "uniform", cpu, grad=True)[0]
    assert [a.requires_grad for a in frozen] == [True, False, True, False, False]
    assert [a.requires_grad for a in trained] == [True, False, True, True, True]


def test_moe_expert_weights_are_drawn_a_few_experts_at_a_time(monkeypatch):
    """The bench's expert weights: bf16 [E, rows, cols], N(0, 1 / cols), drawn in fp32
    WEIGHT_DRAW_EXPERTS experts at a time (one draw of DeepSeek-V3's gate_up was a 28 GiB fp32
    transient that put its N32768 fwd+bwd case out of an 80 GB card's memory), every expert filled."""
    import torch

    from onboarding.families import family_module

    bench = family_module("moe_experts").bench
    monkeypatch.setattr(bench, "WEIGHT_DRAW_EXPERTS", 4)
    draws, randn = [], torch.randn
    monkeypatch.setattr(torch, "randn", lambda *a, **k: draws.append(a[0]) or randn(*a, **k))
    w = bench._expert_weights(11, 24, 400, torch.device("cpu"), torch.Generator().manual_seed(1))
    assert draws == [4, 4, 3]
    assert w.shape == (11, 24, 400) and w.dtype == torch.bfloat16
    std = w.float().std(dim=(1, 2))
    assert ((std - 400 ** -0.5).abs() < 0.1 * 400 ** -0.5).all(), std  # each expert drawn, at the scale
    assert not torch.equal(w[0], w[4])  # the draws differ


def test_non_gated_moe_cases_and_their_anchors_agree_with_the_kernel():
    """`anchor_mlp` times the `mlp` experts (relu^2) against anchors that compute what it does:
    the per-expert loop and argsort + `_grouped_mm` with up [E, F, D] (fp32, tiny shapes)."""
    import torch

    from onboarding.bench.cases import cases_for, kernel, routing
    from onboarding.families import family_module

    bench = family_module("moe_experts").bench
    grouped_mm_mlp, transformers_loop_mlp = bench.grouped_mm_mlp, bench.transformers_loop_mlp

    moe = {c.name: c for c in cases_for(["moe_experts"])}
    fwd = moe["anchor_mlp/E64K8D2048F512N8192/uniform/fwd"]
    assert fwd.flops == 4 * 8192 * 8 * 2048 * 512  # up and down, 2 S D F each
    assert moe["anchor_mlp/E64K8D2048F512N8192/uniform/fwdbwd"].flops == 3 * fwd.flops
    mod, ours = kernel("moe_experts", "mlp", {"activation": "relu2"})
    gen = torch.Generator().manual_seed(0)
    idx, w = routing("zipf", 37, 6, 2, torch.device("cpu"), gen)
    x, up, down = torch.randn(37, 16, generator=gen), torch.randn(6, 12, 16, generator=gen), \
        torch.randn(6, 16, 12, generator=gen)
    expected = mod.reference(x, idx, w, up, down)
    torch.testing.assert_close(ours(x, idx, w, up, down), expected, rtol=1e-4, atol=1e-5)
    for fn in (transformers_loop_mlp, grouped_mm_mlp):
        torch.testing.assert_close(fn(x, idx, w, up, down), expected, rtol=1e-4, atol=1e-5)


def test_against_a_revision_adds_its_kernels_as_anchor_rows(tmp_path):
    """`onboard bench --against REV`: each case's ours / ours_fwd steps set up again from the
    other templates (their own op names), as rows rev:<sha> / rev:<sha>_fwd beside the tree's."""
    import shutil

    import torch

    from onboarding.bench import cases as C
    from onboarding.bench.harness import BenchCase
    from onboarding.bench.revision import against
    from onboarding.generate.templating import TEMPLATE_DIR

    other = tmp_path / "kernel_templates"
    shutil.copytree(TEMPLATE_DIR, other)
    with open(other / "rmsnorm" / "rmsnorm.py.j2", "a") as f:
        f.write("\nMARKER_OF_THE_OTHER_REVISION = True\n")

    built = []

    @C.shared_inputs
    def inputs(n: int, seed: int = 0):
        built.append(n)
        return torch.randn(n, generator=torch.Generator().manual_seed(seed))

    def setup(device):
        mod, _ = C.kernel("rmsnorm", "plain")
        x = inputs(4, seed=1)
        return {"ours": (mod, x), "ours_fwd": (mod, x), "eager": "eager step"}

    case = BenchCase(family="rmsnorm", name="x", shape={}, min_bytes=1, flops=0, setup=setup)
    [wrapped] = against([case], other, "rev:abc")
    steps = wrapped.setup("cpu")
    assert sorted(steps) == ["eager", "ours", "ours_fwd", "rev:abc", "rev:abc_fwd"]
    (ours, x), (theirs, x_theirs) = steps["ours"], steps["rev:abc"]
    assert getattr(theirs, "MARKER_OF_THE_OTHER_REVISION", False)
    assert not hasattr(ours, "MARKER_OF_THE_OTHER_REVISION")
    assert theirs.OP_NAME != ours.OP_NAME
    assert C._TEMPLATES == {"template_dir": None, "tag": None}  # the tree's templates again
    # both setups timed the same input set, built once; outside `against` each call builds its own
    assert x_theirs is x and built == [4]
    assert inputs(4, seed=1) is not x and built == [4, 4]


def test_templates_at_a_revision_and_bad_revisions(tmp_path):
    from onboarding.bench.revision import templates_at
    from onboarding.errors import InputError
    from onboarding.generate.templating import TEMPLATE_DIR

    if not (TEMPLATE_DIR.parent / ".git").exists():
        pytest.skip("not a git checkout")
    path, sha = templates_at("HEAD")
    assert (path / "gated_delta" / "gated_delta.py.j2").is_file() and len(sha) == 8
    with pytest.raises(InputError, match="no such revision"):
        templates_at("no-such-revision-anywhere")
    with pytest.raises(InputError, match="not a git checkout"):
        templates_at("HEAD", repo=tmp_path)


def test_against_takes_a_folder_of_templates(tmp_path):
    """`--against DIR`: a folder of *.j2 templates (a carried copy, no git history needed) gives
    rows tpl:<folder>; a folder without templates is refused by name."""
    from onboarding.bench.revision import resolve
    from onboarding.errors import InputError
    from onboarding.generate.templating import TEMPLATE_DIR

    base = tmp_path / "base"  # the flat layout of revisions before the per-family folders
    base.mkdir()
    (base / "rmsnorm.py.j2").write_text((TEMPLATE_DIR / "rmsnorm" / "rmsnorm.py.j2").read_text())
    assert resolve(str(base)) == (base.resolve(), "tpl:base")
    archived = tmp_path / "before" / "kernel_templates"  # `git archive REV kernel_templates` unpacked
    (archived / "rmsnorm").mkdir(parents=True)  # the per-family layout
    (archived / "rmsnorm" / "rmsnorm.py.j2").write_text((TEMPLATE_DIR / "rmsnorm" / "rmsnorm.py.j2").read_text())
    assert resolve(str(archived)) == (archived.resolve(), "tpl:before")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="no \\*.j2 templates"):
        resolve(str(empty))


def test_grouped_linear_cases_and_their_anchors_agree_with_the_kernel():
    """`grouped_linear` cases time the kernel against the module's own loop (split + F.linear per
    expert) and `_grouped_mm`: both compute the reference's result, empty experts included."""
    import torch

    from onboarding.bench.cases import cases_for, kernel
    from onboarding.families import family_module

    bench = family_module("grouped_linear").bench
    grouped_mm, loop = bench.grouped_mm, bench.loop

    cases = {c.name: c for c in cases_for(["grouped_linear"])}
    fwd = cases["fine/E64S65536K2048N1024/fwd"]
    assert fwd.flops == 2 * 65536 * 2048 * 1024 and cases["fine/E64S65536K2048N1024/fwdbwd"].flops == 3 * fwd.flops
    mod, _ = kernel("grouped_linear", "sorted")
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 9, 3])
    x, w = torch.randn(17, 12, generator=gen), torch.randn(4, 10, 12, generator=gen)
    expected = mod.reference(x, counts, w)
    torch.testing.assert_close(loop(x, counts, w), expected)
    torch.testing.assert_close(grouped_mm(x, counts, w), expected, rtol=1e-5, atol=1e-5)


class CountingTimer:
    """A CPU stand-in for the harness's GPU timers: `step.cost` ms, every call recorded."""

    def __init__(self):
        self.timed: list[str] = []

    def __call__(self, step):
        from onboarding.bench.harness import Timing

        self.timed.append(step.name)
        return Timing(median_ms=step.cost, p20_ms=step.cost, p80_ms=step.cost, repeats=1)

    def rounds(self, step) -> float:
        self.timed.append(step.name)
        return step.cost


def _fake_case(name: str, check):
    from onboarding.bench.harness import BenchCase

    def setup(device):
        return {"ours": FakeStep(f"{name}:ours", 1.0), "ours_fwd": FakeStep(f"{name}:ours_fwd", 0.4),
                "ours@BLOCK=64": FakeStep(f"{name}:ours@BLOCK=64", 1.1),
                "eager": FakeStep(f"{name}:eager", 2.0), "eager_fwd": FakeStep(f"{name}:eager_fwd", 0.8)}

    return BenchCase(family="fake", name=name, shape={"N": 4}, min_bytes=10**9, flops=0,
                     setup=setup, check=check)


def test_a_row_whose_check_raised_or_failed_is_not_timed_and_says_why():
    """A case's check guards every row of our kernel: raised, ``ok`` 0 or a NaN error -> our rows
    are not timed, get no ratios, status "check failed" with the reason in the JSON row and in
    the table; the anchors are still timed. A passing check's case gets its ratios as before."""
    import torch

    from onboarding.bench.harness import format_table, run_cases

    def raises(device):
        raise RuntimeError("kernel returned garbage")

    cases = [_fake_case("raised", raises),
             _fake_case("not_ok", lambda device: {"o": 0.02, "dq": 0.001, "ok": 0.0}),
             _fake_case("nan", lambda device: {"out0": float("nan"), "grad0": 1e-3}),
             _fake_case("passed", lambda device: {"o": 1e-3, "ok": 1.0})]
    timer, logs = CountingTimer(), []
    result = run_cases(cases, torch.device("cpu"), log=logs.append, timer=timer,
                       round_timer=timer.rounds, graph_timer=None, ceilings={"copy_tb_s": 4.0})
    rows = {(r["case"], r["impl"]): r for r in result["rows"]}
    assert len(rows) == 4 * 5
    reasons = {"raised": "check raised RuntimeError: kernel returned garbage",
               "not_ok": "check failed: o=0.02 dq=0.001", "nan": "check failed: non-finite out0"}
    for case, reason in reasons.items():
        for impl in ("ours", "ours_fwd", "ours@BLOCK=64"):
            r = rows[case, impl]
            assert r["status"] == "check failed" and r["error"] == reason, (case, impl)
            assert r["timing"] is None and r["gbps"] is None and r["roofline_frac"] is None
            assert r["ratios"] == {} and r["rounds_ms"] == [] and r["graph_ratios"] == {}
            assert f"{case}:{impl}" not in timer.timed  # never run as a timed result
        for impl in ("eager", "eager_fwd"):  # the anchors' own times are still valid
            assert rows[case, impl]["status"] == "ok" and rows[case, impl]["timing"]["median_ms"] > 0
    assert rows["raised", "ours"]["check"] == {"error": "RuntimeError: kernel returned garbage"}
    ok, ok_fwd = rows["passed", "ours"], rows["passed", "ours_fwd"]
    assert ok["status"] == "ok" and ok["error"] == "" and ok["timing"]["median_ms"] == 1.0
    assert ok["ratios"] == {"eager": 2.0} and ok_fwd["ratios"] == {"eager_fwd": 2.0}
    assert ok["rounds_ms"] == [1.0, 1.0, 1.0] and ok["gbps"] == pytest.approx(1000.0)
    assert any("raised: check raised RuntimeError" in line for line in logs)

    table = format_table(result).splitlines()
    assert table[0].split()[:3] == ["case", "impl", "status"]
    line = next(t for t in table if t.startswith("fake/raised") and " ours " in t)
    assert line.split()[2:5] == ["check", "failed", "-"]  # status, then no time
    assert "CHECK FAILED: check raised RuntimeError: kernel returned garbage" in line
    assert "=" not in line.split("CHECK FAILED")[0]  # no ratios printed
    passed = next(t for t in table if t.startswith("fake/passed") and " ours " in t)
    assert passed.split()[2] == "ok" and "eager=2.00x" in passed and "FAILED" not in passed
    # the table says what its ratios are and that rows' medians are not to be divided
    assert any(t.startswith("ms, graph: each row's own median. ratios: anchor / ours in the same run")
               for t in table)


def test_profile_breaks_down_our_rows_and_sweep_rows_not_the_anchors(monkeypatch):
    """`--profile` (run_cases' ``profile``): ours, ours_fwd and the sweep rows (``ours@...``) get
    their kernel breakdown, the anchors none (a sweep row's breakdown is where a config's time goes
    against the default's)."""
    import torch

    from onboarding.bench import harness

    seen = []

    def breakdown(step):
        seen.append(step.name)
        return [{"kernel": "k", "ms": step.cost, "calls": 1, "share": 1.0}]
    monkeypatch.setattr(harness, "kernel_breakdown", breakdown)
    timer = CountingTimer()
    result = harness.run_cases([_fake_case("p", lambda device: {"o": 1e-3, "ok": 1.0})], torch.device("cpu"),
                               log=lambda line: None, profile=True, timer=timer, round_timer=timer.rounds,
                               graph_timer=None, ceilings={"copy_tb_s": 4.0})
    assert sorted(seen) == ["p:ours", "p:ours@BLOCK=64", "p:ours_fwd"]
    rows = {r["impl"]: r for r in result["rows"]}
    assert rows["ours@BLOCK=64"]["kernels"][0]["ms"] == 1.1 and not rows["eager"].get("kernels")
    assert harness.profiled("rev:abc123") and harness.profiled("tpl:x") and not harness.profiled("eager_fwd")


def test_bench_check_rejects_a_kernel_that_returns_fewer_outputs():
    """`cases.bf16_check` pairs our outputs with the reference's: one output short is an error that
    names both counts (zip alone would judge the one output both have)."""
    import torch

    from onboarding.bench.cases import bf16_check as _check

    def make(dtype):
        g = torch.Generator().manual_seed(0)
        return (torch.randn(8, 16, generator=g, dtype=dtype),
                torch.randn(8, 16, generator=g, dtype=dtype))

    def ref(q, k):
        return q * 2, k * 3

    full = _check(lambda q, k: ref(q, k), ref, make)(torch.device("cpu"))
    assert set(full) == {"out0", "out1", "grad0", "grad1"} and max(full.values()) < 1e-2
    with pytest.raises(AssertionError, match="returned 1 outputs, the reference 2"):
        _check(lambda q, k: q * 2, ref, make)(torch.device("cpu"))


def test_sweep_rows_put_a_tuned_bucket_pin_back(tmp_path):
    """A sweep row (`config_sweep` / `fwd_sweep`) pins its config for the case's bucket while it runs;
    a pin the bucket had before (a tuned config, `apply_tuned`) is back after each step, so the
    rows timed later (``ours`` among them, interleaved) run the tuned config, not the bucket's
    default; with no pin before, none is left."""
    import torch

    from onboarding.bench.cases import config_sweep, fwd_sweep
    from onboarding.generate import templating

    mod = templating.load_module(templating.write_module(templating.render("rmsnorm", "plain", {}),
                                                         tmp_path / "rmsnorm_plain.py"))
    size = 64
    bucket = mod.shape_bucket(size)
    key = next(k for k, vals in mod.TUNING_SPACE.items() if len(vals) > 1)
    own = mod.config_for(size)[key]
    other = next(v for v in mod.TUNING_SPACE[key] if v != own)
    seen = []

    def fn(*args):
        seen.append(mod.config_for(size)[key])
        return args[0] * 2

    x = torch.randn(3, size, requires_grad=True)
    sets, grads = [(x,)], [torch.ones(3, size)]
    for tuned in (None, {key: other}):
        mod.set_config(tuned, bucket=bucket)
        before = mod.config_for(size)
        steps = {**config_sweep(mod, fn, sets, grads, size, [{key: own}, {key: other}]),
                 **fwd_sweep(mod, fn, sets, size, [{key: own}])}
        for step in steps.values():
            step(0)
            assert mod.config_for(size) == before, (tuned, step)
        assert mod._TUNED.get(bucket) == tuned
    assert seen[:3] == [own, other, own]  # each row ran its own pin
    mod.set_config(None, bucket=bucket)
