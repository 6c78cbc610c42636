"""KDA's benchmark cases (the spec's `bench_cases`), issue 32's shapes: the Kimi-Linear layout
(H=32, D=128) at T=8192 and T=32768. The case itself (impls, check, bytes, FLOPs) is the shared
delta-rule one, per-channel decay, plus forward rows of the prepare step's alternative
(`FWD_SWEEP`, rows ``ours@<cfg>_fwd``) and forward + backward rows of the backward's (`BWD_SWEEP`,
rows ``ours@<cfg>``), on request, on the same inputs, so that one call times them against the
default and fla."""

from __future__ import annotations

from onboarding.bench.cases_linear_attention import delta_rule_case, sweep_rows
from onboarding.bench.harness import BenchCase
from onboarding.families import NightlySpec

# (B, T, HK, HV, D, note)
SHAPES = (
    (1, 8192, 32, 32, 128, "Kimi-Linear layout"),
    (1, 32768, 32, 32, 128, ("Kimi-Linear layout; no check (the fallback's 34 GB decays): the "
                             "same kernels are checked at T8192")),
)

# The forward's alternatives to the default "pipelined" prepare step (template v26's default: the
# one-kernel step `kda_prepare_fwd_kernel` with its Gram pass a straight loop Triton pipelines,
# PIPE_GRAM): the split step (template v18's default; `kda_chunk_ref` acts on it only) and "fused",
# the same kernel with its tiered Gram pass (the default of v19-v25; the pipelined pass was a
# second kernel in v25-v27). Rows on request only (--impl names them: ours@kda_prep=split_fwd,
# ours@kda_prep=fused_fwd): the default bench and the nightly suite leave them (and their
# compiles) out. `.ci/h200/h32_kda3.sh` times the default against "fused" and fla. Three prepare
# stages (`prep_stages` 3, the base family's key; the bucket has two), for the fused and the pipelined
# kernel, were rows too for one H200 call (twenty-eighth session): both failed the bf16 bars with
# the same error (o 643x, every gradient 225-23045x the fp32 run's norm), so they are not rows;
# the prepare step alone took 0.667 ms at T8192 against 0.696 at two stages (family.py).
# Template v23's other forward rows (the fused prepare at 8 warps, `kda_prep_warps`; its K tile 16,
# `prep_bk`; both; `kda_prep` "fused2", since removed) all lost to the default on the H200
# (family.py has the numbers; the script is in git at e1f525a): v24 dropped them.
FWD_SWEEP = ({"kda_prep": "split"}, {"kda_prep": "fused"})
# Forward + backward rows of the backward's alternatives (family.py: `kda_qk` "serial", the tiled
# default's K tile, the backward kernels' warps), on the same inputs as `ours`; on request only.
# Their names join the keys with "+" (``ours@kda_qk_bk=16+kda_wy_warps=8``), so that --impl can name
# them. sm_90 AOT (bf16, K = 128; registers / spill bytes): qkt BK 32 4 warps 255 / 1152, BK 16
# 255 / 0, BK 32 8 warps 255 / 56; wyt 4 warps 255 / 1672, 8 warps 255 / 164; the serial wy
# 255 / 1544 and qk 255 / 5480 at 4 warps; the state pass 255 / 1228 at 4 warps, 255 / 96 at 8.
# Four rows keep one GPU call's bench within ~3 min beside fla's first-call autotuning.
BWD_SWEEP = ({"kda_qk": "serial"}, {"kda_qk_bk": 16},
             {"kda_qk_bk": 16, "kda_wy_warps": 8, "kda_state_bwd_warps": 8},
             {"kda_wy_warps": 8, "kda_state_bwd_warps": 8})


SWEEP_ROWS = sweep_rows(FWD_SWEEP, BWD_SWEEP)


def cases() -> list[BenchCase]:
    return [delta_rule_case("kimi_delta", *shape, per_channel=True, fwd_sweep=FWD_SWEEP, bwd_sweep=BWD_SWEEP)
            for shape in SHAPES]


# The nightly regression suite's share (the smaller shape, our kernel alone (the fallback takes 82 ms a forward there)).
NIGHTLY = NightlySpec(cases={"B1T8192H32D128": ("ours", "ours_fwd")}, min_threshold=0.05)
