"""RoPE's benchmark cases (the spec's `bench_cases`): `half` on q [B, T, H, D] and k [B, T, Hk,
D] bf16 against transformers' apply_rotary_pos_emb in eager, its `torch.compile` and Liger's."""

from __future__ import annotations

import torch

from onboarding.bench.cases import N_SETS, anchors, bf16_check, kernel, leaf
from onboarding.bench.harness import BenchCase
from onboarding.families import NightlySpec


def cases() -> list[BenchCase]:
    def rotate_half(x):
        a, b = x.chunk(2, dim=-1)
        return torch.cat((-b, a), dim=-1)

    def eager(q, k, cos, sin):  # transformers' apply_rotary_pos_emb on [B, T, H, D]
        c, s = cos[:, None, :], sin[:, None, :]
        return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s

    out = []
    for b, t, h, hk, d in ((1, 8192, 32, 8, 128), (4, 4096, 16, 2, 256)):
        def setup(device, b=b, t=t, h=h, hk=hk, d=d):
            _, ours = kernel("rope", "half")
            sets = []
            for _ in range(N_SETS):
                theta = torch.rand(t, d, device=device) * 10
                sets.append((leaf(torch.randn(b, t, h, d, device=device, dtype=torch.bfloat16)),
                             leaf(torch.randn(b, t, hk, d, device=device, dtype=torch.bfloat16)),
                             theta.cos().to(torch.bfloat16), theta.sin().to(torch.bfloat16)))
            grads = [torch.randn(b, t, h, d, device=device, dtype=torch.bfloat16),
                     torch.randn(b, t, hk, d, device=device, dtype=torch.bfloat16)]
            liger = None
            try:
                from liger_kernel.ops.rope import LigerRopeFunction

                def liger(q, k, cos, sin):  # Liger wants [B, H, T, D] and [1, T, D] tables
                    oq, ok = LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2),
                                                     cos[None], sin[None])
                    return oq.transpose(1, 2), ok.transpose(1, 2)
            except ImportError:
                pass
            return anchors(eager, ours, sets, grads, liger)

        def make(dtype, b=b, t=t, h=h, hk=hk, d=d):
            g = torch.Generator(device="cuda").manual_seed(0)
            theta = torch.rand(t, d, device="cuda", generator=g) * 10
            return (torch.randn(b, t, h, d, device="cuda", generator=g, dtype=dtype),
                    torch.randn(b, t, hk, d, device="cuda", generator=g, dtype=dtype),
                    theta.cos().to(dtype), theta.sin().to(dtype))

        out.append(BenchCase(
            family="rope", name=f"B{b}T{t}H{h}/{hk}D{d}",
            shape={"B": b, "T": t, "H": h, "Hk": hk, "D": d},
            min_bytes=2 * 2 * b * t * (h + hk) * d * 2, flops=0, setup=setup,
            check=lambda device, make=make: bf16_check(kernel("rope", "half")[1], eager,
                                                       make)(device)))
    return out


# The nightly regression suite's share (the GQA shape against eager).
NIGHTLY = NightlySpec(cases={"B1T8192H32/8D128": ("ours", "eager")}, min_threshold=0.08)
