"""The plan's loss term against what `onboard train`'s loss allocates: the bytes live at once
during the loss's forward, counted on the CPU from the op outputs (`_Live`), for onboard's loss
kernel (Triton's interpreter: the path a GPU run attaches) and for `_ChunkedCE` (the torch path);
and when the gradient autograd keeps for the head is freed (before any layer's backward)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import onboarding.plan.memory as PM
import onboarding.train.worker as W
from onboarding.plan import ClusterConfig, PlanConfig
from onboarding.plan.memory import FP32, Layout, logits_key, loss_workspace, memory
from onboarding.plan.shapes import ModelShape

class _Live(TorchDispatchMode):
    """The most bytes of op outputs alive at once while the mode is on (storages made inside it,
    counted once, dropped when freed: checked after every op), ``before`` left out."""

    def __init__(self, before=()):
        super().__init__()
        self.before = {t.untyped_storage().data_ptr() for t in before}
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                if s.data_ptr() not in self.before:
                    self.refs.setdefault(s.data_ptr(), (StorageWeakRef(s), s.nbytes()))
        self.refs = {k: v for k, v in self.refs.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.refs.values()))
        return out


def _shape(vocab: int, loss_kernel: str = "") -> ModelShape:
    return ModelShape(name="m", hidden=8, vocab=vocab, n_layers=1, total=0, routed=0,
                      dense_tensors=[], experts=[], blocks=[], layer_dense_max=0,
                      dense_matmul=0, config=None, loss_kernel=loss_kernel)


def _loss_peak(fn, n: int, v: int) -> int:
    """Most bytes the loss ``fn(logits [n, v], targets)`` holds at once beyond the logits."""
    gen = torch.Generator().manual_seed(0)
    logits = (2 * torch.randn(n, v, generator=gen)).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen)
    with _Live([logits, targets]) as live:
        fn(logits, targets)
    return live.peak


def _planned(n: int, v: int, *, kernels: bool, family: str = "") -> float:
    """The plan's loss bytes beyond the logits (the model's output, which the measurement
    leaves out): the gradient it keeps (the logits' bytes, `logits_key`) and its workspace less
    the logits, i.e. the workspace's bytes."""
    cfg = PlanConfig(gpus=1, ep=1, seq=n, micro_batch=1, kernels=kernels)
    return loss_workspace(_shape(v, family), cfg, n)[0]


def test_the_plans_chunk_is_the_losss():
    assert PM.CE_CHUNK_ELEMENTS == W.CE_CHUNK_ELEMENTS


def test_loss_kernel_holds_its_gradient_and_a_loss_per_token(tmp_path):
    """onboard's loss kernel (the cross-entropy family's training variant, which `onboard train`
    attaches on a GPU) writes the logits' gradient and an fp32 loss per row, and nothing else:
    the plan's kernel-path workspace, to the few bytes of the scalar loss. Before, the plan
    charged `_ChunkedCE`'s three fp32 chunks there too: 0.75 GiB that a GPU run never allocates,
    the constant over-prediction of the H100 validation's qwen3_moe rows (0.67-0.71 GiB)."""
    from onboarding.families import training_kernel
    from onboarding.train.kernels import LOSS_KIND, load_training_variant

    family, _ = training_kernel(LOSS_KIND)
    kernel = load_training_variant((family, _), Path(tmp_path), 0).entry
    n, v = 96, 500
    measured = _loss_peak(kernel, n, v)
    assert measured == pytest.approx(_planned(n, v, kernels=True, family=family), abs=64)
    assert measured < 2 * v * n + FP32 * n + 64  # no fp32 chunk of logits


@pytest.mark.parametrize("n", [40, 64, 150, 256])
def test_chunked_loss_holds_its_chunks(monkeypatch, n):
    """`_ChunkedCE` (the torch path: a CPU run, --no-kernels) at chunks of 64 rows: one chunk
    (40, 64 rows) holds three fp32 chunks at once besides its gradient, more than one (150: a
    partial third, 256) four, the previous chunk's log-softmax and one-hot gradient alive while
    the next one's fp32 copy and log-softmax are made. Before, the plan counted three
    everywhere."""
    v = 200
    monkeypatch.setattr(W, "CE_CHUNK_ELEMENTS", 64 * v)
    monkeypatch.setattr(PM, "CE_CHUNK_ELEMENTS", 64 * v)
    measured = _loss_peak(W.chunked_cross_entropy, n, v)
    # to the chunk's targets and mask (9 bytes a row) the plan leaves out, and a few scalars
    assert measured == pytest.approx(_planned(n, v, kernels=False), abs=16 * n + 64)
    # without a family serving the loss, the kernel path is the torch one
    assert _planned(n, v, kernels=True) == _planned(n, v, kernels=False)


def test_the_heads_backward_frees_the_loss_gradient_before_a_layers():
    """The gradient the loss keeps for the backward (the logits' bytes) is freed by the head's
    backward, before any layer's backward runs (autograd's engine, the same on a GPU): so the
    plan's peak at a layer's backward (recompute full, a layer's dispatch buffers) does not count
    it, while the end of the forward (the logits, their gradient, the loss's temporaries) does.
    Before, a layer's workspace was added on top of the gradient: with the loss kernel's
    workspace, qwen3_moe's T8192 recompute-full row of the H100 validation would have read 3.22
    GiB (its re-run layer's 1.39 GiB over the 1 GiB gradient; measured 2.91) instead of 2.83."""
    torch.manual_seed(0)
    emb, layer, head = nn.Embedding(50, 16), nn.Linear(16, 16), nn.Linear(16, 50, bias=False)
    ids = torch.randint(0, 50, (2, 9))
    h = layer(emb(ids[:, :-1]))
    seen = []
    h.register_hook(lambda g: seen.append(kept.expired()))  # the layer's backward starts
    loss = W.chunked_cross_entropy(head(h).reshape(-1, 50), ids[:, 1:].reshape(-1))
    (saved,) = loss.grad_fn.saved_tensors
    kept = StorageWeakRef(saved.untyped_storage())
    del saved
    loss.backward()
    assert seen == [True]

    # the plan: where one layer's workspace (recompute full: the layer re-run, its dispatch
    # buffers) exceeds the loss's, the peak is that layer's backward, after the head's: the
    # layers' inputs and that workspace, without the logits' gradient
    from dataclasses import replace

    from test_plan_recompute import _moe_shape

    tokens = 4096
    shape = replace(_moe_shape(), loss_kernel="cross_entropy")
    cfg = PlanConfig(gpus=1, ep=1, seq=tokens, micro_batch=1)
    mem = memory(shape, cfg, Layout(ep=1, fsdp=1, recompute="full", offload="none"),
                 ClusterConfig())
    logits = mem.activations[logits_key(cfg)]
    layer_ws = max(PM.block_saved(b, shape, cfg, 1)[2] for b in PM._counted_blocks(shape)) \
        * tokens + PM._per_layer_max(shape, cfg, 1, tokens)
    assert layer_ws - logits > loss_workspace(shape, cfg, tokens)[0]
    assert mem.workspace == pytest.approx(layer_ws - logits)
    assert "less the logits' gradient" in mem.workspace_what
