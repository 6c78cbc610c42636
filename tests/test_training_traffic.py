"""Copy traffic of a training step (issue 34): the bytes copy / cat / gather / sum ops move, counted
per source line by `onboarding.testing.traffic` over one step of the tiny Qwen3-MoE proxy in bf16,
prepared as the worker prepares our role. The experts' pair sums take CUDA's path (the pair-sum
kernel attached, as `attach_pair_sum_kernels` attaches it there), stood in for by ``embedding_bag``
(sum), which moves the kernel's bytes (each pair row read once, each sum written once; the counter
does not see inside a Triton launch), so the bytes are what the GPU step moves there. Fails when
an avoidable copy comes back (docs/LOG.md, twenty-fourth session, helper copies).
"""

from __future__ import annotations


import pytest
import torch
from torch.nn import functional as F

from onboarding.train.config import TrainConfig

REF = "hf:qwen3_moe"
# where expert parallelism's ops run: the experts module and its tensor ops
EP_FILES = ("onboarding/train/moe_ep.py", "onboarding/train/_moe_ep_ops.py")
TOKENS = (2, 64)


def pair_sum_standin(src, index, k):
    """The pair-sum kernel's traffic: ``embedding_bag`` reads each gathered row once and writes
    each sum once (on the CPU it rounds 16-bit sums per add: only bytes count here)."""
    return F.embedding_bag(index.view(-1, k), src, mode="sum")


@pytest.fixture(scope="module")
def step():
    """(traffic, the experts' pairs P, hidden width D, MoE layers) of one step of our role."""
    from fixtures.bf16_proxy import bf16_proxy

    from onboarding.train import _moe_ep_ops
    from onboarding.train.parallel import single_layout
    from onboarding.testing.traffic import counting
    from onboarding.train.worker import lm_loss, prepare

    built = bf16_proxy(REF)
    info = built.info
    cfg = TrainConfig(model=REF, dtype="bf16", device="cpu", kernels=False, lora_rank=8)
    ep_mods, _, _ = prepare(cfg, "reference", built, single_layout(), torch.device("cpu"))
    built.model.train()
    ids = torch.randint(0, info.proxy_config.vocab_size, (TOKENS[0], TOKENS[1] + 1),
                        generator=torch.Generator().manual_seed(0))
    for m in ep_mods:  # CUDA's path: the pair-sum kernel attached
        m.use_pair_sum_kernel(pair_sum_standin)
    mp = pytest.MonkeyPatch()
    plain_gmm = _moe_ep_ops._gmm

    def gmm(x, w_t, counts):  # CUDA's grouped GEMM (the CPU's loop would cat per expert)
        if x.dtype == w_t.dtype == torch.bfloat16:
            offs = torch.cumsum(_moe_ep_ops._counts(counts, x.device), 0, dtype=torch.int32)
            return torch._grouped_mm(x, w_t, offs=offs)
        return plain_gmm(x, w_t, counts)
    mp.setattr(_moe_ep_ops, "_gmm", gmm)
    try:
        with counting() as mode:
            loss = lm_loss(built.model, ids, chunked=True)
            mode.backward(loss)
    finally:
        mp.undo()
    assert torch.isfinite(loss)
    k = ep_mods[0]._k
    d = getattr(ep_mods[0], ep_mods[0].gate_up_name).shape[2]
    return mode.traffic, TOKENS[0] * TOKENS[1] * k, d, len(ep_mods)


def test_experts_combine_and_gather_backward_copy_no_pair_rows(step):
    """The experts' combine and the pair gather's backward sum each token's k rows in one pass
    (`_moe_ep_ops._sum_pairs` through the attached pair-sum kernel, one per layer each way): no
    [pairs, D] rows are placed back or gathered only to be summed, and no separate sum runs. The experts' data movement per MoE layer is then the pair gather
    forward (2 P D: its rows, read and written), the combine's bag sum (P D read, N D written),
    the combine's backward gather (2 P D) and the gather's backward bag sum (P D + N D), plus
    index-sized terms: at most 6.5 P D elements. With the placed copy and the separate sums
    (before) it was 8 P D of gathers and 2 (P D + N D) of sums."""
    traffic, pairs, d, layers = step
    # the weighted SwiGLU's torch path (a Triton kernel on CUDA) is not the combine's business
    rows = [(k, n, b) for k, n, b in traffic.by("phase", "category", "op", "line", "node")
            if (k[3].startswith(EP_FILES) or "(pair_sum_standin)" in k[3])
            and k[4] != "_SwiGLUWeightedBackward"]
    assert not [r for r in rows if r[0][1] == "sum" and r[2] >= pairs * d], rows
    moved = sum(b for k, n, b in rows if k[1] in ("gather", "copy", "cat"))
    assert moved <= 6.5 * pairs * d * 2 * layers, (moved / (pairs * d * 2 * layers), rows)
    bags = [(k[0], n) for k, n, _ in rows if "embedding_bag" in k[2]]
    assert sorted(bags) == [("backward", layers), ("forward", layers)], bags


def test_step_copy_traffic_stays_bounded(step):
    """The whole step's copy + cat + gather ops (`traffic.MOVES`): launches and bytes at most
    what this commit moves (tiny Qwen3-MoE proxy, 2 x 64 tokens, bf16, CPU torch paths for the
    norms and LoRA) plus 5%: a copy that comes back (a placed [pairs, D] copy, a
    ``.contiguous()``, a cast per step) fails here."""
    from onboarding.testing.traffic import MOVES

    traffic = step[0]
    n, b = traffic.total(MOVES)
    assert n <= BOUND_LAUNCHES * 1.05 and b <= BOUND_BYTES * 1.05, (n, b)


# measured at this commit (torch 2.13 CPU): 135 launches, 15,541,318 bytes; before the experts'
# pair sums (a78aba0's parent) the same step moved 137 launches, 17,495,110 bytes
BOUND_LAUNCHES, BOUND_BYTES = 135, 15_541_318
