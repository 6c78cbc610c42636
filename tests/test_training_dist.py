"""Distributed LoRA training on the CPU with gloo: expert parallelism, FSDP2 x EP, DCP resume.

Each parallel run is launched with torchrun as a subprocess and compared step by step with the
single-process reference of the same config (fp32: within 1e-5 relative). Tiny proxies of
hf:qwen3_moe and hf:qwen3_next keep each run at a few seconds per step on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from onboarding.train.config import TrainConfig
from onboarding.train.metrics import expert_load, overlap_stats

FIXTURES = Path(__file__).resolve().parent / "fixtures"
REL_TOL = 1e-5  # the bound for fp32 on the CPU


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.update(extra)
    return env


def _torchrun(nproc: int, *args: str, env: dict | None = None, cwd: Path | None = None,
              timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env or _env(), cwd=cwd,
                          timeout=timeout)


def _reference(cfg_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onboarding.train.worker", "--config",
                           str(cfg_path), "--role", "reference"], capture_output=True,
                          text=True, env=_env(), timeout=300)


def _parallel(cfg_path: Path, nproc: int, **env: str) -> subprocess.CompletedProcess:
    return _torchrun(nproc, "-m", "onboarding.train.worker", "--config", str(cfg_path),
                     "--role", "parallel", env=_env(**env))


def _ok(p: subprocess.CompletedProcess) -> None:
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])


def _rows(out: Path, role: str) -> list[dict]:
    rows = [json.loads(x) for x in (out / "train" / f"{role}.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    return rows


def _losses(out: Path, role: str) -> list[float]:
    return [r["loss"] for r in _rows(out, role)]


def _config(tmp: Path, **kw) -> Path:
    base = dict(proxy="tiny", out=str(tmp), steps=5, seq_len=32, micro_batch=2, lr=1e-2,
                lora_rank=4, lora_alpha=8.0)
    base.update(kw)
    return TrainConfig(**base).to_toml(tmp / "train.toml")


def _assert_curves_match(out: Path) -> None:
    """Loss and pre-clip gradient norm per step. AdamW hides a constant gradient scale (it
    divides by the gradient's own RMS), so the norm is what catches a wrong divide factor."""
    ref, par = _rows(out, "reference"), _rows(out, "parallel")
    assert len(ref) == len(par) and ref
    for key in ("loss", "grad_norm"):
        a, b = [r[key] for r in par], [r[key] for r in ref]
        rel = [abs(x - y) / abs(y) for x, y in zip(a, b)]
        assert max(rel) <= REL_TOL, f"{key}: parallel {a} vs reference {b}: rel {rel}"
    assert ref[-1]["loss"] < ref[0]["loss"]  # it trains: the adapters move the loss


# ---- the expert-parallel module alone --------------------------------------------------------

EP_CASES = ["dropless-vs-transformers", "expert-lora-capacity", "non-gated-vs-transformers",
            "non-gated-expert-lora", "gpt-oss-vs-transformers", "gpt-oss-capacity"]


def test_ep_experts_match_one_process_with_zero_splits():
    """EP=2: outputs, input/routing-weight grads and expert-LoRA grads equal one process holding
    every expert (and the transformers module); one expert and one rank pair get no rows. SwiGLU
    experts (Qwen3-MoE's), non-gated ones (NemotronH's up -> relu(x)^2 -> down) and gpt-oss's
    (x @ W, interleaved gate/up, biases, clamped sigmoid GLU); dropless, with expert LoRA and
    with a capacity factor. All cases in one torchrun (a process group's start is most of a
    case's time); each case prints its own OK line, and the first failure names its case."""
    p = _torchrun(2, str(FIXTURES / "ep_check.py"), *EP_CASES, timeout=240)
    _ok(p)
    done = [line.split()[1] for line in p.stdout.splitlines() if line.startswith("EP_CHECK_OK")]
    assert done == EP_CASES, (done, p.stdout[-2000:])


# ---- whole training runs --------------------------------------------------------------------

def _proxy(cfg_path: Path):
    """(proxy config, fp32 bytes of its parameters: what every rank holds before it shards
    experts), without building weights."""
    from onboarding.train.setup import model_info

    info = model_info(TrainConfig.from_toml(cfg_path))
    model = info.loaded.build(info.proxy_config, device="meta", seed=None)
    return info.proxy_config, 4 * sum(p.numel() for p in model.parameters())


def _assert_a2a_shares(rows: list[dict], profiled: list[int], *, all_to_all: bool) -> None:
    """Profiled steps (and only those) carry the all-to-all share of the step's time: total and
    exposed, 0 <= exposed <= total <= 1; above 0 where expert parallelism exchanges tokens,
    exactly 0 where nothing does (the single-process reference)."""
    assert [r["step"] for r in rows if "a2a_share" in r] == profiled
    for r in rows:
        if "a2a_share" not in r:
            assert "a2a_exposed_share" not in r and "a2a_ms" not in r
            continue
        assert 0.0 <= r["a2a_exposed_share"] <= r["a2a_share"] <= 1.0, r
        assert r["a2a_ms"] == pytest.approx(r["a2a_share"] * r["step_time_s"] * 1e3)
        if all_to_all:
            assert r["a2a_ms"] > 0 and r["a2a_exposed_share"] > 0, r
        else:
            assert r["a2a_ms"] == 0.0 and r["a2a_share"] == 0.0, r


@pytest.mark.slow
def test_world2_ep2_matches_reference(tmp_path):
    """EP=2 on two gloo ranks against the reference, profiling every 2nd step (`--profile-every
    2`): the all-to-all share of the profiled steps, the expert load, peak memory."""
    from onboarding.train.compare import compare

    cfg = _config(tmp_path, model="hf:qwen3_moe", nproc=2, ep=2, fsdp=1, profile_every=2)
    _ok(_reference(cfg))
    _ok(_parallel(cfg, 2))
    _assert_curves_match(tmp_path)
    rows = _rows(tmp_path, "parallel")
    proxy, model_bytes = _proxy(cfg)
    load = rows[0]["expert_load"]
    k = proxy.num_experts_per_tok
    assert len(load) == 2 and sum(load[0]["tokens"]) == 2 * 2 * 32 * k  # 2 ranks x 2 x 32 x k
    assert rows[0]["aux"] is not None
    _assert_a2a_shares(rows, [2, 4], all_to_all=True)
    _assert_a2a_shares(_rows(tmp_path, "reference"), [2, 4], all_to_all=False)
    metrics = compare(tmp_path, plot=False)["metrics"]["parallel"]  # the medians the table shows
    assert 0 < metrics["a2a_exposed_share"] <= metrics["a2a_share"] <= 1
    # peak memory (max RSS on the CPU) holds at least the model, and not more than the machine
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for r in rows:
        assert model_bytes <= r["peak_mem_bytes"] <= ram, (model_bytes, r["peak_mem_bytes"])
    assert (tmp_path / "train/adapter/adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_world4_fsdp2_ep2_expert_lora_matches_reference(tmp_path):
    """FSDP=2 x EP=2 on a hybrid (gated delta + attention) MoE, expert LoRA, activation
    checkpointing, gradient clipping and a capacity factor (drops per EP group)."""
    cfg = _config(tmp_path, model="hf:qwen3_next", nproc=4, ep=2, fsdp=2, micro_batch=1,
                  steps=4, expert_lora=True, activation_checkpointing=True, grad_clip=0.5,
                  capacity_factor=1.0)
    _ok(_reference(cfg))
    _ok(_parallel(cfg, 4))
    _assert_curves_match(tmp_path)
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "train/adapter/adapter_model.safetensors"))
    experts = [k for k in tensors if ".mlp.experts." in k]
    from onboarding.load.model import load_model
    from onboarding.graph.parse import load_stage

    n_experts = load_stage(load_model("hf:qwen3_next")).proxy_config.num_experts
    assert experts and all(tensors[k].shape[0] in (n_experts * 4, 128) for k in experts)


