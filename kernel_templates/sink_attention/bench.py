"""Sink attention's benchmark cases (the spec's `bench_cases`): gpt-oss's attention layout (64 query
heads, 8 KV heads, head dim 64, per-head sinks; its sliding layers' window 128 and its full
layers), and Gemma 2 9B's sliding layer (16 query heads, 8 KV heads, head dim 256: the D > 128
tiles; window 4096, logit soft-cap 50, no sinks), bf16, forward + backward of q, k, v and the
sinks (where the case has them).

Impls per case:

- ``ours``: our kernel with the band by index (causal, the window), no mask tensor;
- ``ours_mask``: our kernel handed transformers' additive [1, 1, T, T] mask as well (what the
  binding ran for every mask until it learnt to leave out one that adds nothing to the band, and
  what it still runs for a padded batch), so the two rows show what reading the mask costs;
- ``ours_guard``: the binding's path for this mask: `band_mask.MaskGuard.needed` with a fresh
  guard each step (so the mask's values are read every step, as on the first layer of each kind
  per forward: the band's entries compared and a host sync), then the kernel without the mask. Its wall
  ms is the kernel plus that check; while a CUDA graph is captured the guard cannot read values
  and keeps the mask, so its graph ms is ``ours_mask``'s, not the binding's;
- ``eager``: transformers' eager sink attention (repeated KV heads, the scores written out plus
  the mask, the sink concatenated as a last column, max-subtracted softmax, the column dropped);
  with a soft-cap, Gemma 2's eager attention (the scores c tanh(s / c), plus the mask, an fp32
  softmax);
- ``compile``: `torch.compile` of that function.

``check``: the bf16 kernel (band by index) against the fp32 eager function on the same
bf16-representable values, at T 1024 (the eager fp32 scores at T 8192 are 17 GB a tensor):
relative RMS error of o and of the q, k, v and sinks gradients.
Shape legend: q [B, H, T, D], k, v [B, Hk, T, D], sinks [H]; C the soft-cap.
"""

from __future__ import annotations

import torch

from onboarding.bench.cases import N_SETS, anchors, bf16_check, config_sweep, fwd_bwd, kernel, leaf
from onboarding.bench.harness import BenchCase

from .band_mask import MaskGuard

# (B, T, H, Hk, D, window, soft-cap (0: none), per-head sinks, note)
SHAPES = (
    (1, 8192, 64, 8, 64, 128, 0.0, True, "gpt-oss sliding layer (window 128)"),
    (1, 8192, 64, 8, 64, 0, 0.0, True, "gpt-oss full layer (causal)"),
    (1, 4096, 64, 8, 64, 128, 0.0, True, "gpt-oss sliding layer at T 4096"),
    (1, 8192, 16, 8, 256, 4096, 50.0, False, "Gemma 2 9B sliding layer (window 4096, soft-cap 50, D 256)"),
)
CHECK_T = 1024
# The d_big bucket's tiles (v5: the only set of six whose sm_90 build spilled nowhere, untimed; 0.80x
# torch.compile at Gemma 2's layout on an H100, docs/LOG.md, fifty-second session, call 3) against
# larger ones that spill a little: `--case D256W4096C50$ --impl ours,compile` and its `ours@` rows.
D_BIG_SWEEP = ({"BWD_BLOCK_M": 64, "BWD_BLOCK_N": 32}, {"BWD_BLOCK_M": 32, "BWD_BLOCK_N": 64},
               {"BWD_BLOCK_M": 64, "BWD_BLOCK_N": 64}, {"BLOCK_M": 128, "BLOCK_N": 32},
               {"BLOCK_M": 64, "BLOCK_N": 64}, {"num_stages": 2}, {"bwd_warps": 4})


def additive_mask(t: int, window: int, device, dtype) -> torch.Tensor:
    """transformers' eager mask: 0 where query i sees key j (j <= i, and j > i - window), the
    dtype's minimum elsewhere; [1, 1, T, T]."""
    i = torch.arange(t, device=device)[:, None]
    j = torch.arange(t, device=device)[None, :]
    seen = (j <= i) & ((j > i - window) if window else True)
    return torch.zeros(t, t, device=device, dtype=dtype).masked_fill(~seen, torch.finfo(dtype).min)[None, None]


def eager(q, k, v, sinks, mask):
    """transformers' eager_attention_forward maths (gpt-oss), [B, H, T, D] out."""
    b, h, t, d = q.shape
    g = h // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.matmul(q, k.transpose(2, 3)) * d ** -0.5 + mask
    s = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(b, -1, t, -1).to(s.dtype)], dim=-1)
    s = s - s.max(dim=-1, keepdim=True).values
    p = torch.softmax(s, dim=-1, dtype=s.dtype)[..., :-1]
    return torch.matmul(p.to(v.dtype), v)


