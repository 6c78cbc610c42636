"""GDN's benchmark cases (the spec's `bench_cases`), issue 5's shapes: B=2 T=4096 H=16 D=128,
and the Qwen3-Next layout (16 key / 32 value heads, D=128) at T=8192 and T=32768. The case
itself (impls, check, bytes, FLOPs) is the shared delta-rule one, scalar decay, plus rows of the
Tm dots' alternative operands (`SWEEP`: ``ours@tm_dot=tf32_fwd`` forward, ``ours@tm_dot=tf32``
forward + backward) and the fused output (`FWD_O_SWEEP`: ``ours@fwd_o=fused_fwd``,
``ours@fwd_o=fused+state_bv=16_fwd``, ``ours@fwd_o=fused``) and the prepare kernel's order
(`PREP_SWEEP`: ``ours@prep_pipe=on_fwd`` and, against v27's forward without training (`fused_kq`
"rows" with the prepare capped at 168 registers), ``ours@fused_kq=stored_fwd`` (v26's) and
``ours@rows_maxnreg=0_fwd`` (rows uncapped)),
on request, on the same inputs, so that one call times them against the default and fla."""

from __future__ import annotations

from onboarding.bench.cases_linear_attention import delta_rule_case, sweep_rows
from onboarding.bench.harness import BenchCase
from onboarding.families import NightlySpec

# (B, T, HK, HV, D, note)
SHAPES = (
    (2, 4096, 16, 16, 128, ""),
    (1, 8192, 16, 32, 128, "Qwen3-Next layout"),
    (1, 32768, 16, 32, 128, "Qwen3-Next layout"),
)


# fp32 operands (tf32) for the dots with Tm = (I + A)^-1 under bf16 inputs: the 4B Qwen3-Next
# proxy's forward has a layer where the default 16-bit Tm dots land at 1.1e-2 relative RMS of the
# fp32 path (fla 4.2e-3, tf32 Tm dots 3.3e-3; docs/LOG.md, twentieth session); these rows time it.
SWEEP = ({"tm_dot": "tf32"},)
# issue 32: o from the state pass (`fwd_o` "fused", no output kernel; a forward without training
# writes neither S_c nor v_new), alone and with 16-wide state tiles (`state_bv` 16: 256 state-pass
# programs at B * HV = 32 instead of the auto 128, for the longer chunk step); fwd+bwd too (the
# training forward keeps S_c and v_new)
FWD_O_SWEEP = ({"fwd_o": "fused"}, {"fwd_o": "fused", "state_bv": 16})
# issue 32, template v18, forward only: the prepare kernel's reordered loops (`prep_pipe` "on": g
# summed after the Gram loop, kd and qg from a pipelined loop of their own before the inverse).
# v27's forward without training (the k_le_128 bucket: `fused_kq` "rows", kd and qg not written, the
# fused pass scaling the raw k and q rows, with the prepare capped at 168 registers) against v26's
# (`fused_kq` "stored") and against rows uncapped. Rows that lost and went (docs/LOG.md): the prepare
# at 8 warps capped at 128 (with and without rows), and the 168 cap on every prepare (`prep_maxnreg`
# 168: 0.465 against 0.456 ms on an H100, `.ci/h200/h36_gdn8.sh`).
# (v20's SHARE_SWEEP, the prepare per key head `prep_share`, went with the key in v23: every row
# slower than the default forward on an H100, .ci/h200/h32_gdn6.sh; family.py)
PREP_SWEEP = ({"prep_pipe": "on"}, {"fused_kq": "stored"}, {"rows_maxnreg": 0})
# (v24's SPLIT_SWEEP, the chunk-local backward split per K tile `bwd_split` "vk", went with the key in
# v25: both rows slower than the default fwd+bwd on an H100, .ci/h200/h32_gdn7.sh, in git at 047b72b; family.py)
FWD_SWEEP = (*SWEEP, *FWD_O_SWEEP, *PREP_SWEEP)
BWD_SWEEP = (*SWEEP, FWD_O_SWEEP[0])
SWEEP_ROWS = sweep_rows(FWD_SWEEP, BWD_SWEEP)


# The 4B Qwen3-Next-style training proxy's call (8 x 2048 tokens, its 16 key heads repeated to the
# 32 value heads by the model, K = V = 64: the k_le_64 bucket), whose backward WY kernel took 7.9 of
# the GDN backward's 11.2 ms a step in the H200 profile (docs/LOG.md, device call T); the bucket's
# tiles were last timed before its num_stages became 2. Rows on request: the backward's tiles.
PROXY_SHAPE = (8, 2048, 32, 32, 64, "4B Qwen3-Next proxy's call")
K64_SWEEP = ({"bwd_bv": 32}, {"bwd_bv": 16}, {"num_stages": 3}, {"BK": 64}, {"num_warps": 8},
             {"bwd_bv": 32, "num_stages": 3}, {"state_bwd_stages": 3})
K64_ROWS = sweep_rows((), K64_SWEEP)


def cases() -> list[BenchCase]:
    return [*(delta_rule_case("gated_delta", *shape, per_channel=False, fwd_sweep=FWD_SWEEP,
                             bwd_sweep=BWD_SWEEP)
              for shape in SHAPES),
            delta_rule_case("gated_delta", *PROXY_SHAPE, per_channel=False, bwd_sweep=K64_SWEEP)]


# The nightly regression suite's share (issue 5's shape; fla's anchors are left out (its autotune takes minutes)).
NIGHTLY = NightlySpec(cases={"B2T4096H16D128": ("ours", "ours_fwd", "eager_fwd")}, min_threshold=0.05)
