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
    from onboarding.bench.cases_moe import _moe_sets

    moe = {c.name: c for c in cases_for(["moe_experts"])}
    fwd = moe["qwen3_next/E512K10D2048F512N8192/uniform/fwd"]
    assert moe["qwen3_next/E512K10D2048F512N8192/uniform/fwdbwd_frozen"].flops == 2 * fwd.flops
    assert not any(n.endswith("fwdbwd_frozen") and "deepseek" in n for n in moe)
    cpu = torch.device("cpu")
    frozen = _moe_sets(6, 2, 16, 12, 37, "uniform", cpu, grad=True, frozen=True)[0]
    trained = _moe_sets(6, 2, 16, 12, 37, "uniform", cpu, grad=True)[0]
    assert [a.requires_grad for a in frozen] == [True, False, True, False, False]
    assert [a.requires_grad for a in trained] == [True, False, True, True, True]


def test_non_gated_moe_cases_and_their_anchors_agree_with_the_kernel():
    """`anchor_mlp` times the `mlp` experts (relu^2) against anchors that compute what it does:
    the per-expert loop and argsort + `_grouped_mm` with up [E, F, D] (fp32, tiny shapes)."""
    import torch

    from onboarding.bench.cases import _kernel, cases_for
    from onboarding.bench.cases_moe import grouped_mm_mlp, routing, transformers_loop_mlp

    moe = {c.name: c for c in cases_for(["moe_experts"])}
    fwd = moe["anchor_mlp/E64K8D2048F512N8192/uniform/fwd"]
    assert fwd.flops == 4 * 8192 * 8 * 2048 * 512  # up and down, 2 S D F each
    assert moe["anchor_mlp/E64K8D2048F512N8192/uniform/fwdbwd"].flops == 3 * fwd.flops
    mod, ours = _kernel("moe_experts", "mlp", {"activation": "relu2"})
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
    from onboarding.templating import TEMPLATE_DIR

    other = tmp_path / "kernel_templates"
    shutil.copytree(TEMPLATE_DIR, other)
    with open(other / "rmsnorm.py.j2", "a") as f:
        f.write("\nMARKER_OF_THE_OTHER_REVISION = True\n")

    built = []

    @C.shared_inputs
    def inputs(n: int, seed: int = 0):
        built.append(n)
        return torch.randn(n, generator=torch.Generator().manual_seed(seed))

    def setup(device):
        mod, _ = C._kernel("rmsnorm", "plain")
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
    from onboarding.templating import TEMPLATE_DIR

    if not (TEMPLATE_DIR.parent / ".git").exists():
        pytest.skip("not a git checkout")
    path, sha = templates_at("HEAD")
    assert (path / "gated_delta.py.j2").is_file() and len(sha) == 8
    with pytest.raises(InputError, match="no such revision"):
        templates_at("no-such-revision-anywhere")
    with pytest.raises(InputError, match="not a git checkout"):
        templates_at("HEAD", repo=tmp_path)


def test_against_takes_a_folder_of_templates(tmp_path):
    """`--against DIR`: a folder of *.j2 templates (a carried copy, no git history needed) gives
    rows tpl:<folder>; a folder without templates is refused by name."""
    from onboarding.bench.revision import resolve
    from onboarding.errors import InputError
    from onboarding.templating import TEMPLATE_DIR

    base = tmp_path / "base"
    base.mkdir()
    (base / "rmsnorm.py.j2").write_text((TEMPLATE_DIR / "rmsnorm.py.j2").read_text())
    assert resolve(str(base)) == (base.resolve(), "tpl:base")
    archived = tmp_path / "before" / "kernel_templates"  # `git archive REV kernel_templates` unpacked
    archived.mkdir(parents=True)
    (archived / "rmsnorm.py.j2").write_text((TEMPLATE_DIR / "rmsnorm.py.j2").read_text())
    assert resolve(str(archived)) == (archived.resolve(), "tpl:before")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="no \\*.j2 templates"):
        resolve(str(empty))


def test_grouped_linear_cases_and_their_anchors_agree_with_the_kernel():
    """`grouped_linear` cases time the kernel against the module's own loop (split + F.linear per
    expert) and `_grouped_mm`: both compute the reference's result, empty experts included."""
    import torch

    from onboarding.bench.cases import _kernel, cases_for
    from onboarding.bench.cases_grouped_linear import grouped_mm, loop

    cases = {c.name: c for c in cases_for(["grouped_linear"])}
    fwd = cases["fine/E64S65536K2048N1024/fwd"]
    assert fwd.flops == 2 * 65536 * 2048 * 1024 and cases["fine/E64S65536K2048N1024/fwdbwd"].flops == 3 * fwd.flops
    mod, _ = _kernel("grouped_linear", "sorted")
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 9, 3])
    x, w = torch.randn(17, 12, generator=gen), torch.randn(4, 10, 12, generator=gen)
    expected = mod.reference(x, counts, w)
    torch.testing.assert_close(loop(x, counts, w), expected)
    torch.testing.assert_close(grouped_mm(x, counts, w), expected, rtol=1e-5, atol=1e-5)
