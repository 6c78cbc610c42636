"""The run's decisions between stages (`onboarding.policy`), which the agent's nodes record."""

from __future__ import annotations

from types import SimpleNamespace

from onboarding.policy import (Budget, TrainPlan, next_exclusions, train_budget, train_layout,
                               train_plan, tune_budget)


def test_budgets_default_on_a_gpu_and_skip_on_the_cpu_saying_why():
    assert tune_budget(None, gpu="NVIDIA H200") == Budget(20)
    assert tune_budget(3, gpu="cpu-interpreter") == Budget(3)
    assert "no GPU" in tune_budget(None, gpu="cpu-interpreter").skipped
    assert tune_budget(0, gpu="NVIDIA H200").skipped == "skipped: tune_trials is 0"
    assert train_budget(None, gpus=8) == Budget(20) and train_budget(2, gpus=0) == Budget(2)
    assert "gloo" in train_budget(None, gpus=0).skipped
    assert train_budget(0, gpus=1).skipped == "skipped: train_steps is 0"


def test_train_layout_splits_experts_over_the_largest_common_divisor():
    assert train_layout(8, 64) == (8, 1) and train_layout(8, 6) == (2, 4)
    assert train_layout(4, None) == (1, 4) and train_layout(3, 7) == (1, 3)


def _graph(*experts: int):
    """What `train_plan` reads of an op graph: its MoE experts blocks' expert counts."""
    blocks = [SimpleNamespace(attrs={"n_experts": e}) for e in experts]
    return SimpleNamespace(by_kind=lambda kind: blocks if kind == "moe.experts" else [])


def test_train_plan():
    assert train_plan(_graph(64, 64), gpus=8) == TrainPlan(8, 8, 1, "bf16", "cuda")
    assert train_plan(_graph(4, 6), gpus=0) == TrainPlan(2, 1, 2, "fp32", "cpu")  # experts disagree
    assert train_plan(_graph(6), gpus=8, nproc=4) == TrainPlan(4, 2, 2, "bf16", "cuda")


def _result(passed, fwd=(), bwd=(), patches=(), logits=None):
    blocks = {"fwd": [SimpleNamespace(path=p) for p in fwd], "bwd": [SimpleNamespace(path=p) for p in bwd]}
    return SimpleNamespace(passed=passed, culprits=lambda d: blocks[d], patches=list(patches),
                           logits=logits or {})


def test_next_exclusions_leaves_out_kernels_at_inside_or_around_a_culprit_or_stops():
    active = [{"path": "m.norm", "family": "rmsnorm", "status": "active"},
              {"path": "m.mlp.act", "family": "swiglu", "status": "active"},
              {"path": "m.attn", "family": "rope", "status": "rejected"},
              {"path": "other", "family": "rmsnorm", "status": "active"}]
    assert next_exclusions(_result(True), [["a", "b"]]) == ([["a", "b"]], None)
    got = next_exclusions(_result(False, fwd=["m.norm"], bwd=["m.mlp"], patches=active), [])
    assert got == ([["m.norm", "rmsnorm"], ["m.mlp.act", "swiglu"]], None)
    again = next_exclusions(_result(False, fwd=["m.norm"], patches=active), [["m.norm", "rmsnorm"]])
    assert again.stop.startswith("no retry: the culprit m.norm runs no kernel of ours")
    none = next_exclusions(_result(False, logits={"stats": {"rel_rms": 0.5}, "max_rel_rms": 0.1}), [])
    assert none.excluded == [] and "no block is to blame (logits rel_rms 5.00e-01" in none.stop