@pytest.mark.slow
def test_killed_rank_resumes_from_dcp_identically(tmp_path):
    cfg = _config(tmp_path, model="hf:qwen3_moe", nproc=2, ep=2, fsdp=1, expert_lora=True,
                  checkpoint_interval=2)
    _ok(_reference(cfg))
    crashed = _parallel(cfg, 2, ONBOARD_TEST_KILL="1:3")
    assert crashed.returncode != 0
    before = _losses(tmp_path, "parallel")
    assert len(before) == 3  # rank 0 logged step 3; the checkpoint is of step 2
    resumed = _parallel(cfg, 2)
    _ok(resumed)
    assert "resumed from" in resumed.stdout and "step_000002" in resumed.stdout
    after = _losses(tmp_path, "parallel")
    assert after[:3] == before  # step 3 recomputed from the checkpoint: the very same loss
    _assert_curves_match(tmp_path)


# ---- helpers --------------------------------------------------------------------------------

def test_overlap_stats_counts_only_uncovered_all_to_all_time():
    total, exposed = overlap_stats([(0, 10), (5, 12), (20, 30)], [(8, 22), (25, 26)])
    assert total == 22 and exposed == 22 - (12 - 8) - (22 - 20) - 1


def test_expert_load_imbalance():
    rows = expert_load(torch.tensor([[4, 0, 2, 2], [2, 2, 2, 2]]), ["a", "b"])
    assert rows[0]["max_over_mean"] == 2.0 and rows[0]["empty_experts"] == 1
    assert rows[1]["max_over_mean"] == 1.0