def eager_capped(q, k, v, mask, cap: float):
    """transformers' Gemma 2 eager attention maths (scaling D^-0.5, the soft-cap before the mask,
    an fp32 softmax cast back to q's dtype), [B, H, T, D] out."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5
    s = torch.tanh(s / cap) * cap + mask
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, v)


def cases() -> list[BenchCase]:
    out = []
    for b, t, h, hk, d, window, cap, has_sinks, note in SHAPES:
        caps = (cap,) if cap else ()
        # the reference a case's maths has: gpt-oss's (sinks, no cap) or Gemma 2's (a cap, no
        # sinks); the sinks ride in each input set as a tensor or as None (a case without them)
        if has_sinks == bool(cap):
            raise ValueError(f"sink_attention bench case {note!r}: a reference exists for sinks "
                             "without a soft-cap (gpt-oss) or a soft-cap without sinks (Gemma 2)")
        ref = eager if has_sinks else (lambda q, k, v, sinks, mask, cap=cap: eager_capped(q, k, v, mask, cap))

        def setup(device, b=b, t=t, h=h, hk=hk, d=d, window=window, caps=caps, has_sinks=has_sinks, ref=ref):
            mod, entry = kernel("sink_attention", "attention", {})
            gen = torch.Generator(device=device).manual_seed(0)
            bf = torch.bfloat16
            mask = additive_mask(t, window, device, bf)
            sets = [(leaf(torch.randn(b, h, t, d, device=device, dtype=bf, generator=gen)),
                     leaf(torch.randn(b, hk, t, d, device=device, dtype=bf, generator=gen)),
                     leaf(torch.randn(b, hk, t, d, device=device, dtype=bf, generator=gen)),
                     leaf(torch.randn(h, device=device, dtype=bf, generator=gen)) if has_sinks else None, mask)
                    for _ in range(N_SETS)]
            grads = [torch.randn(b, h, t, d, device=device, dtype=bf, generator=gen)]

            def ours(q, k, v, sinks, mask):
                return entry(q, k, v, sinks, None, None, True, window, *caps)

            def ours_mask(q, k, v, sinks, mask):
                return entry(q, k, v, sinks, mask, None, True, window, *caps)

            def ours_guard(q, k, v, sinks, mask):
                return entry(q, k, v, sinks, MaskGuard().needed(mask, q, k, True, window), None, True, window, *caps)

            steps = anchors(ref, ours, sets, grads, None)
            steps["ours_mask"] = fwd_bwd(ours_mask, sets, grads)
            steps["ours_guard"] = fwd_bwd(ours_guard, sets, grads)
            if d > 128:
                steps.update(config_sweep(mod, ours, sets, grads, d, list(D_BIG_SWEEP)))
            return steps

        def make(dtype, b=b, h=h, hk=hk, d=d, has_sinks=has_sinks):
            g = torch.Generator(device="cuda").manual_seed(0)
            return (torch.randn(b, h, CHECK_T, d, device="cuda", generator=g).to(dtype),
                    torch.randn(b, hk, CHECK_T, d, device="cuda", generator=g).to(dtype),
                    torch.randn(b, hk, CHECK_T, d, device="cuda", generator=g).to(dtype),
                    *((torch.randn(h, device="cuda", generator=g).to(dtype),) if has_sinks else ()))

        def check(device, window=window, caps=caps, ref=ref, make=make):
            _, entry = kernel("sink_attention", "attention", {})
            mask = additive_mask(CHECK_T, window, device, torch.float32)
            return bf16_check(lambda q, k, v, *s: entry(q, k, v, s[0] if s else None, None, None, True, window, *caps),
                              lambda q, k, v, *s: ref(q, k, v, s[0] if s else None, mask), make)(device)

        seen = sum(min(i + 1, window or t) for i in range(t))  # (query, key) pairs attended per head
        out.append(BenchCase(
            family="sink_attention", name=f"B{b}T{t}H{h}K{hk}D{d}" + (f"W{window}" if window else "causal")
            + (f"C{cap:g}" if cap else ""),
            shape={"B": b, "T": t, "H": h, "Hk": hk, "D": d, "W": window, **({"C": cap} if cap else {})},
            # q, o, dO, dq (H heads) and k, v, dk, dv (Hk heads), bf16, each once
            min_bytes=2 * (4 * b * h * t * d + 4 * b * hk * t * d),
            # forward 2 GEMMs, backward 5, over the pairs attended: 14 flops per pair and channel
            flops=14 * b * h * d * seen,
            setup=setup, check=check, note=note))
    return out
