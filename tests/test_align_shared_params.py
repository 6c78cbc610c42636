"""A module that several layers share (Zamba2's shared transformer block, reused by its hybrid
layers): its parameters' gradients are read under every path a block names them by."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from fixtures.align_toys import layers_graph


class _Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _Layer(nn.Module):
    def __init__(self, norm: _Norm) -> None:
        super().__init__()
        self.norm = norm  # the same module in every layer
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.norm(x))


class _Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        norm = _Norm()
        self.layers = nn.ModuleList(_Layer(norm) for _ in range(2))
        self.head = nn.Linear(8, 11)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_a_shared_modules_parameters_have_their_gradient_under_every_path():
    """onboard run hf:zamba2 --llm off: 'backward not checked:
    model.layers.7.shared_transformer.input_layernorm (norm.rms, rmsnorm): its parameters got no
    gradient' for the shared block's norms at its second and third uses. They got one: the run's
    gradients were listed by `named_parameters()`, which names a shared parameter under its
    first path alone, so layers.7's names found nothing. Now every path has the (shared) grad,
    and `backward_unchecked` finds nothing to report at the second use."""
    from onboarding.align.core import _run
    from onboarding.align.verdicts import backward_unchecked

    torch.manual_seed(0)
    model = _Shared().double()
    run = _run(model, layers_graph("shared", 2, "_Layer"), (torch.randn(1, 5, 8).double(),), {},
               seed=0)
    first, second = run.param_grads["layers.0.norm.weight"], run.param_grads.get(
        "layers.1.norm.weight")
    assert first is not None and second is not None and torch.equal(first, second)
    block = SimpleNamespace(path="layers.1.norm", bwd=SimpleNamespace(verdict="pass"))
    record = SimpleNamespace(path="layers.1.norm", kind="norm.rms", family="rmsnorm",
                             status="active", sites=())
    result = SimpleNamespace(blocks=[block])
    modules = dict(model.named_modules(remove_duplicate=False))
    assert backward_unchecked(result, [record], modules, run.param_grads) == []
