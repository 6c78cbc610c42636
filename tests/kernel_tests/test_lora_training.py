"""Training's `LoRALinear` on the lora family's fused kernel (`attach_lora_kernels`): the attached
kernel agrees with the torch path (`_LoRADelta`) forward and in the gradients of x, A and B; a
wrong kernel is rejected (the torch path kept, counted, warned); layers the kernel cannot serve
keep the torch path and say why. CPU: the interpreter, fp32 (its bf16 maths is wrong)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from onboarding.bench.harness import time_fn
from onboarding.families import training_kernel
from onboarding.generate.templating import load_module, render_to
from onboarding.train import kernels as K
from onboarding.train.lora import LoRALinear

CPU_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "dot_precision": "ieee"}
FP32 = (torch.float32,)
KIND, REJECTED = K.LORA_LINEAR_KIND, f"rejected:{K.LORA_LINEAR_KIND}"


def _render(root):
    """The module `attach_lora_kernels` renders and loads (the family variant serving LoRALinear)."""
    return K.load_training_variant(training_kernel(KIND), root, 0)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The kernels dir `attach_lora_kernels` renders into, with the rendered module (the same
    module object it loads: modules are cached by content) pinned to small CPU tiles."""
    root = tmp_path_factory.mktemp("lora_train")
    _render(root).set_config(CPU_CONFIG)
    return root


@pytest.fixture(scope="module")
def fused(root):
    return _render(root).entry


def _layers(gen, *, dropout: float = 0.0) -> nn.Sequential:
    """Two LoRA linears at odd widths, one with a bias, random non-zero A and B."""
    torch.manual_seed(0)
    seq = nn.Sequential(LoRALinear(nn.Linear(37, 29, bias=False), rank=5, alpha=10.0, dropout=dropout),
                        LoRALinear(nn.Linear(29, 19), rank=3, alpha=1.5))
    with torch.no_grad():
        for m in seq:
            m.lora_A.weight.copy_(torch.randn(m.lora_A.weight.shape, generator=gen) * 0.2)
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=gen) * 0.2)
    return seq


def test_attached_kernel_matches_torch_path(root):
    assert training_kernel(KIND) == ("lora", "linear")  # the family says it serves LoRALinear
    gen = torch.Generator().manual_seed(1)
    model = _layers(gen)
    torch_path = copy.deepcopy(model)
    names = {n: (p.dtype, p.shape, p.requires_grad) for n, p in model.named_parameters()}
    assert K.attach_lora_kernels(model, root, rank=0, dtypes=FP32) == {KIND: 2, REJECTED: 0}
    assert all(m.kernel is not None for m in model) and all(m.kernel is None for m in torch_path)
    # parameters keep their names, dtypes and shapes (checkpoints and the PEFT export unchanged)
    assert {n: (p.dtype, p.shape, p.requires_grad) for n, p in model.named_parameters()} == names
    assert list(model.state_dict()) == list(torch_path.state_dict())

    x = torch.randn(2, 11, 37, generator=gen)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = model(xa), torch_path(xb)
    cot = torch.randn(ya.shape, generator=gen)
    (ya * cot).sum().backward()
    (yb * cot).sum().backward()
    torch.testing.assert_close(ya, yb, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-5, atol=1e-5)
    for (n, p), q in zip(model.named_parameters(), torch_path.parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if q.grad is not None:  # the adapters (fp32), and only them
            assert p.grad.dtype == torch.float32 and "lora_" in n
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)
    assert sum(p.grad is not None for p in model.parameters()) == 4
    # the module docstring's claim: the check passes at far tighter bars than bf16's in fp32
    for m in model:
        assert K.check_lora_kernel(m, m.kernel) is None


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g * 1.1


@pytest.mark.parametrize("wrong", ["scaling", "dA_missing", "dA_scaled", "raises"])
def test_wrong_kernel_rejected(root, fused, wrong):
    def bad(x, w, a, b, s):
        if wrong == "scaling":
            return fused(x, w, a, b, 0.5 * s)
        if wrong == "dA_missing":
            return fused(x, w, a.detach(), b, s)
        if wrong == "dA_scaled":
            return fused(x, w, _ScaleGrad.apply(a), b, s)
        raise RuntimeError("no kernel here")

    model = _layers(torch.Generator().manual_seed(2))
    with pytest.warns(UserWarning, match="keep the torch path"):
        counts = K.attach_lora_kernels(model, root, rank=0, kernel=bad, dtypes=FP32)
    assert counts == {KIND: 0, REJECTED: 2}
    assert all(m.kernel is None for m in model)
    assert K.check_lora_kernel(model[0], bad)  # says what differed
    assert K.check_lora_kernel(model[0], fused) is None


def test_layers_the_kernel_cannot_serve_keep_torch(root, fused):
    model = _layers(torch.Generator().manual_seed(3), dropout=0.1)
    with pytest.warns(UserWarning, match="dropout 0.1"):
        counts = K.attach_lora_kernels(model, root, rank=0, dtypes=FP32)
    assert counts == {KIND: 1, REJECTED: 0, f"{REJECTED} (dropout 0.1)": 1}
    assert model[0].kernel is None and model[1].kernel is not None
    with pytest.raises(ValueError, match="dropout"):
        model[0].use_kernel(fused)
    # default dtypes: the 16-bit bases only; an fp32 base keeps the torch path, said so
    model = _layers(torch.Generator().manual_seed(3))
    with pytest.warns(UserWarning, match="float32 base weight"):
        counts = K.attach_lora_kernels(model, root, rank=0)
    assert counts == {KIND: 0, REJECTED: 0, f"{REJECTED} (float32 base weight)": 2}
    assert all(m.kernel is None for m in model)
    assert K.attach_lora_kernels(nn.Sequential(nn.Linear(4, 4)), root, rank=0) == {}


@pytest.mark.parametrize("base", ["torch", "triton"])
def test_x_without_grad_skips_dx(root, tmp_path, base):
    """An x that needs no gradient (a first layer's projections read a frozen norm's output): the
    backward computes no dx (no dy W GEMM: the bwd op's need_dx=False returns an empty dx) and the
    same dA and dB as with dx."""
    mod = _render(root) if base == "torch" else \
        load_module(render_to(tmp_path, *training_kernel(KIND), {"base": base}))
    mod.set_config(CPU_CONFIG)
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(2, 19, 40, generator=gen), torch.randn(24, 40, generator=gen) / 40 ** 0.5
    a, b = torch.randn(5, 40, generator=gen) / 40 ** 0.5, torch.randn(24, 5, generator=gen)
    dy = torch.randn(2, 19, 24, generator=gen)
    grads = []
    for x_grad in (True, False):
        xi, ai, bi = x.clone().requires_grad_(x_grad), a.clone().requires_grad_(), b.clone().requires_grad_()
        y = mod.lora_linear(xi, w, ai, bi, 2.0)
        grads.append(torch.autograd.grad(y, [ai, bi], dy))
        assert (xi.grad is None) and y.requires_grad
    for g, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5)
    _, xa = mod._forward(x, w, a, b, 2.0)
    full = mod.lora_linear_bwd_op(dy, x, w, a, b, xa, 2.0)
    part = mod.lora_linear_bwd_op(dy, x, w, a, b, xa, 2.0, False)
    assert full[0].shape == x.shape and part[0].numel() == 0
    for g, want in zip(part[1:], full[1:]):
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5)


# the proxy's attention projections (hidden 2048; q/o 32 x 128 heads, k/v 4 x 128) at 8 x 2048 tokens
CUDA_SHAPES = [(2048, 4096), (2048, 512), (4096, 2048)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bf16 tensor-core path)")
@pytest.mark.parametrize("d_in,d_out", CUDA_SHAPES, ids=lambda v: str(v))
def test_bf16_attach_cuda(tmp_path, d_in, d_out):
    """On a GPU with bf16 bases (the default dtypes): attached, within the check's bf16 bars of
    the torch path at the proxy's widths and tokens; prints fwd+bwd ms of both paths (no bar)."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    base = nn.Linear(d_in, d_out, bias=False, device=dev, dtype=torch.bfloat16)
    model = nn.Sequential(LoRALinear(base, rank=16, alpha=32.0))
    with torch.no_grad():
        model[0].lora_B.weight.copy_(torch.randn(d_out, 16, device=dev, generator=gen) * 0.05)
    torch_path = copy.deepcopy(model)
    assert K.attach_lora_kernels(model, tmp_path, rank=0) == {KIND: 1, REJECTED: 0}
    x = torch.randn(8, 2048, d_in, device=dev, generator=gen).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(8, 2048, d_out, device=dev, generator=gen).to(torch.bfloat16)
    res = {}
    for name, m in (("fused", model), ("torch", torch_path)):
        m.zero_grad()
        y = m(x)
        gx, ga, gb = torch.autograd.grad(y, [x, m[0].lora_A.weight, m[0].lora_B.weight], dy)
        res[name] = (y, gx, ga, gb)
        ms = time_fn(lambda _, m=m: torch.autograd.grad(
            m(x), [x, m[0].lora_A.weight, m[0].lora_B.weight], dy)).median_ms
        print(f"lora {d_in}->{d_out} r16 N16384 {name}: fwd+bwd {ms:.3f} ms")
    for n, got, want in zip(("y", "dx", "dA", "dB"), res["fused"], res["torch"]):
        assert got.dtype == want.dtype and K._rel(got, want) <= K.CHECK_GRAD_TOL, (n, K._rel(got, want))


@pytest.mark.slow
def test_tiny_model_step_same_loss_and_adapter_grads(root):
    """A tiny Qwen3-MoE proxy (fp32, CPU) with LoRA on every attention projection and full
    recompute: with the kernel attached to every `LoRALinear`, one step's loss and every adapter
    gradient equal a copy's on the torch path; the counts cover every adapter."""
    from onboarding.graph.parse import load_stage, parse_stage
    from onboarding.load.model import load_model
    from onboarding.train.lora import inject_lora, lora_parameters
    from onboarding.train.parallel import apply_recompute, decoder_blocks

    info = load_stage(load_model("hf:qwen3_moe"))
    model = info.loaded.build(info.proxy_config, device="cpu", seed=0).float()
    graph = parse_stage(info, seq=64, seed=0, try_export=False)
    paths = inject_lora(model, graph, targets=["auto"], rank=4, alpha=8.0, dropout=0.0, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in lora_parameters(model):
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    torch_path = copy.deepcopy(model)
    counts = K.attach_lora_kernels(model, root, rank=0, dtypes=FP32)
    assert counts == {KIND: len(paths), REJECTED: 0} and len(paths) >= 4
    ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=gen)
    grads = []
    for m in (model, torch_path):
        apply_recompute(m, graph, decoder_blocks(m, graph), "full")
        logits = m(input_ids=ids[:, :-1], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in lora_parameters(m) if p.grad is not None}))
    (la, ga), (lb, gb) = grads
    torch.testing.assert_close(la, lb, rtol=1e-6, atol=1e-6)
    assert ga.keys() == gb.keys() and sum("lora_A" in n for n in ga) == len(paths)
    for n in gb:
        assert K._rel(ga[n], gb[n]) < 1e-5, (n, K._rel(ga[n], gb[n]))
