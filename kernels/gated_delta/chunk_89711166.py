# Rendered by onboard from kernel_templates/gated_delta/gated_delta.py.j2 (template version 34). Do not edit.
# family: gated_delta  variant: chunk
# params: {"chunk_size": 64, "qk_l2norm": true, "recompute": false}
"""gated_delta: chunked gated delta rule with a scalar decay per head (GDN).


Recurrence per value head (S is the [K, V] state, a_t = exp(g_t) a scalar per step):

    q_t, k_t <- l2norm(q_t), l2norm(k_t)                     (when use_qk_l2norm_in_kernel)
    S_t = a_t S_{t-1} + k_t (beta_t (v_t - (a_t S_{t-1})^T k_t))^T
    o_t = scale * S_t^T q_t

Shapes (fla layout, heads before the head dim): q, k [B, T, HK, K]; v [B, T, HV, V];
g (log decay, <= 0) [B, T, HV]; beta [B, T, HV]; initial_state / final state [B, HV, K, V] (fp32);
o [B, T, HV, V] in v's dtype. HV may be a multiple of HK (grouped values, Qwen3-Next: 16 key /
32 value heads): value head h reads key head h // (HV // HK), as `repeat_interleave` does.

Chunked algorithm (chunk BT=64), WY/UT form inside a chunk, state passing across chunks:
  gc = cumsum of g within the chunk, gl = gc at the chunk's last row;
  A = strict_tril(beta_i <k_i, k_j>_{exp(gc_i - gc_j)}),  Tm = (I + A)^-1 (blockwise: the
  INV_BLOCK diagonal blocks as products of powers, the blocks below them merged by dots);
  w = Tm (beta k exp(gc)),  u = Tm (beta v),  kd = k exp(gl - gc),  qg = scale q exp(gc),
  Aqk = scale tril(<q_i, k_j>_{exp(gc_i - gc_j)});
  per chunk c: v_new = u - w S_c;  o = qg S_c + Aqk v_new;  S_{c+1} = exp(gl) S_c + kd^T v_new.

Kernels (fp32 accumulators, elementwise math and Tm solve; for bf16/fp16 inputs on a GPU the dots
take 16-bit operands, see `_tiles`):
  gdn_prepare_fwd_kernel   per (chunk, head): cumsum, A, Aqk, solve, w, u, kd, qg, gl (+ Tm)
                               (config `prep_pipe` "on": g summed after the Gram loop, kd and qg
                               from a pipelined loop of their own before the solve; same outputs)
  gdn_state_fwd_kernel     per (V tile, head): sequential pass over chunks, v_new, S_c, final S
  gdn_output_fwd_kernel    per (V tile, chunk, head): o
                               (config `fwd_o` "fused": o in the state pass instead, per chunk
                               while S_c is in registers; no output launch, and a forward without
                               training writes neither S_c nor v_new)
  gdn_state_bwd_kernel     per (V tile, head): reverse pass over chunks: dS per chunk, du, dS_0
  gdn_chunk_bwd_wy_kernel  per (chunk, head): dv, dbeta, dg, dA (through Tm), dq, dk (direct terms
                               and the decayed products), k's l2norm bwd (row dots from the V side)
  gdn_group_sum_kernel     per row tile: dq, dk summed over a key head's value heads (HV > HK), dq's
                               l2norm backward (its row dots need every K tile)
  gdn_recurrent_fwd_kernel per (V tile, head): token-by-token recurrence (decoding, T >= 1)

Backward (all Triton): a training forward (`gated_delta_train_op`, what `gated_delta` calls when a
gradient is needed) keeps its intermediates and Tm (`saved_shapes`); with the param `recompute`
the backward re-runs prepare and the state pass instead. Then the reverse state pass and the
parallel chunk-local backward; dq/dk are summed over a key head's value heads (a separate pass
when HV > HK or with the l2norm).
Gradients: dq, dk, dv, dg, dbeta and d initial_state.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

TEMPLATE = 'gated_delta/gated_delta.py.j2'
TEMPLATE_VERSION = 34
FAMILY = 'gated_delta'
VARIANT = 'chunk'
PARAMS = {'chunk_size': 64, 'qk_l2norm': True, 'recompute': False}
OP_NAME = "onboard::gated_delta_chunk_89711166"
TUNING_SPACE = {'BK': [16, 32, 64, 128], 'BV': [16, 32, 64, 128], 'bwd_bv': [0, 16, 32, 64, 128], 'dot_precision': ['tf32', 'ieee'], 'fused_kq': ['stored', 'rows'], 'fwd_o': ['split', 'fused'], 'inv_dot': ['tf32', 'ieee'], 'num_stages': [1, 2, 3], 'num_warps': [1, 2, 4, 8], 'prep_bk': [0, 16, 32, 64, 128], 'prep_maxnreg': [0, 128, 168], 'prep_pipe': ['off', 'on'], 'prep_stages': [0, 1, 2, 3], 'prep_warps': [0, 4, 8], 'rows_maxnreg': [0, 168], 'state_bv': [0, 16, 32, 64, 128], 'state_bwd_stages': [1, 2, 3], 'state_stages': [1, 2, 3], 'tm_dot': ['input', 'tf32']}
DEFAULT_CONFIG = {'BK': 64, 'BV': 32, 'bwd_bv': 0, 'dot_precision': 'tf32', 'fused_kq': 'stored', 'fwd_o': 'split', 'inv_dot': 'tf32', 'num_stages': 1, 'num_warps': 4, 'prep_bk': 0, 'prep_maxnreg': 0, 'prep_pipe': 'off', 'prep_stages': 0, 'prep_warps': 0, 'rows_maxnreg': 0, 'state_bv': 0, 'state_bwd_stages': 1, 'state_stages': 2, 'tm_dot': 'input'}
# Buckets over K (the key head dim): it decides the state tile [K, BV] and so BV / num_warps.
SHAPE_BUCKETS = [{'config': {'BK': 32, 'BV': 64, 'num_stages': 2, 'num_warps': 4, 'state_bwd_stages': 2}, 'dim': 'K', 'hi': 64, 'lo': 1, 'name': 'k_le_64'}, {'config': {'BK': 32, 'BV': 64, 'bwd_bv': 32, 'fused_kq': 'rows', 'fwd_o': 'fused', 'num_stages': 3, 'num_warps': 4, 'prep_bk': 64, 'prep_stages': 3, 'rows_maxnreg': 168, 'state_bwd_stages': 3, 'state_stages': 3}, 'dim': 'K', 'hi': 128, 'lo': 65, 'name': 'k_le_128'}, {'config': {'BK': 32, 'BV': 16, 'num_warps': 8, 'state_stages': 1}, 'dim': 'K', 'hi': 256, 'lo': 129, 'name': 'k_le_256'}]
CHUNK_SIZE = 64
# training: re-run the forward's kernels in the backward instead of keeping their outputs
RECOMPUTE = False
# diagonal block of the blockwise Tm = (I + A)^-1 in the prepare kernel (divides CHUNK_SIZE)
INV_BLOCK = min(CHUNK_SIZE, max(16, CHUNK_SIZE // 4))
# (I + X)(I + X^2)...(I + X^(n / 2)) = (I + X)^-1 for X^n = 0: log2(n) - 1 squarings of X, n =
# INV_BLOCK for the diagonal blocks of Tm, n = CHUNK_SIZE / INV_BLOCK for the merge
INV_SQUARINGS = tl.constexpr(INV_BLOCK.bit_length() - 2)
MERGE_SQUARINGS = tl.constexpr(max(0, (CHUNK_SIZE // INV_BLOCK).bit_length() - 2))
PER_CHANNEL_DECAY = False
# rows of [B, T, HK] per program of the backward's sum over a key head's value heads
GROUP_SUM_ROWS = 32
MAX_HEAD_DIM = 256
L2NORM_EPS = 1e-6

# ---- shared runtime: tile configs, shape buckets, output poisoning, dots -----------------------
import os as _os

_CONFIG_OVERRIDE: dict | None = None
_TUNED: dict = {}
# The contract suite sets this so outputs start as NaN and unwritten elements show up.
_POISON_OUTPUTS = False


def shape_bucket(size: int) -> str:
    """Name of the SHAPE_BUCKETS entry whose [lo, hi] holds `size` (the last one past the end)."""
    for bucket in SHAPE_BUCKETS:
        if bucket["lo"] <= size <= bucket["hi"]:
            return bucket["name"]
    return SHAPE_BUCKETS[-1]["name"]


def set_config(config: dict | None = None, bucket: str | None = None) -> None:
    """Pin tile config values for one shape bucket, or for all shapes when `bucket` is None.

    Keys and values must come from TUNING_SPACE; the keys a pin leaves out keep the bucket's own
    values (see `config_for`). `config=None` clears the pin.
    """
    global _CONFIG_OVERRIDE
    if config is not None:
        for key, value in config.items():
            if key not in TUNING_SPACE or value not in TUNING_SPACE[key]:
                raise ValueError(f"config {key}={value!r} is not in TUNING_SPACE {TUNING_SPACE}")
        config = dict(config)
    if bucket is None:
        _CONFIG_OVERRIDE = config
    elif bucket not in [b["name"] for b in SHAPE_BUCKETS]:
        raise ValueError(f"unknown shape bucket {bucket!r}")
    elif config is None:
        _TUNED.pop(bucket, None)
    else:
        _TUNED[bucket] = config


def config_for(size: int) -> dict:
    """The tile config used for a problem whose bucketed dimension is `size`: DEFAULT_CONFIG,
    then its bucket's values, the bucket's pin (tuned.json), the all-shapes pin, each over the
    last."""
    name = shape_bucket(size)
    bucket = next(b for b in SHAPE_BUCKETS if b["name"] == name)
    return {**DEFAULT_CONFIG, **bucket["config"], **_TUNED.get(name, {}), **(_CONFIG_OVERRIDE or {})}


def _empty(shape, dtype, device) -> torch.Tensor:
    if _POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _dot_mode(precision: str, dtype: torch.dtype, device: torch.device) -> str:
    """The `_dot` mode for inputs of `dtype`: their own 16-bit tensor-core dot on a GPU.

    bf16/fp16 inputs on a GPU dot in that dtype (fp32 accumulation), twice tf32's rate and half
    its operand traffic. fp32 inputs use the config's `precision` ("tf32"/"ieee"), "ieee" unless
    torch allows tf32 for fp32 matmuls. The interpreter computes bf16 dots wrongly (docs/design.md):
    it keeps fp32 operands.
    """
    if (dtype in (torch.bfloat16, torch.float16) and device.type == "cuda"
            and _os.environ.get("TRITON_INTERPRET", "0") in ("", "0")):
        return "bf16" if dtype == torch.bfloat16 else "fp16"
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return precision


def _aot_dot_mode(dtype: str, precision: str) -> str:
    """The `_dot_mode` a GPU run with `dtype` ("bf16"/"fp16"/"fp32") inputs picks, for AOT specs:
    16-bit specs compile the 16-bit tensor-core path, fp32 ones `precision`."""
    return dtype if dtype in ("bf16", "fp16") else precision


@triton.jit
def _operand(b_x, MODE: tl.constexpr):
    """A loaded tile used only as a dot operand: kept in its 16-bit storage dtype for a 16-bit
    `_dot` (no round trip through fp32, half the registers), else fp32 (the interpreter's bf16
    maths is wrong)."""
    if MODE == "bf16" or MODE == "fp16":
        return b_x
    else:
        return b_x.to(tl.float32)


@triton.jit
def _cast_operand(b_x, MODE: tl.constexpr):
    """A computed fp32 tile that is from then on only a dot operand: cast once to a 16-bit
    `_dot`'s dtype (which the dot would cast it to anyway), so that a tile held across a loop
    takes half the registers; unchanged for 32-bit modes."""
    if MODE == "bf16":
        return b_x.to(tl.bfloat16)
    elif MODE == "fp16":
        return b_x.to(tl.float16)
    else:
        return b_x


@triton.jit
def _dot(a, b, MODE: tl.constexpr):
    """tl.dot with fp32 accumulation; MODE from `_dot_mode` ("bf16"/"fp16" cast the operands)."""
    if MODE == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif MODE == "fp16":
        return tl.dot(a.to(tl.float16), b.to(tl.float16))
    else:
        return tl.dot(a, b, input_precision=MODE)


@triton.jit
def _band(NT, NC, GROUP_M: tl.constexpr):
    """(row tile, column tile) of this program of a 1-D grid over NT row tiles x NC column tiles,
    walked in bands of GROUP_M row tiles, row tile fastest: the programs in flight together cover
    a band's row tiles across its column tiles, so each row tile (gathered or not) and each
    expert's weight tile comes from HBM about once (then from L2), not once per column tile."""
    pid = tl.program_id(0)
    width = GROUP_M * NC
    first = (pid // width) * GROUP_M
    rows = tl.minimum(NT - first, GROUP_M)
    return first + (pid % width) % rows, (pid % width) // rows


def _band_grid(n_tiles: int, cols: int, block_n: int) -> tuple[int]:
    """1-D grid of a row-tiled grouped GEMM (`_band` maps each program to its row and column tile)."""
    return (n_tiles * triton.cdiv(cols, block_n),)


def _num_programs(n_blocks: int, device: torch.device, per_sm: int = 4) -> int:
    """Programs for a grid-stride loop: `per_sm` per SM on a GPU, one per block otherwise."""
    if device.type == "cuda":
        return max(1, min(n_blocks, per_sm * torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, n_blocks)


# Dots go through `_dot` in the mode DOT_PREC (`_dot_mode`): on a GPU with bf16/fp16 inputs
# their operands are cast to that dtype (fp32 accumulation); elementwise math stays fp32. The
# recurrent state S stays an fp32 accumulator, cast only as a dot operand. Tm = (I + A)^-1 is
# built in fp32 (its block merges dot fp32 operands in INV_PREC); dots with Tm use TM_PREC.


@triton.jit
def _unit_lower_inverse_z(b_A, z, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^-1 for a strictly lower [BT, BT] fp32 A, in registers (no scratch in memory).

    With D the BC-row diagonal blocks of A and L the blocks below them, I + A = (I + D)(I + N)
    with N = (I + D)^-1 L strictly lower by blocks, so N^NB = 0 (NB = BT / BC) and
    (I + A)^-1 = (I + N)^-1 (I + D)^-1. For a nilpotent X, (I + X)^-1 = (I - X)(I + X^2)(I + X^4)...:
    all (I + D_dd)^-1 at once on the [NB, BC, BC] diagonal blocks (INV_SQUARINGS batched
    exact-fp32 squarings and products), then the merge as log2(NB) full [BT, BT] products and
    MERGE_SQUARINGS squarings in PREC. Each step is a dot on registers: the blockwise forward
    substitution this replaced took a round trip through memory and two CTA barriers per row block.

    z: 0, added to its index vectors. A plain call passes the literal 0 (`_unit_lower_inverse`),
    which folds away; a caller that loops over it (the share prepare's value heads) passes a 0 the
    compiler cannot see is 0, so that the masks built from them are not hoisted out of the
    caller's loop and held in registers across it (the sm_90 build spilled them there).
    """
    NB: tl.constexpr = BT // BC
    o_i = tl.arange(0, BT) + z
    o_c = tl.arange(0, BC) + z
    o_b = tl.arange(0, NB) + z
    m_same = (o_b[:, None] == o_b[None, :])[:, :, None, None]  # block (i, j) with i == j
    # the diagonal blocks: A as [NB, BC, NB, BC] -> [NB, NB, BC, BC], the blocks with j == i
    b_X = -tl.sum(tl.where(m_same, tl.permute(tl.reshape(b_A, [NB, BC, NB, BC]), (0, 2, 1, 3)), 0.0), axis=1)
    b_D = b_X + tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)[None, :, :]
    for _ in tl.static_range(INV_SQUARINGS):
        b_X = tl.dot(b_X, b_X, input_precision="ieee")
        b_D = b_D + tl.dot(b_D, b_X, input_precision="ieee")
    # (I + D)^-1 back to a block-diagonal [BT, BT]
    b_T = tl.reshape(tl.permute(tl.where(m_same, b_D[:, None, :, :], 0.0), (0, 2, 1, 3)), [BT, BT])
    if NB > 1:
        m_diag = ((o_i - z)[:, None] // BC) == ((o_i - z)[None, :] // BC)
        b_N = -_dot(b_T, tl.where(m_diag, 0.0, b_A), PREC)  # -N
        b_T = b_T + _dot(b_N, b_T, PREC)
        for _ in tl.static_range(MERGE_SQUARINGS):
            b_N = _dot(b_N, b_N, PREC)
            b_T = b_T + _dot(b_N, b_T, PREC)
    return b_T


@triton.jit
def _unit_lower_inverse(b_A, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^-1 for a strictly lower [BT, BT] fp32 A: `_unit_lower_inverse_z` with z = 0."""
    return _unit_lower_inverse_z(b_A, 0, BT, BC, PREC)


@triton.jit
def gdn_prepare_fwd_kernel(
    p_q,
    p_k,
    p_v,
    p_g,
    p_beta,
    p_w,
    p_u,
    p_kd,
    p_qg,
    p_A,
    p_gl,
    p_Tm,
    p_M,
    T,
    Tp,
    NT,
    HK,
    HV,
    K,
    V,
    scale,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_L2: tl.constexpr,
    KEEP_TM: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TM_PREC: tl.constexpr,
    BC: tl.constexpr,
    INV_PREC: tl.constexpr,
    PIPE: tl.constexpr,
    STAGES: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Per (chunk, head): the Gram products, Tm = (I + A)^-1, then w, kd, qg per K tile and u per
    V tile. PIPE (config `prep_pipe` "on"; False: "off", the default) reorders it for fewer serial
    memory round trips: g's cumsum (and the gl store) waits until after the Gram loop, so q and k
    are fetched while g is; kd and qg (which do not need Tm) get their own loop before the inverse,
    a `tl.range` of STAGES stages without dots, whose q and k loads Triton's pipeliner then
    prefetches (in the default's w loop q feeds no dot and is loaded synchronously per tile); the
    w loop after the inverse loads k alone. Same arithmetic, same outputs. ROWS (config `fused_kq`
    "rows", for a fused forward without training): kd and qg are not written; p_kd and p_qg take
    their row factors instead, rk exp(gl - gc) and rq exp(gc) scale ([B, HV, Tp] fp32), which the
    fused state pass applies to the rows of v_new and of q S_c (its dots take the raw k and q).
    """
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // HV
    i_h = i_bh % HV
    i_hk = i_h // (HV // HK)
    o_i = tl.arange(0, BT)
    o_t = i_t * BT + o_i
    m_t = o_t < T
    o_qk = ((i_b * T + o_t) * HK + i_hk) * K  # row starts in q/k [B, T, HK, K]
    o_vr = ((i_b * T + o_t) * HV + i_h) * V  # row starts in v [B, T, HV, V]
    o_s = (i_b * T + o_t) * HV + i_h  # beta/g index [B, T, HV]
    o_row = i_bh * Tp + o_t  # rows of the [B, HV, Tp, *] intermediates
    b_beta = tl.load(p_beta + o_s, mask=m_t, other=0.0).to(tl.float32)
    # padded rows load g = 0, so gc at the last row is the cumsum up to the last real token
    if PIPE:
        b_g = tl.load(p_g + o_s, mask=m_t, other=0.0).to(tl.float32)  # summed after the Gram loop
    else:
        b_gc = tl.cumsum(tl.load(p_g + o_s, mask=m_t, other=0.0).to(tl.float32), axis=0)
        b_gl = tl.sum(tl.where(o_i == BT - 1, b_gc, 0.0), axis=0)
        tl.store(p_gl + i_bh * NT + i_t, b_gl)

    # Gram products of the raw q, k (bilinear: the l2norm's row scales apply afterwards), with
    # the sums of squares from the same loads: one pass over q and k instead of two
    b_sq = tl.zeros([BT], dtype=tl.float32)
    b_sk = tl.zeros([BT], dtype=tl.float32)
    b_Akk = tl.zeros([BT, BT], dtype=tl.float32)
    b_Aqk = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        b_q = tl.load(p_q + o_qk[:, None] + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_k = tl.load(p_k + o_qk[:, None] + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        if USE_L2:
            b_sq += tl.sum(b_q * b_q, axis=1)
            b_sk += tl.sum(b_k * b_k, axis=1)
        b_Akk += _dot(b_k, tl.trans(b_k), DOT_PREC)
        b_Aqk += _dot(b_q, tl.trans(b_k), DOT_PREC)
    b_rq = tl.full([BT], 1.0, dtype=tl.float32)
    b_rk = tl.full([BT], 1.0, dtype=tl.float32)
    if USE_L2:
        b_rq = tl.rsqrt(b_sq + 1e-6)
        b_rk = tl.rsqrt(b_sk + 1e-6)
        b_Akk = b_Akk * (b_rk[:, None] * b_rk[None, :])
        b_Aqk = b_Aqk * (b_rq[:, None] * b_rk[None, :])
    if PIPE:
        b_gc = tl.cumsum(b_g, axis=0)
        b_gl = tl.sum(tl.where(o_i == BT - 1, b_gc, 0.0), axis=0)
        tl.store(p_gl + i_bh * NT + i_t, b_gl)
        if not ROWS:
            # kd and qg before the inverse, in a loop without dots that Triton pipelines
            for i_k in tl.range(0, tl.cdiv(K, BK), num_stages=STAGES):
                o_k = i_k * BK + tl.arange(0, BK)
                m_k = o_k < K
                m_tk = m_t[:, None] & m_k[None, :]
                b_q = tl.load(p_q + o_qk[:, None] + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32) * b_rq[:, None]
                b_k = tl.load(p_k + o_qk[:, None] + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32) * b_rk[:, None]
                b_kd = b_k * tl.exp(b_gl - b_gc)[:, None]
                b_qg = b_q * (tl.exp(b_gc) * scale)[:, None]
                o_out = o_row[:, None] * K + o_k[None, :]
                tl.store(p_kd + o_out, b_kd.to(p_kd.dtype.element_ty), mask=m_k[None, :])
                tl.store(p_qg + o_out, b_qg.to(p_qg.dtype.element_ty), mask=m_k[None, :])
    if ROWS:  # kd and qg not written: their row factors, for the fused state pass
        tl.store(p_kd + o_row, b_rk * tl.exp(b_gl - b_gc))
        tl.store(p_qg + o_row, b_rq * (tl.exp(b_gc) * scale))
    m_lower = o_i[:, None] > o_i[None, :]
    m_causal = o_i[:, None] >= o_i[None, :]
    b_dec = tl.exp(tl.minimum(b_gc[:, None] - b_gc[None, :], 0.0))
    b_Akk = b_Akk * b_dec
    b_Aqk = b_Aqk * b_dec
    if KEEP_TM:  # the backward reuses the decayed Gram product <k_i, k_j> without beta
        tl.store(p_M + o_row[:, None] * BT + o_i[None, :], tl.where(m_lower, b_Akk, 0.0).to(p_M.dtype.element_ty))
    b_Akk = tl.where(m_lower, b_Akk * b_beta[:, None], 0.0)
    b_Aqk = tl.where(m_causal, b_Aqk * scale, 0.0)
    tl.store(p_A + o_row[:, None] * BT + o_i[None, :], b_Aqk.to(p_A.dtype.element_ty))

    b_T = _unit_lower_inverse(b_Akk, BT, BC, INV_PREC)  # Tm = (I + A)^-1
    if KEEP_TM:
        tl.store(p_Tm + o_row[:, None] * BT + o_i[None, :], b_T.to(p_Tm.dtype.element_ty))

    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        if not PIPE:  # else kd and qg are stored by the loop before the inverse
            if not ROWS:
                b_q = tl.load(p_q + o_qk[:, None] + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32) * b_rq[:, None]
        b_k = tl.load(p_k + o_qk[:, None] + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32) * b_rk[:, None]
        b_w = _dot(b_T, b_k * (b_beta * tl.exp(b_gc))[:, None], TM_PREC)
        if not PIPE:
            if not ROWS:
                b_kd = b_k * tl.exp(b_gl - b_gc)[:, None]
                b_qg = b_q * (tl.exp(b_gc) * scale)[:, None]
        o_out = o_row[:, None] * K + o_k[None, :]
        tl.store(p_w + o_out, b_w.to(p_w.dtype.element_ty), mask=m_k[None, :])
        if not PIPE:
            if not ROWS:
                tl.store(p_kd + o_out, b_kd.to(p_kd.dtype.element_ty), mask=m_k[None, :])
                tl.store(p_qg + o_out, b_qg.to(p_qg.dtype.element_ty), mask=m_k[None, :])
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        b_v = tl.load(p_v + o_vr[:, None] + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
        b_u = _dot(b_T, b_v * b_beta[:, None], TM_PREC)
        tl.store(p_u + o_row[:, None] * V + o_v[None, :], b_u.to(p_u.dtype.element_ty), mask=m_v[None, :])


@triton.jit
def gdn_state_fwd_kernel(
    p_w,
    p_u,
    p_kd,
    p_gl,
    p_h0,
    p_h,
    p_vn,
    p_ht,
    p_qg,
    p_A,
    p_o,
    p_q,
    p_k,
    NT,
    Tp,
    K,
    V,
    T,
    HV,
    HK,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_H0: tl.constexpr,
    STAGES: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FUSE_O: tl.constexpr,
    KEEP: tl.constexpr,
    ROWS: tl.constexpr,
):
    # One program owns a [K, BV] slice of one head's state and walks the chunks in order. Only
    # b_h is carried between chunks, so with STAGES > 1 the next chunks' w, u, kd (and gl) loads
    # are issued while the current chunk's dots run (software pipelining of the loop).
    # FUSE_O (config `fwd_o` "fused"): the output kernel's o = qg S_c + Aqk v_new per chunk here,
    # while S_c is in registers (qg and Aqk join the prefetched loads); KEEP: S_c and v_new are
    # stored (the output kernel's or the backward's), else (a fused forward without training)
    # neither is written. ROWS (with FUSE_O, config `fused_kq` "rows"): p_kd and p_qg hold the
    # prepare's row factors fk, fq ([B, HV, Tp] fp32) and the raw k and q rows [B, T, HK, K] feed the
    # dots: qg S_c = diag(fq) (q S_c), kd^T v_new = k^T (diag(fk) v_new), so the prepare writes
    # neither kd nor qg.
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // HV
    i_hv = i_bh % HV
    i_hk = i_hv // (HV // HK)
    o_i = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        b_h += tl.load(p_h0 + i_bh * K * V + o_kv, mask=m_kv, other=0.0).to(tl.float32)
    for i_t in tl.range(0, NT, num_stages=STAGES):
        o_row = i_bh * Tp + i_t * BT + o_i
        if KEEP:
            tl.store(p_h + (i_bh * NT + i_t) * K * V + o_kv, b_h.to(p_h.dtype.element_ty), mask=m_kv)
        b_w = tl.load(p_w + o_row[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
        b_u = tl.load(p_u + o_row[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
        b_vn = b_u.to(tl.float32) - _dot(b_w, b_h, DOT_PREC)
        if KEEP:
            tl.store(p_vn + o_row[:, None] * V + o_v[None, :], b_vn.to(p_vn.dtype.element_ty), mask=m_v[None, :])
        if FUSE_O:
            # o from S_c (before this chunk's update) and v_new, as the output kernel: the dots'
            # operands round as they would through the stored S_c and v_new (IDT = the dot dtype)
            b_A = tl.load(p_A + o_row[:, None] * BT + o_i[None, :])
            if ROWS:  # qg S_c = diag(fq) q S_c: the raw q rows feed the dot, its rows are scaled
                o_tq = i_t * BT + o_i
                o_qk = ((i_b * T + o_tq) * HK + i_hk) * K
                # `_operand` casts the raw q rows to the dot's operand type: fp32 for a 32-bit dot (as
                # in the interpreter), left in the inputs' 16-bit dtype for a 16-bit one
                b_q = _operand(tl.load(p_q + o_qk[:, None] + o_k[None, :], mask=(o_tq < T)[:, None] & m_k[None, :],
                                       other=0.0), DOT_PREC)
                b_o = tl.load(p_qg + o_row)[:, None] * _dot(b_q, b_h, DOT_PREC) + _dot(b_A, b_vn, DOT_PREC)
            else:
                b_qg = tl.load(p_qg + o_row[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
                b_o = _dot(b_qg, b_h, DOT_PREC) + _dot(b_A, b_vn, DOT_PREC)
            o_t = i_t * BT + o_i
            o_o = ((i_b * T + o_t) * HV + i_hv) * V
            tl.store(p_o + o_o[:, None] + o_v[None, :], b_o.to(p_o.dtype.element_ty),
                     mask=(o_t < T)[:, None] & m_v[None, :])
        if ROWS:  # kd^T v_new = k^T diag(fk) v_new: the raw k rows feed the dot, v_new's rows are scaled
            o_tk = i_t * BT + o_i
            o_kk = ((i_b * T + o_tk) * HK + i_hk) * K
            b_kd = _operand(tl.load(p_k + o_kk[:, None] + o_k[None, :], mask=(o_tk < T)[:, None] & m_k[None, :],
                                    other=0.0), DOT_PREC)
            b_vn = b_vn * tl.load(p_kd + o_row)[:, None]
        else:
            b_kd = tl.load(p_kd + o_row[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
        b_gl = tl.load(p_gl + i_bh * NT + i_t)
        b_h = b_h * tl.exp(b_gl)
        b_h += _dot(tl.trans(b_kd), b_vn, DOT_PREC)
    tl.store(p_ht + i_bh * K * V + o_kv, b_h, mask=m_kv)


@triton.jit
def gdn_output_fwd_kernel(
    p_qg,
    p_h,
    p_A,
    p_vn,
    p_o,
    T,
    Tp,
    NT,
    HV,
    K,
    V,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_t = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    i_b = i_bh // HV
    i_h = i_bh % HV
    o_i = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    o_row = i_bh * Tp + i_t * BT + o_i
    b_qg = tl.load(p_qg + o_row[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
    b_h = tl.load(p_h + (i_bh * NT + i_t) * K * V + o_k[:, None] * V + o_v[None, :],
                  mask=m_k[:, None] & m_v[None, :], other=0.0)
    b_A = tl.load(p_A + o_row[:, None] * BT + o_i[None, :])
    b_vn = tl.load(p_vn + o_row[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
    b_o = _dot(b_qg, b_h, DOT_PREC) + _dot(b_A, b_vn, DOT_PREC)
    o_t = i_t * BT + o_i
    o_o = ((i_b * T + o_t) * HV + i_h) * V
    m_o = (o_t < T)[:, None] & m_v[None, :]
    b_o = b_o.to(p_o.dtype.element_ty)
    tl.store(p_o + o_o[:, None] + o_v[None, :], b_o, mask=m_o)


@triton.jit
def gdn_recurrent_fwd_kernel(
    p_q,
    p_k,
    p_v,
    p_g,
    p_beta,
    p_h0,
    p_o,
    p_ht,
    T,
    HK,
    HV,
    K,
    V,
    scale,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_L2: tl.constexpr,
    HAS_H0: tl.constexpr,
):
    # Token-by-token recurrence for decoding: one program owns a [K, BV] slice of one head's state.
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // HV
    i_h = i_bh % HV
    i_hk = i_h // (HV // HK)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        b_h += tl.load(p_h0 + i_bh * K * V + o_kv, mask=m_kv, other=0.0).to(tl.float32)
    for i_t in range(0, T):
        o_s = (i_b * T + i_t) * HV + i_h
        o_qk = ((i_b * T + i_t) * HK + i_hk) * K
        b_q = tl.load(p_q + o_qk + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(p_k + o_qk + o_k, mask=m_k, other=0.0).to(tl.float32)
        if USE_L2:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, axis=0) + 1e-6)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=0) + 1e-6)
        b_v = tl.load(p_v + o_s * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_beta = tl.load(p_beta + o_s).to(tl.float32)
        b_h = b_h * tl.exp(tl.load(p_g + o_s).to(tl.float32))
        b_d = (b_v - tl.sum(b_h * b_k[:, None], axis=0)) * b_beta
        b_h += b_k[:, None] * b_d[None, :]
        b_o = tl.sum(b_h * b_q[:, None], axis=0) * scale
        tl.store(p_o + o_s * V + o_v, b_o.to(p_o.dtype.element_ty), mask=m_v)
    tl.store(p_ht + i_bh * K * V + o_kv, b_h, mask=m_kv)


# ---- host side --------------------------------------------------------------------------------
# Legend: B batch, T tokens, Tp = NT * BT padded tokens, NT chunks, BT chunk size, HK key heads,
# HV value heads, K key head dim, V value head dim.


def _cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the host's grids and sizes: `triton.cdiv` without its constexpr-function
    wrapper (triton 3.6 and 3.9: about 1.5-2 us a call on the host)."""
    return -(-a // b)


def _npow2(n: int) -> int:
    """`triton.next_power_of_2` (0 at 0) without its constexpr-function wrapper (a symbolic size, as
    the fake impls get under dynamic shapes, goes to triton's)."""
    if type(n) is not int:
        return triton.next_power_of_2(n)
    return 1 << (n - 1).bit_length() if n > 0 else 0


def _check(q, k, v, g, beta, initial_state) -> None:
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"gated_delta: q and k must be [B, T, HK, K] and equal, got q {tuple(q.shape)} k {tuple(k.shape)}")
    B, T, HK, K = q.shape
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"gated_delta: v must be [B, T, HV, V] with q's B, T; got v {tuple(v.shape)} q {tuple(q.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if HV % HK != 0:
        raise ValueError(f"gated_delta: value heads {HV} must be a multiple of key heads {HK} (q {tuple(q.shape)} v {tuple(v.shape)})")
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM or K < 1 or V < 1:
        raise ValueError(f"gated_delta: head dims K={K} V={V} must be in [1, {MAX_HEAD_DIM}]")
    g_shape = (B, T, HV)
    if tuple(g.shape) != g_shape:
        raise ValueError(f"gated_delta: g must be [B, T, HV] = {g_shape}, got {tuple(g.shape)}")
    if tuple(beta.shape) != (B, T, HV):
        raise ValueError(f"gated_delta: beta must be [B, T, HV] = {(B, T, HV)}, got {tuple(beta.shape)}")
    if initial_state is not None and tuple(initial_state.shape) != (B, HV, K, V):
        raise ValueError(f"gated_delta: initial_state must be [B, HV, K, V] = {(B, HV, K, V)}, got {tuple(initial_state.shape)}")


# `_tiles`' results by (K, V, dtype, device, BH, mode, the host's part of `_dot_mode`), each kept with
# the pins it was computed under (the all-shapes pin and K's bucket pin), which a hit must still find
# (by identity: `set_config` stores a new dict per pin, and a kept entry holds its pins alive, so no
# other dict takes their ids; or, failing that, by equality: the same values pinned again, as a bench
# sweep row does before each step, then kept as the entry's pins). Up to _TILES_KEEP entries. A result
# is shared: callers read it only.
_TILES_CACHE: dict = {}
_TILES_KEEP = 256
_CPU = torch.device("cpu")


def _tiles(K: int, V: int, dtype: torch.dtype | None = None, device: torch.device | None = None,
           BH: int | None = None, mode: str | None = None) -> dict:
    """`_tiles_for` (below), computed once per key and pins (`_TILES_CACHE`): a training step asks
    for the same tiles three times, and `_state_bv` reads the device's SM count on a GPU."""
    if type(K) is not int or type(V) is not int or (BH is not None and type(BH) is not int):
        return _tiles_for(K, V, dtype, device, BH, mode)  # symbolic sizes (fake impls): not kept
    dt, dev = dtype if dtype is not None else torch.float32, device if device is not None else _CPU
    # the mode that does not come from the config (16-bit on a GPU, "ieee" without tf32), else None
    key = (K, V, dt, dev, BH, mode, mode if mode is not None else _dot_mode(None, dt, dev))
    hit = _TILES_CACHE.get(key)
    if hit is not None:
        over, tuned = _CONFIG_OVERRIDE, _TUNED.get(hit[2])
        if hit[0] is over and hit[1] is tuned:
            return hit[3]
        if hit[0] == over and hit[1] == tuned:  # equal pins set again (a bench sweep row pins per step)
            _TILES_CACHE[key] = (over, tuned, hit[2], hit[3])
            return hit[3]
    bucket = shape_bucket(K)
    pins = (_CONFIG_OVERRIDE, _TUNED.get(bucket))
    c = _tiles_for(K, V, dtype, device, BH, mode)
    if len(_TILES_CACHE) >= _TILES_KEEP:
        _TILES_CACHE.clear()
    _TILES_CACHE[key] = (*pins, bucket, c)
    return c


def _tiles_for(K: int, V: int, dtype: torch.dtype | None = None, device: torch.device | None = None,
               BH: int | None = None, mode: str | None = None) -> dict:
    """Tiles and dot modes for head dims K, V and inputs of `dtype` on `device` (BH = B * HV;
    `mode` instead of the `_dot_mode` they give: AOT specs for a GPU, built on any host).

    DOT_PREC is the `_dot` mode: the inputs' own 16-bit dot on a GPU, else the config's fp32
    precision. IDT is the storage dtype of the intermediates that are only ever dot operands
    (w, kd, qg, v_new, du): 16-bit exactly when the dots are, so storing them loses nothing the
    dots would keep. TM_PREC is the mode of the dots with Tm = (I + A)^-1: the config's `tm_dot`
    "tf32" keeps them on fp32 operands when DOT_PREC is 16-bit. prep_BK is the prepare kernel's
    K tile (the config's `prep_bk`; 0: BK, the backward chunk kernels' tile), prep_stages its
    pipeline stages (`prep_stages`; 0: num_stages). The serial state passes prefetch whole
    [BT, K] tiles per stage: with 32-bit operands (fp32 inputs) they take one stage, as more
    overflow sm_90's 232 KB of shared memory at K = 128 (GDN's state backward: 295 KB at three
    stages with exact fp32 dots, which failed on the H200 under the sixth session's defaults,
    328 KB at two with tf32 ones). `cfg` is `config_for(K)` itself.
    """
    cfg = config_for(K)
    BKF = max(16, _npow2(K))
    BVF = max(16, _npow2(V))
    if mode is None:
        mode = _dot_mode(cfg["dot_precision"], dtype if dtype is not None else torch.float32,
                         device if device is not None else torch.device("cpu"))
    wide = mode in ("bf16", "fp16")
    max_state_stages = 3 if wide else 1
    tm_mode = "tf32" if wide and cfg.get("tm_dot", "input") == "tf32" else mode
    inv_mode = _inv_prec(cfg, mode)
    return {
        "BK": min(cfg["BK"], BKF), "prep_BK": min(cfg.get("prep_bk") or cfg["BK"], BKF), "BKF": BKF,
        "prep_stages": cfg.get("prep_stages") or cfg["num_stages"],
        "BV": min(cfg["BV"], BVF), "bwd_BV": min(cfg.get("bwd_bv") or cfg["BV"], BVF),
        "state_BV": _state_bv(cfg, BKF, BVF, BH, device),
        "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"], "DOT_PREC": mode, "TM_PREC": tm_mode,
        "INV_PREC": inv_mode, "BC": INV_BLOCK,
        "IDT": {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode, torch.float32),
        # the kept Tm, only ever a TM_PREC dot operand: stored in that operand's dtype
        "TM_DT": {"bf16": torch.bfloat16, "fp16": torch.float16}.get(tm_mode, torch.float32),
        "state_stages": min(cfg.get("state_stages", 1), max_state_stages),
        "state_bwd_stages": min(cfg.get("state_bwd_stages", 1), max_state_stages),
        "cfg": cfg,
    }


def _inv_prec(cfg: dict, mode: str) -> str:
    """Mode of the block-merge dots of Tm = (I + A)^-1: fp32 operands always (Tm's error feeds
    every w and u row); exact "ieee" when the other dots are, else the config's `inv_dot`."""
    return "ieee" if mode == "ieee" else cfg.get("inv_dot", "tf32")


def _state_bv(cfg: dict, BKF: int, BVF: int, BH: int | None, device: torch.device | None) -> int:
    """V tile of the serial state passes (grid: V / BV tiles x B * HV heads).

    `state_bv` 0 (auto) on a GPU: the widest of 64/32/16 whose grid covers 7/8 of the SMs, else
    16; the fp32 [K, BV] state at most 128 x 64 values (registers). Each program's chunk step is
    latency bound (two small dots), so a wider tile costs no time while the grid still fills the
    GPU and saves re-reading w and kd per V tile. At V = 128 on an H200 (132 SMs): B * HV = 32
    (B=2 HV=16; Qwen3-Next and Kimi-Linear at B=1) takes 32 (128 programs; 64 would idle half
    the SMs), B * HV = 16 takes 16 (128 programs), B * HV >= 64 takes 64. Elsewhere, or
    without BH, the config's BV.
    """
    bv = cfg.get("state_bv", 0)
    if bv:
        return min(bv, BVF)
    if BH is None or device is None or device.type != "cuda":
        return min(cfg["BV"], BVF)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    for cand in (64, 32, 16):
        fits = cand * BKF <= 128 * 64 and cand <= BVF
        if fits and 8 * _cdiv(BVF, cand) * BH >= 7 * sms:
            return cand
    return 16


def _prep_maxnreg(cfg: dict, rows: bool) -> int:
    """The prepare's register cap (0: none) under config `cfg`: `rows_maxnreg` where it writes row
    factors, else `prep_maxnreg`; `_prepare`'s launch and `aot_specs` both take it from here."""
    return (rows and cfg.get("rows_maxnreg")) or cfg.get("prep_maxnreg") or 0


def _prepare(q, k, v, g, beta, scale: float, use_l2: bool, keep_tm: bool = False, wide_u: bool = False,
             rows: bool = False):
    """Triton prepare: w, kd, qg [B, HV, Tp, K], u [B, HV, Tp, V], Aqk [B, HV, Tp, BT], gl, and
    with `keep_tm` Tm = (I + A)^-1 and the decayed key Gram product M = A / beta [B, HV, Tp, BT]
    (else None, None). Aqk and M in IDT (the backward's elementwise gate and beta gradients take
    them 16-bit under 16-bit dots), Tm in TM_DT; u is fp32 with
    `wide_u` (the backward's re-run, whose state pass rebuilds v_new from it), else IDT. With
    `rows` (config `fused_kq` "rows", a fused forward without training) kd and qg are their row
    factors [B, HV, Tp] fp32 instead (the fused state pass builds kd and qg from k and q)."""
    B, T, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BT = CHUNK_SIZE
    NT = _cdiv(T, BT)
    Tp = NT * BT
    c = _tiles(K, V, q.dtype, q.device)
    dev = q.device
    w = _empty((B, HV, Tp, K), c["IDT"], dev)
    kd = _empty((B, HV, Tp, K), c["IDT"], dev) if not rows else _empty((B, HV, Tp), torch.float32, dev)
    qg = _empty((B, HV, Tp, K), c["IDT"], dev) if not rows else _empty((B, HV, Tp), torch.float32, dev)
    # u feeds only dots (and u - w S_c, rounded to IDT as v_new anyway) in the forward: IDT there
    u = _empty((B, HV, Tp, V), torch.float32 if wide_u else c["IDT"], dev)
    A = _empty((B, HV, Tp, BT), c["IDT"], dev)
    Tm, M = None, None
    if keep_tm:
        Tm, M = _empty((B, HV, Tp, BT), c["TM_DT"], dev), _empty((B, HV, Tp, BT), c["IDT"], dev)
    gl = _empty((B, HV, NT), torch.float32, dev)
    cfg = c["cfg"]
    # the prepare's own warps (`prep_warps`) and a register cap (`prep_maxnreg`; `rows_maxnreg` when
    # it writes row factors; a compile option the interpreter drops) only where asked: the JIT's
    # build is otherwise unchanged
    nreg = _prep_maxnreg(cfg, rows)
    cap = {"maxnreg": nreg} if nreg else {}
    gdn_prepare_fwd_kernel[(NT, B * HV)](
        q, k, v, g, beta, w, u, kd, qg, A, gl, Tm if keep_tm else A, M if keep_tm else A, T, Tp, NT, HK, HV, K, V,
        scale,
        BT=BT, BK=c["prep_BK"], BV=c["BV"], USE_L2=use_l2, KEEP_TM=keep_tm, DOT_PREC=c["DOT_PREC"],
        TM_PREC=c["TM_PREC"], BC=c["BC"], INV_PREC=c["INV_PREC"], PIPE=cfg.get("prep_pipe", "off") == "on",
        STAGES=c["prep_stages"], ROWS=rows, num_warps=cfg.get("prep_warps") or c["num_warps"], num_stages=c["prep_stages"], **cap,
    )
    return w, u, kd, qg, A, gl, Tm, M


def _state_forward(w, u, kd, gl, initial_state, V: int, dtype: torch.dtype, out: tuple | None = None,
                   keep: bool = True, raw: tuple | None = None):
    """Triton state pass: per-chunk states S_c [B, HV, NT, K, V] and v_new [B, HV, Tp, V] in the
    dot operand dtype IDT, final state (fp32). With `out` = (qg, Aqk, T, o's dtype) it also writes
    o [B, T, HV, V] (config `fwd_o` "fused": the output kernel's product per chunk while
    S_c is in registers) and returns it fourth; without `keep` (a fused forward that keeps nothing
    for the backward) S_c and v_new are not written (None). With `raw` = (q, k) (and `out`), kd and
    qg are the prepare's row factors (`_prepare(rows=True)`), applied to the rows of q S_c and v_new."""
    B, HV, Tp, K = w.shape
    BT = CHUNK_SIZE
    NT = Tp // BT
    c = _tiles(K, V, dtype, w.device, B * HV)  # w is an intermediate: the inputs' dtype decides
    keep = keep or out is None
    h = _empty((B, HV, NT, K, V), c["IDT"], w.device) if keep else None
    vn = _empty((B, HV, Tp, V), c["IDT"], w.device) if keep else None
    qg, A, T, odt = out if out is not None else (w, w, 0, None)
    q, k = raw if raw is not None else (w, w)
    HK = q.shape[2] if raw is not None else HV
    o = _empty((B, T, HV, V), odt, w.device) if out is not None else None
    ht = _empty((B, HV, K, V), torch.float32, w.device)
    h0 = initial_state.contiguous() if initial_state is not None else ht
    gdn_state_fwd_kernel[(_cdiv(V, c["state_BV"]), B * HV)](
        w, u, kd, gl, h0, ht if h is None else h, ht if vn is None else vn, ht, qg, A, ht if o is None else o,
        q, k, NT, Tp, K, V, T, HV, HK,
        BT=BT, BK=c["BKF"], BV=c["state_BV"], HAS_H0=initial_state is not None, STAGES=c["state_stages"],
        DOT_PREC=c["DOT_PREC"],
        FUSE_O=out is not None, KEEP=keep, ROWS=raw is not None,
        num_warps=c["num_warps"], num_stages=c["num_stages"],
    )
    return (h, vn, ht) if out is None else (h, vn, ht, o)


def saved_shapes(q: torch.Tensor, v: torch.Tensor) -> list[tuple[tuple, torch.dtype]]:
    """(shape, dtype) of what a training forward keeps for the backward (`_forward(save=True)`):
    w, kd, qg [B, HV, Tp, K], Aqk, M [B, HV, Tp, BT] (IDT), Tm (TM_DT), gl, S_c [B, HV, NT, K, V]
    and v_new [B, HV, Tp, V] (IDT). Per token and value head that is 3K + V + 3 BT 16-bit values
    (with 16-bit Tm dots) and K V / BT more for S_c: at K = V = 128, BT = 64 with bf16 inputs 1.9
    KB, 2.5x the bf16 q, k, v, g, beta (HV = HK) that the recomputing backward (param `recompute`)
    keeps."""
    B, T, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BT = CHUNK_SIZE
    NT = _cdiv(T, BT)
    Tp = NT * BT
    c = _tiles(K, V, q.dtype, q.device)
    idt = c["IDT"]
    f32 = torch.float32
    gl = (B, HV, NT)
    return [((B, HV, Tp, K), idt), ((B, HV, Tp, K), idt), ((B, HV, Tp, K), idt), ((B, HV, Tp, BT), idt),
            (gl, f32), ((B, HV, Tp, BT), c["TM_DT"]), ((B, HV, Tp, BT), idt), ((B, HV, NT, K, V), idt),
            ((B, HV, Tp, V), idt)]


def _forward(q, k, v, g, beta, initial_state, scale: float, use_l2: bool, save: bool = False):
    """o [B, T, HV, V] and the final state; with `save` also the intermediates the backward
    needs (`saved_shapes`), so that it runs neither the prepare kernel nor the state pass again."""
    _check(q, k, v, g, beta, initial_state)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    B, T, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if T == 0:
        ht = initial_state.float().clone() if initial_state is not None else q.new_zeros((B, HV, K, V), dtype=torch.float32)
        saved = [q.new_empty(shape, dtype=dtype) for shape, dtype in saved_shapes(q, v)] if save else []
        return v.new_empty((B, 0, HV, V)), ht, *saved
    cfg = _tiles(K, V, q.dtype, q.device)["cfg"]  # `_prepare`'s tiles (one cache entry)
    fused = cfg.get("fwd_o", "split") == "fused"
    # `fused_kq` "rows": a fused forward without training writes row factors instead of kd and qg
    rows = fused and not save and cfg.get("fused_kq", "stored") == "rows"
    w, u, kd, qg, A, gl, Tm, M = _prepare(q, k, v, g, beta, scale, use_l2, keep_tm=save, rows=rows)
    if fused:  # o from the state pass, no output kernel
        h, vn, ht, o = _state_forward(w, u, kd, gl, initial_state, V, q.dtype, out=(qg, A, T, v.dtype), keep=save,
                                      raw=(q, k) if rows else None)
        return (o, ht, w, kd, qg, A, gl, Tm, M, h, vn) if save else (o, ht)
    # the output kernel reads S_c only as a dot operand: stored in that operand's dtype
    h, vn, ht = _state_forward(w, u, kd, gl, initial_state, V, q.dtype)
    o = _output(qg, h, A, vn, T, v.dtype)
    if save:
        return o, ht, w, kd, qg, A, gl, Tm, M, h, vn

    return o, ht


def _output(qg, h, A, vn, T: int, dtype: torch.dtype):
    """Triton output kernel: o [B, T, HV, V] in `dtype` from qg, S_c, Aqk and v_new."""
    B, HV, Tp, K = qg.shape
    V = vn.shape[-1]
    BT = CHUNK_SIZE
    NT = Tp // BT
    c = _tiles(K, V, dtype, qg.device)
    o = _empty((B, T, HV, V), dtype, qg.device)
    gdn_output_fwd_kernel[(_cdiv(V, c["BV"]), NT, B * HV)](
        qg, h, A, vn, o, T, Tp, NT, HV, K, V,
        BT=BT, BK=c["BKF"], BV=c["BV"], DOT_PREC=c["DOT_PREC"], num_warps=c["num_warps"],
        num_stages=c["num_stages"],
    )
    return o


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def chunk_prepare_torch(q, k, v, g, beta, scale: float, use_l2: bool, chunk_size: int = CHUNK_SIZE):
    """Batched PyTorch twin of the prepare kernel, differentiable; chunked [B, HV, NT, BT, *] outputs.

    Returns w, u, kd, qg, Aqk, gl (gl [B, HV, NT]). A test reference for the prepare
    kernel; the backward does not use it (it runs in Triton).
    """
    B, T, HK, K = q.shape
    HV = v.shape[2]
    BT = chunk_size
    NT = _cdiv(T, BT)
    pad = NT * BT - T
    q, k = (x.float().repeat_interleave(HV // HK, dim=2) if HV != HK else x.float() for x in (q, k))
    if use_l2:
        q, k = _l2norm(q), _l2norm(k)

    def chunks(x):  # [B, T, HV, D] -> [B, HV, NT, BT, D]
        return F.pad(x.float().transpose(1, 2), (0, 0, 0, pad)).reshape(B, HV, NT, BT, -1)

    q, k, v = chunks(q), chunks(k), chunks(v)
    beta = F.pad(beta.float().transpose(1, 2), (0, pad)).reshape(B, HV, NT, BT)
    causal = torch.ones(BT, BT, dtype=torch.bool, device=q.device).tril()
    strict = causal.tril(-1)
    gc = F.pad(g.float().transpose(1, 2), (0, pad)).reshape(B, HV, NT, BT).cumsum(-1)
    gl = gc[..., -1]
    dec = torch.where(causal, gc[..., :, None] - gc[..., None, :], float("-inf")).exp()
    Akk = (k @ k.transpose(-1, -2)) * dec
    Aqk = (q @ k.transpose(-1, -2)) * dec * scale
    kb = k * (beta * gc.exp())[..., None]
    kd = k * (gl[..., None] - gc).exp()[..., None]
    qg = q * (gc.exp() * scale)[..., None]
    Akk = (Akk * beta[..., None]).masked_fill(~strict, 0.0)
    eye = torch.eye(BT, dtype=Akk.dtype, device=Akk.device)
    # unit lower-triangular solve == multiplying by (I + A)^-1
    w = torch.linalg.solve_triangular(Akk + eye, kb, upper=False, unitriangular=True)
    u = torch.linalg.solve_triangular(Akk + eye, v * beta[..., None], upper=False, unitriangular=True)
    return w, u, kd, qg, Aqk, gl


# ---- backward ---------------------------------------------------------------------------------
# Per chunk (rows i, j in the chunk; X = beta k exp(gc), Y = beta v; S_c the state entering it):
#   o = qg S_c + Aqk v_new,  v_new = u - w S_c,  S_{c+1} = exp(gl) S_c + kd^T v_new,
#   w = Tm X,  u = Tm Y,  Tm = (I + A)^-1.
# Reverse state pass (serial over chunks; dS = dL/dS_{c+1}, starting at d final state):
#   du = Aqk^T do + kd dS;   dS <- exp(gl) dS + qg^T do - w^T du.
# Chunk-local gradients (parallel over chunks):
#   dqg = do S_c^T, dw = -du S_c^T, dkd = v_new dS^T, dAqk = tril(do v_new^T),
#   dgl = exp(gl) <S_c, dS> + sum(kd * dkd);  dY = Tm^T du, dX = Tm^T dw,
#   dA = -strict_tril(Tm^T dTm Tm^T) (from dTm = -Tm dA Tm) with dTm = du Y^T + dw X^T
#      = du (Y - X S_c)^T = du v_new^T (I + A)^T, and Tm (I + A) = I:  dA = -strict_tril(dY v_new^T),
#   known before any K tile (no dTm summed over K, no [BT, BT] solve dots);
#   each decayed product c_ij = <a_i, b_j>_{exp(gc_i - gc_j)} with cotangent P_ij passes
#   P e b_j to a_i, P e a_i to b_j and +/- a_i b_j e P to gc_i / gc_j; dg is the reverse cumsum
#   of dgc within the chunk (gl is gc at the chunk's last row); the l2norm backward last, inside
#   each K tile (its row dots <x_n, dx_n> in closed form from the V side, see `_gdn_wy_head`).


@triton.jit
def gdn_state_bwd_kernel(
    p_do,
    p_A,
    p_kd,
    p_qg,
    p_w,
    p_gl,
    p_dht,
    p_dh,
    p_du,
    p_dh0,
    T,
    Tp,
    NT,
    HV,
    K,
    V,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    STAGES: tl.constexpr,
    DOT_PREC: tl.constexpr,
    HAS_DHT: tl.constexpr,
):
    # One program owns a [K, BV] slice of one head's state gradient and walks the chunks backwards;
    # only b_dS is carried, so STAGES > 1 prefetches the next chunks' do, Aqk, kd, qg, w.
    # HAS_DHT False: no gradient reached the final state, dS starts at zero (p_dht is not read).
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // HV
    i_h = i_bh % HV
    o_i = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]
    if HAS_DHT:
        b_dS = tl.load(p_dht + i_bh * K * V + o_kv, mask=m_kv, other=0.0).to(tl.float32)
    else:
        b_dS = tl.zeros([BK, BV], dtype=tl.float32)
    for i_s in tl.range(0, NT, num_stages=STAGES):
        i_t = NT - 1 - i_s
        o_t = i_t * BT + o_i
        o_row = i_bh * Tp + o_t
        tl.store(p_dh + (i_bh * NT + i_t) * K * V + o_kv, b_dS.to(p_dh.dtype.element_ty), mask=m_kv)
        b_do = _operand(tl.load(p_do + ((i_b * T + o_t) * HV + i_h)[:, None] * V + o_v[None, :],
                                    mask=(o_t < T)[:, None] & m_v[None, :], other=0.0), DOT_PREC)
        b_A = tl.load(p_A + o_row[:, None] * BT + o_i[None, :])
        b_kd = tl.load(p_kd + o_row[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
        b_du = _dot(tl.trans(b_A), b_do, DOT_PREC)
        b_du += _dot(b_kd, b_dS, DOT_PREC)
        tl.store(p_du + o_row[:, None] * V + o_v[None, :], b_du.to(p_du.dtype.element_ty), mask=m_v[None, :])
        b_qg = tl.load(p_qg + o_row[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
        b_w = tl.load(p_w + o_row[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
        b_dS = b_dS * tl.exp(tl.load(p_gl + i_bh * NT + i_t))
        b_dS += _dot(tl.trans(b_qg), b_do, DOT_PREC)
        b_dS -= _dot(tl.trans(b_w), b_du, DOT_PREC)
    tl.store(p_dh0 + i_bh * K * V + o_kv, b_dS, mask=m_kv)


@triton.jit
def _gdn_wy_head(
    p_q,
    p_k,
    p_v,
    p_g,
    p_beta,
    p_Tm,
    p_M,
    p_A,
    p_h,
    p_dh,
    p_vn,
    p_du,
    p_do,
    p_dq,
    p_dk,
    p_dv,
    p_dg,
    p_dbeta,
    p_sdq,
    p_dqo,
    p_dko,
    i_t,
    i_b,
    i_h,
    i_hk,
    T,
    Tp,
    NT,
    HK,
    HV,
    K,
    V,
    scale,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_L2: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TM_PREC: tl.constexpr,
    G: tl.constexpr,
):
    # Chunk-local backward of one (chunk, value head), K and V in tiles (shared memory stays
    # bounded at K = 256). The V side gives dv, dAqk and dA (dA = -strict_tril(dY v_new^T), see
    # the notes above), so that each K tile is finished in one visit: the direct gradients of qg,
    # kd and X, the decayed products A = beta M and Aqk back to q and k, the l2norm
    # backward (its row dots <x_n, dx_n> come from the V side, see below), dbeta and dg. dq, dk
    # go to the head's fp32 slots when a sum over a key head's G value heads follows, else
    # straight to dqo, dko in q's dtype.
    i_bh = i_b * HV + i_h
    i_bt = i_b.to(tl.int64) * T  # first token of the sequence
    i_bh64 = i_bh.to(tl.int64)
    p_q += (i_bt * HK + i_hk) * K
    p_k += (i_bt * HK + i_hk) * K
    p_v += (i_bt * HV + i_h) * V
    p_do += (i_bt * HV + i_h) * V
    p_dv += (i_bt * HV + i_h) * V
    p_dq += (i_bt * HV + i_h) * K
    p_dk += (i_bt * HV + i_h) * K
    p_beta += i_bt * HV + i_h
    p_dbeta += i_bt * HV + i_h
    p_g += i_bt * HV + i_h
    p_dg += i_bt * HV + i_h
    p_dqo += (i_bt * HK + i_hk) * K
    p_dko += (i_bt * HK + i_hk) * K
    p_sdq += i_bt * HV + i_h
    p_Tm += i_bh64 * Tp * BT
    p_M += i_bh64 * Tp * BT
    p_A += i_bh64 * Tp * BT
    p_vn += i_bh64 * Tp * V
    p_du += i_bh64 * Tp * V
    p_h += (i_bh64 * NT + i_t) * K * V
    p_dh += (i_bh64 * NT + i_t) * K * V
    o_i = tl.arange(0, BT)
    o_t = i_t * BT + o_i
    m_t = o_t < T
    o_qk = o_t * (HK * K)  # rows of q, k, dqo, dko
    o_vr = o_t * (HV * V)  # rows of v, do, dv
    o_s = o_t * HV  # rows of beta, g (x K: rows of dq, dk)
    o_row = o_t  # rows of Tm, v_new, du
    o_tt = o_row[:, None] * BT + o_i[None, :]
    m_lower = o_i[:, None] > o_i[None, :]
    m_causal = o_i[:, None] >= o_i[None, :]
    # padded rows contribute nothing to dgc, so gl's gradient may sit on the last real row
    m_last = o_i == tl.minimum(T - i_t * BT, BT) - 1
    NK = tl.cdiv(K, BK)
    b_beta = tl.load(p_beta + o_s, mask=m_t, other=0.0).to(tl.float32)
    b_Tm = _cast_operand(tl.load(p_Tm + o_tt), TM_PREC)  # held through the K tiles

    # ---- V side: dv, and the [BT, BT] cotangents dAqk and dA summed over value channels
    b_dAqk = tl.zeros([BT, BT], dtype=tl.float32)
    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    b_dbeta = tl.zeros([BT], dtype=tl.float32)
    # The l2norm backward's row dots with the normalised rows: <k_n, dk_n> before any K tile, from
    # the chunk's equations (checked against autograd by the CPU tests): <k_n, dk_n>_i =
    # <dY_i + du_i, v_new_i> - beta_i <dY_i, v_i> + sum_j dA_ji A_ji. <q_n, dq_n> sums over the K
    # tiles, and `gdn_group_sum_kernel` finishes dq with it.
    b_sdq = tl.zeros([BT], dtype=tl.float32)
    b_sdk = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        b_do = _operand(tl.load(p_do + o_vr[:, None] + o_v[None, :], mask=m_tv, other=0.0), DOT_PREC)
        b_v = tl.load(p_v + o_vr[:, None] + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
        b_vn = tl.load(p_vn + o_row[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
        b_du = tl.load(p_du + o_row[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
        b_dAqk += _dot(b_do, tl.trans(b_vn), DOT_PREC)
        b_dY = _dot(tl.trans(b_Tm), b_du.to(tl.float32), TM_PREC)  # du may be stored 16-bit
        b_dA -= _dot(b_dY, tl.trans(b_vn), DOT_PREC)
        b_dyv = tl.sum(b_dY * b_v, axis=1)
        b_dbeta += b_dyv
        if USE_L2:
            b_sdk += tl.sum((b_dY + b_du.to(tl.float32)) * b_vn.to(tl.float32), axis=1) - b_beta * b_dyv
        tl.store(p_dv + o_vr[:, None] + o_v[None, :], (b_dY * b_beta[:, None]).to(p_dv.dtype.element_ty), mask=m_tv)
    b_dAqk = tl.where(m_causal, b_dAqk, 0.0)  # cotangent of the stored Aqk (scale included)
    b_dA = tl.where(m_lower, b_dA, 0.0)  # A's support
    # A = beta M with M the decayed Gram product <k_i, k_j> the prepare kernel kept
    b_M = tl.load(p_M + o_tt).to(tl.float32)
    b_dbeta += tl.sum(b_dA * b_M, axis=1)

    # ---- l2 norms of q and k rows
    b_sq = tl.zeros([BT], dtype=tl.float32)
    b_sk = tl.zeros([BT], dtype=tl.float32)
    NL = NK
    if not USE_L2:
        NL = 0
    for i_k in range(0, NL):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        b_q = tl.load(p_q + o_qk[:, None] + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_k = tl.load(p_k + o_qk[:, None] + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_sq += tl.sum(b_q * b_q, axis=1)
        b_sk += tl.sum(b_k * b_k, axis=1)
    b_rq = tl.full([BT], 1.0, dtype=tl.float32)
    b_rk = tl.full([BT], 1.0, dtype=tl.float32)
    if USE_L2:
        b_rq = tl.rsqrt(b_sq + 1e-6)
        b_rk = tl.rsqrt(b_sk + 1e-6)
    b_gc = tl.cumsum(tl.load(p_g + o_s, mask=m_t, other=0.0).to(tl.float32), axis=0)
    b_gl = tl.sum(tl.where(o_i == BT - 1, b_gc, 0.0), axis=0)
    b_eg = tl.exp(b_gc)
    b_ed = tl.exp(b_gl - b_gc)
    b_tdr = tl.zeros([BT], dtype=tl.float32)  # sum_k dkd * k per row
    b_dgls = tl.zeros([BK], dtype=tl.float32)  # <S_c, dS> spread over BK slots
    # each decayed product c_ij with cotangent dc_ij gives gc_i +dc c and gc_j -dc c, except where
    # the forward's exponent clamp is active; M and Aqk are those products (Aqk with its scale)
    b_Aqk = tl.load(p_A + o_tt).to(tl.float32)
    b_Q = b_dA * b_beta[:, None] * b_M  # dA * A
    b_R = tl.where(b_gc[:, None] - b_gc[None, :] <= 0.0, b_Q + b_dAqk * b_Aqk, 0.0)
    if USE_L2:
        b_sdk += tl.sum(b_Q, axis=0)
    b_dgc = tl.sum(b_R, axis=1) - tl.sum(b_R, axis=0)
    # cotangents of the undecayed <k_i, k_j> (symmetrised) and <q_i, k_j>, for the K tiles' dots
    b_e = tl.exp(tl.minimum(b_gc[:, None] - b_gc[None, :], 0.0))
    b_P = b_dA * b_beta[:, None] * b_e
    b_P = _cast_operand(b_P + tl.trans(b_P), DOT_PREC)
    b_Pq = _cast_operand(b_dAqk * (b_e * scale), DOT_PREC)

    # ---- K tiles: dqg, dw, dkd (sums over V), then every gradient of the tile's q, k channels
    for i_k in range(0, NK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        b_dqg = tl.zeros([BT, BK], dtype=tl.float32)
        b_dw = tl.zeros([BT, BK], dtype=tl.float32)
        b_dkd = tl.zeros([BT, BK], dtype=tl.float32)
        for i_v in range(0, tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            m_kv = m_k[:, None] & m_v[None, :]
            b_h = tl.load(p_h + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
            b_dh = tl.load(p_dh + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
            b_do = _operand(tl.load(p_do + o_vr[:, None] + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0),
                                DOT_PREC)
            b_vn = tl.load(p_vn + o_row[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
            b_du = tl.load(p_du + o_row[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.0)
            b_dqg += _dot(b_do, tl.trans(b_h), DOT_PREC)
            b_dw -= _dot(b_du, tl.trans(b_h), DOT_PREC)
            b_dkd += _dot(b_vn, tl.trans(b_dh), DOT_PREC)
            b_dgls += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1)
        b_q = tl.load(p_q + o_qk[:, None] + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32) * b_rq[:, None]
        b_k = tl.load(p_k + o_qk[:, None] + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32) * b_rk[:, None]
        b_dx = _dot(tl.trans(b_Tm), b_dw, TM_PREC)
        o_dqk = o_s[:, None] * K + o_k[None, :]
        b_x = b_k * (b_beta * b_eg)[:, None]
        b_dq = b_dqg * (b_eg * scale)[:, None]
        b_dk = b_dx * (b_beta * b_eg)[:, None] + b_dkd * b_ed[:, None]
        b_dbeta += tl.sum(b_dx * b_k, axis=1) * b_eg
        b_dgc += tl.sum(b_dx * b_x, axis=1) + tl.sum(b_dq * b_q, axis=1)
        b_tdr += tl.sum(b_dkd * b_k, axis=1)
        b_dq += _dot(b_Pq, b_k, DOT_PREC)
        b_dk += _dot(b_P, b_k, DOT_PREC) + _dot(tl.trans(b_Pq), b_q, DOT_PREC)
        if USE_L2:  # r (dk_n - k_n <k_n, dk_n>); dq_n's row dot is still summing
            b_sdq += tl.sum(b_q * b_dq, axis=1)
            b_dk = b_rk[:, None] * (b_dk - b_k * b_sdk[:, None])
        o_in = o_qk[:, None] + o_k[None, :]
        if G > 1 or USE_L2:
            tl.store(p_dq + o_dqk, b_dq.to(p_dq.dtype.element_ty), mask=m_tk)
        else:
            tl.store(p_dqo + o_in, b_dq.to(p_dqo.dtype.element_ty), mask=m_tk)
        if G > 1:
            tl.store(p_dk + o_dqk, b_dk.to(p_dk.dtype.element_ty), mask=m_tk)
        else:
            tl.store(p_dko + o_in, b_dk.to(p_dko.dtype.element_ty), mask=m_tk)
    b_td = b_tdr * b_ed
    b_dgl = tl.sum(b_dgls, axis=0) * tl.exp(b_gl) + tl.sum(b_td, axis=0)
    b_dgc += tl.where(m_last, b_dgl, 0.0) - b_td
    # g -> gc is a cumsum within the chunk: dg is the reverse cumsum of dgc
    b_dgc = tl.sum(b_dgc, axis=0) - tl.cumsum(b_dgc, axis=0) + b_dgc
    tl.store(p_dbeta + o_s, b_dbeta, mask=m_t)
    if USE_L2:
        tl.store(p_sdq + o_s, b_sdq, mask=m_t)
    tl.store(p_dg + o_s, b_dgc, mask=m_t)



@triton.jit
def gdn_chunk_bwd_wy_kernel(
    p_q,
    p_k,
    p_v,
    p_g,
    p_beta,
    p_Tm,
    p_M,
    p_A,
    p_h,
    p_dh,
    p_vn,
    p_du,
    p_do,
    p_dq,
    p_dk,
    p_dv,
    p_dg,
    p_dbeta,
    p_sdq,
    p_dqo,
    p_dko,
    T,
    Tp,
    NT,
    HK,
    HV,
    K,
    V,
    scale,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_L2: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TM_PREC: tl.constexpr,
    G: tl.constexpr,
):
    # The whole chunk-local backward per (chunk, value head): `_gdn_wy_head`. With one value
    # head per key head dq, dk end in q's dtype ([B, T, HK, K], like q and k); with G > 1 each
    # head's share stays in its slot (the l2norm backward is linear, so per head is exact) for
    # `gdn_group_sum_kernel`: in IDT, 16-bit under 16-bit dots (half the slots' round trip;
    # the G shares are then summed in fp32 and rounded once more to q's dtype). With the l2norm,
    # dq always takes that way: its row dots <q_n, dq_n> (p_sdq) are known after the last K tile.
    # (One program per key head walking its G heads, the inlined head body twice, read or wrote
    # out of bounds on the H200 with triton 3.6 at G = 2, and went unexplained.)
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // HV
    i_h = i_bh % HV
    _gdn_wy_head(
        p_q, p_k, p_v, p_g, p_beta, p_Tm, p_M, p_A, p_h, p_dh, p_vn, p_du, p_do, p_dq, p_dk, p_dv, p_dg, p_dbeta,
        p_sdq, p_dqo, p_dko, i_t, i_b, i_h, i_h // G, T, Tp, NT, HK, HV, K, V, scale, BT, BK, BV, USE_L2, DOT_PREC,
        TM_PREC, G)


@triton.jit
def gdn_group_sum_kernel(p_dq, p_dk, p_q, p_sdq, p_dqo, p_dko, R, K, G: tl.constexpr, BR: tl.constexpr,
                          BK: tl.constexpr, USE_L2: tl.constexpr, SUM_DK: tl.constexpr):
    # dqo[r] = sum_g dq[r * G + g] (rows r of [B, T, HK], value-head slots [B, T, HV] = [B, T, HK, G]),
    # with USE_L2 then the l2norm backward r (dq_n - q_n <q_n, dq_n>) on the whole row (BK >= K;
    # the row dots summed over the G heads from p_sdq); with SUM_DK the same sum for dk (already
    # through its l2norm backward). fp32 sums written in q's dtype.
    o_r = tl.program_id(0) * BR + tl.arange(0, BR).to(tl.int64)
    o_k = tl.arange(0, BK)
    m_r = o_r < R
    m = m_r[:, None] & (o_k < K)[None, :]
    b_q = tl.zeros([BR, BK], dtype=tl.float32)
    b_k = tl.zeros([BR, BK], dtype=tl.float32)
    b_s = tl.zeros([BR], dtype=tl.float32)
    for i_g in tl.static_range(G):
        o_in = (o_r * G + i_g)[:, None] * K + o_k[None, :]
        b_q += tl.load(p_dq + o_in, mask=m, other=0.0).to(tl.float32)
        if SUM_DK:
            b_k += tl.load(p_dk + o_in, mask=m, other=0.0).to(tl.float32)
        if USE_L2:
            b_s += tl.load(p_sdq + o_r * G + i_g, mask=m_r, other=0.0)
    o_out = o_r[:, None] * K + o_k[None, :]
    if USE_L2:
        b_x = tl.load(p_q + o_out, mask=m, other=0.0).to(tl.float32)
        b_rx = tl.rsqrt(tl.sum(b_x * b_x, axis=1) + 1e-6)
        b_q = b_rx[:, None] * (b_q - b_x * (b_rx * b_s)[:, None])
    tl.store(p_dqo + o_out, b_q.to(p_dqo.dtype.element_ty), mask=m)
    if SUM_DK:
        tl.store(p_dko + o_out, b_k.to(p_dko.dtype.element_ty), mask=m)



def _backward_state(do, dht, q, k, v, g, beta, initial_state, scale: float, use_l2: bool, saved=()):
    """The backward up to its chunk-local kernels (T > 0): the inputs checked and made contiguous,
    the forward's intermediates (`saved`, or the forward kernels run again), then the reverse state
    pass. Returns q, k, v, g, beta, do (contiguous), the dims (B, T, HK, K, HV, V, NT, Tp), the tiles
    `c`, the intermediates (w, kd, qg, Aqk, gl, Tm, M, S_c, v_new) and the state pass's dS
    [B, HV, NT, K, V], du [B, HV, Tp, V] (IDT) and d initial_state (fp32). `_backward` goes on
    from here."""
    _check(q, k, v, g, beta, initial_state)
    q, k, v, g, beta, do = (x.contiguous() for x in (q, k, v, g, beta, do))
    B, T, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev = q.device
    BT = CHUNK_SIZE
    NT = _cdiv(T, BT)
    Tp = NT * BT
    c = _tiles(K, V, q.dtype, dev, B * HV)
    if saved:
        w, kd, qg, A, gl, Tm, M, h, vn = saved
    else:
        w, u, kd, qg, A, gl, Tm, M = _prepare(q, k, v, g, beta, scale, use_l2, keep_tm=True, wide_u=True)
        # S_c and dS in IDT like the other dot operands (fla keeps them 16-bit too); the gate
        # gradient's elementwise sum of S_c * dS runs in fp32 on the loaded values
        h, vn, _ = _state_forward(w, u, kd, gl, initial_state, V, q.dtype)
    # dht None: no gradient on the final state (HAS_DHT False; the kernel reads dh0 in its place)
    dht = dht.float().contiguous() if dht is not None else None
    dh = _empty((B, HV, NT, K, V), c["IDT"], dev)
    du = _empty((B, HV, Tp, V), c["IDT"], dev)  # only ever a dot operand
    dh0 = _empty((B, HV, K, V), torch.float32, dev)
    gdn_state_bwd_kernel[(_cdiv(V, c["state_BV"]), B * HV)](
        do, A, kd, qg, w, gl, dht if dht is not None else dh0, dh, du, dh0, T, Tp, NT, HV, K, V,
        BT=BT, BK=c["BKF"], BV=c["state_BV"], STAGES=c["state_bwd_stages"], DOT_PREC=c["DOT_PREC"],
        HAS_DHT=dht is not None,
        num_warps=c["num_warps"], num_stages=c["num_stages"],
    )
    return (q, k, v, g, beta, do), (B, T, HK, K, HV, V, NT, Tp), c, (w, kd, qg, A, gl, Tm, M, h, vn), (dh, du, dh0)


def _backward(do, dht, q, k, v, g, beta, initial_state, scale: float, use_l2: bool, saved=()):
    """Gradients (dq, dk, dv, dg, dbeta, d initial_state), all in Triton (see the notes above).

    `saved`: the intermediates a training forward kept (`_forward(save=True)`: w, kd, qg, Aqk, gl,
    Tm = (I + A)^-1, M = A / beta, S_c, v_new). Without them (param `recompute`) the forward
    kernels run again first: prepare, which then also keeps Tm and M, and the state pass. Then the
    reverse state pass (both in `_backward_state`), and the chunk-local backward, which is
    then one kernel per (chunk, value head), then
    the sum over a key head's value heads when HV > HK (and dq's l2norm backward).
    """
    if q.shape[1] == 0:
        _check(q, k, v, g, beta, initial_state)
        zeros = [torch.zeros_like(x, memory_format=torch.contiguous_format) for x in (q, k, v, g, beta)]
        if initial_state is None:
            dh0 = q.new_empty((0,), dtype=torch.float32)
        else:
            dh0 = dht.float().clone() if dht is not None else initial_state.new_zeros(initial_state.shape, dtype=torch.float32)
        return (*zeros, dh0.to(initial_state.dtype) if initial_state is not None else dh0)
    (q, k, v, g, beta, do), (B, T, HK, K, HV, V, NT, Tp), c, (w, kd, qg, A, gl, Tm, M, h, vn), (dh, du, dh0) = \
        _backward_state(do, dht, q, k, v, g, beta, initial_state, scale, use_l2, saved)
    dev, BT = q.device, CHUNK_SIZE
    dv = _empty((B, T, HV, V), v.dtype, dev)
    dg = _empty(g.shape, torch.float32, dev)
    # in beta's dtype: the wy kernel stores each dbeta once (rounded as a cast after would, no cast launch)
    dbeta = _empty(beta.shape, beta.dtype, dev)
    dqo, dko = _empty(q.shape, q.dtype, dev), _empty(k.shape, k.dtype, dev)  # final dq, dk in q's dtype
    chunk = dict(BT=BT, BK=c["BK"], BV=c["bwd_BV"], USE_L2=use_l2, DOT_PREC=c["DOT_PREC"], TM_PREC=c["TM_PREC"],
                 num_warps=c["num_warps"], num_stages=c["num_stages"])
    G = HV // HK
    # per value head slots (IDT) when a key head's G value heads are summed after, and for dq when
    # the group kernel finishes its l2norm backward (with the row dots sdq [B, T, HV])
    slot = lambda: _empty((B, T, HV, K), c["IDT"], dev)  # noqa: E731
    dq = slot() if G > 1 or use_l2 else dqo
    dk = slot() if G > 1 else dko
    sdq = _empty((B, T, HV), torch.float32, dev) if use_l2 else dg  # (unwritten without the l2norm; fp32 as dg)
    gdn_chunk_bwd_wy_kernel[(NT, B * HV)](
        q, k, v, g, beta, Tm, M, A, h, dh, vn, du, do, dq, dk, dv, dg, dbeta, sdq, dqo, dko, T, Tp, NT, HK, HV,
        K, V, scale, G=G, **chunk)
    if G > 1 or use_l2:
        R = B * T * HK
        gdn_group_sum_kernel[(_cdiv(R, GROUP_SUM_ROWS),)](
            dq, dk, q, sdq, dqo, dko, R, K, G=G, BR=GROUP_SUM_ROWS, BK=c["BKF"], USE_L2=use_l2, SUM_DK=G > 1,
            num_warps=4)
    dh0 = dh0.to(initial_state.dtype) if initial_state is not None else dh0.new_empty((0,))
    return dqo, dko, dv, dg.to(g.dtype), dbeta, dh0


@torch.library.custom_op(OP_NAME, mutates_args=())
def gated_delta_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None, scale: float, use_qk_l2norm_in_kernel: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, g, beta, initial_state, scale, use_qk_l2norm_in_kernel)


@gated_delta_op.register_fake
def _(q, k, v, g, beta, initial_state, scale, use_qk_l2norm_in_kernel):
    _check(q, k, v, g, beta, initial_state)
    B, T, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    return v.new_empty((B, T, HV, V)), q.new_empty((B, HV, K, V), dtype=torch.float32)


@torch.library.custom_op(OP_NAME + "_train", mutates_args=())
def gated_delta_train_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None, scale: float, use_qk_l2norm_in_kernel: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward of a training step: o, the final state, then what the backward needs
    (`saved_shapes`), so that it does not re-run the forward's kernels."""
    return _forward(q, k, v, g, beta, initial_state, scale, use_qk_l2norm_in_kernel, save=True)


@gated_delta_train_op.register_fake
def _(q, k, v, g, beta, initial_state, scale, use_qk_l2norm_in_kernel):
    _check(q, k, v, g, beta, initial_state)
    B, T, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    saved = [q.new_empty(shape, dtype=dtype) for shape, dtype in saved_shapes(q, v)]
    return v.new_empty((B, T, HV, V)), q.new_empty((B, HV, K, V), dtype=torch.float32), *saved


@torch.library.custom_op(OP_NAME + "_bwd", mutates_args=())
def gated_delta_bwd_op(
    do: torch.Tensor, dht: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
    beta: torch.Tensor, initial_state: torch.Tensor | None, scale: float, use_qk_l2norm_in_kernel: bool,
    saved: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`dht` None: no gradient reached the final state (the reverse state pass starts from zero,
    HAS_DHT False: no zeros tensor filled for it)."""
    return _backward(do, dht, q, k, v, g, beta, initial_state, scale, use_qk_l2norm_in_kernel, saved)


@gated_delta_bwd_op.register_fake
def _(do, dht, q, k, v, g, beta, initial_state, scale, use_qk_l2norm_in_kernel, saved):
    _check(q, k, v, g, beta, initial_state)
    like = lambda x: torch.empty_like(x, memory_format=torch.contiguous_format)  # noqa: E731
    dh0 = like(initial_state) if initial_state is not None else q.new_empty((0,), dtype=torch.float32)
    return like(q), like(k), like(v), like(g), like(beta), dh0


def _setup_context(ctx, inputs, output):
    """Autograd of `gated_delta_op` (the backward re-runs the forward's kernels) and of
    `gated_delta_train_op` (the backward takes the intermediates it returned after o and the state)."""
    q, k, v, g, beta, initial_state, scale, use_l2 = inputs
    # no zero cotangents for outputs the loss does not use (the kept intermediates, an unused
    # final state): autograd would fill one per output, 7% of a B2 T4096 training step on the H200
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(*output[2:])
    ctx.save_for_backward(q, k, v, g, beta, initial_state, *output[2:])
    ctx.scale = scale
    ctx.use_l2 = use_l2


def _backward_rule(ctx, do, dht, *_):
    q, k, v, g, beta, initial_state, *saved = ctx.saved_tensors
    # dht None (the final state unused) goes to the op as None: the state pass starts from zero
    if do is None:
        do = torch.zeros_like(v)
    dq, dk, dv, dg, dbeta, dh0 = gated_delta_bwd_op(do, dht, q, k, v, g, beta, initial_state, ctx.scale, ctx.use_l2, saved)
    return dq, dk, dv, dg, dbeta, (dh0 if initial_state is not None else None), None, None


gated_delta_op.register_autograd(_backward_rule, setup_context=_setup_context)
gated_delta_train_op.register_autograd(_backward_rule, setup_context=_setup_context)


def _recurrent(q, k, v, g, beta, initial_state, scale: float, use_l2: bool):
    _check(q, k, v, g, beta, initial_state)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    B, T, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    c = _tiles(K, V, q.dtype, q.device)
    o = _empty((B, T, HV, V), v.dtype, v.device)
    ht = _empty((B, HV, K, V), torch.float32, v.device)
    h0 = initial_state.contiguous() if initial_state is not None else ht
    gdn_recurrent_fwd_kernel[(_cdiv(V, c["BV"]), B * HV)](
        q, k, v, g, beta, h0, o, ht, T, HK, HV, K, V, scale,
        BK=c["BKF"], BV=c["BV"], USE_L2=use_l2, HAS_H0=initial_state is not None,
        num_warps=c["num_warps"], num_stages=c["num_stages"],
    )
    return o, ht


@torch.library.custom_op(OP_NAME + "_recurrent", mutates_args=())
def gated_delta_recurrent_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None, scale: float, use_qk_l2norm_in_kernel: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _recurrent(q, k, v, g, beta, initial_state, scale, use_qk_l2norm_in_kernel)


@gated_delta_recurrent_op.register_fake
def _(q, k, v, g, beta, initial_state, scale, use_qk_l2norm_in_kernel):
    _check(q, k, v, g, beta, initial_state)
    B, T, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    return v.new_empty((B, T, HV, V)), q.new_empty((B, HV, K, V), dtype=torch.float32)


def gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = True,
):
    """Chunked gated delta rule (see the module docstring); returns (o [B, T, HV, V], final state or None).

    q, k [B, T, HK, K]; v [B, T, HV, V]; g [B, T, HV] log decay; beta [B, T, HV];
    scale defaults to K ** -0.5; initial_state [B, HV, K, V]. Differentiable in q, k, v, g, beta
    and initial_state.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    args = (q, k, v, g, beta, initial_state, scale, bool(use_qk_l2norm_in_kernel))
    if RECOMPUTE or not (torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in args[:6])):
        o, ht = gated_delta_op(*args)
    else:  # training: the forward keeps what the backward needs
        o, ht, *_ = gated_delta_train_op(*args)
    return o, (ht if output_final_state else None)


def gated_delta_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = True,
):
    """Token-by-token recurrence (decode step at T=1); same arguments and result as `gated_delta`, forward only."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    o, ht = gated_delta_recurrent_op(q, k, v, g, beta, initial_state, scale, bool(use_qk_l2norm_in_kernel))
    return o, (ht if output_final_state else None)


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = True,
):
    """Naive token-by-token recurrence in fp32 (same signature and result as `gated_delta`)."""
    _check(q, k, v, g, beta, initial_state)
    B, T, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else float(scale)
    q, k = (x.float().repeat_interleave(HV // HK, dim=2) for x in (q, k))
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    S = q.new_zeros((B, HV, K, V)) if initial_state is None else initial_state.float()
    outs = []
    for t in range(T):
        S = S * g[:, t].float().exp()[..., None, None]
        k_t = k[:, t]
        delta = (v[:, t].float() - (S * k_t[..., None]).sum(-2)) * beta[:, t].float()[..., None]
        S = S + k_t[..., None] * delta[..., None, :]
        outs.append((S * q[:, t, ..., None]).sum(-2) * scale)
    o = torch.stack(outs, dim=1) if outs else v.new_zeros((B, 0, HV, V), dtype=torch.float32)
    return o.to(v.dtype), (S if output_final_state else None)


naive_recurrent_gated_delta = reference
entry = gated_delta
OPS = (gated_delta_op, gated_delta_train_op, gated_delta_bwd_op, gated_delta_recurrent_op)


def op_samples(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=True) -> list:
    """(op, args) pairs exercising every custom op of this module, for torch.library.opcheck."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    l2 = bool(use_qk_l2norm_in_kernel)
    args = (q, k, v, g, beta, initial_state, scale, l2)
    plain = tuple(x.detach() if isinstance(x, torch.Tensor) else x for x in args)
    B, T, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    do = torch.randn(v.shape, dtype=v.dtype, device=v.device)
    dht = torch.randn((B, HV, K, V), dtype=torch.float32, device=v.device)
    with torch.no_grad():
        saved = list(gated_delta_train_op(*plain)[2:])
    return [(gated_delta_op, args), (gated_delta_train_op, args), (gated_delta_bwd_op, (do, dht, *plain, [])),
            (gated_delta_bwd_op, (do, dht, *plain, saved)), (gated_delta_bwd_op, (do, None, *plain, saved)),
            (gated_delta_recurrent_op, plain)]


def aot_specs(dtype: str = "bf16", size: int = 128) -> list[dict]:
    """Signatures and constexprs of every kernel, for ahead-of-time compilation at K = V = `size`."""
    # the mode `_dot_mode` picks on a GPU for these inputs: bf16/fp16 specs check the 16-bit path
    prec = _aot_dot_mode(dtype, _tiles(size, size)["DOT_PREC"])
    c = _tiles(size, size, mode=prec)
    ptr, f32 = "*" + dtype, "*fp32"
    tm_prec = "tf32" if prec in ("bf16", "fp16") and config_for(size).get("tm_dot", "input") == "tf32" else prec
    # w, kd, qg, v_new, du, S_c, dS, Aqk and M (the backward's re-run of prepare keeps u fp32)
    ist = "*" + dtype if dtype in ("bf16", "fp16") else f32
    tm = "*" + tm_prec if tm_prec in ("bf16", "fp16") else f32  # the kept Tm (TM_DT)
    nw = c["num_warps"]
    ns = c["num_stages"]
    fused = config_for(size).get("fwd_o", "split") == "fused"
    rows = fused and config_for(size).get("fused_kq", "stored") == "rows"
    # the prepare as a training forward launches it (u in IDT, Tm and M kept)
    prep = {"kernel": "gdn_prepare_fwd_kernel",
            "signature": {"p_q": ptr, "p_k": ptr, "p_v": ptr, "p_g": "*fp32", "p_beta": ptr, "p_w": ist, "p_u": ist,
                          "p_kd": ist, "p_qg": ist, "p_A": ist, "p_gl": f32, "p_Tm": tm, "p_M": ist, "T": "i32", "Tp": "i32",
                          "NT": "i32", "HK": "i32", "HV": "i32", "K": "i32", "V": "i32", "scale": "fp32",
                          "BT": "constexpr", "BK": "constexpr", "BV": "constexpr", "USE_L2": "constexpr",
                          "KEEP_TM": "constexpr", "DOT_PREC": "constexpr", "TM_PREC": "constexpr", "BC": "constexpr",
                          "INV_PREC": "constexpr", "PIPE": "constexpr",
                          "STAGES": "constexpr", "ROWS": "constexpr"},
            "constexprs": {"BT": CHUNK_SIZE, "BK": c["prep_BK"], "BV": c["BV"], "USE_L2": True, "KEEP_TM": True,
                           "DOT_PREC": prec, "TM_PREC": tm_prec, "BC": INV_BLOCK, "INV_PREC": _inv_prec(config_for(size), prec),
                           # the config's prepare order (`prep_pipe`)
                           "PIPE": config_for(size).get("prep_pipe", "off") == "on", "STAGES": c["prep_stages"], "ROWS": False},
            "num_warps": config_for(size).get("prep_warps") or nw, "num_stages": c["prep_stages"]}
    # the state pass as the training forward launches it (u in IDT, S_c and v_new kept)
    state = {"kernel": "gdn_state_fwd_kernel",
             "signature": {"p_w": ist, "p_u": ist, "p_kd": ist, "p_gl": f32, "p_h0": f32, "p_h": ist, "p_vn": ist,
                           "p_ht": f32, "p_qg": ist, "p_A": ist, "p_o": ptr, "p_q": ptr, "p_k": ptr, "NT": "i32", "Tp": "i32", "K": "i32", "V": "i32", "T": "i32", "HV": "i32", "HK": "i32", "BT": "constexpr",
                           "BK": "constexpr", "BV": "constexpr", "HAS_H0": "constexpr", "STAGES": "constexpr",
                           "DOT_PREC": "constexpr", "FUSE_O": "constexpr", "KEEP": "constexpr", "ROWS": "constexpr"},
             "constexprs": {"BT": CHUNK_SIZE, "BK": c["BKF"], "BV": c["state_BV"], "HAS_H0": True,
                            "STAGES": c["state_stages"], "DOT_PREC": prec,
                            # `fwd_o` "fused": o here too
                            "FUSE_O": fused, "KEEP": True, "ROWS": False},
             "num_warps": nw, "num_stages": ns}

    def variant(spec: dict, signature: dict, **constexprs) -> dict:
        """`spec` with the argument types in `signature` and the constexprs in `constexprs` replaced."""
        return {**spec, "signature": {**spec["signature"], **signature},
                "constexprs": {**spec["constexprs"], **constexprs}}

    # the forward without training: the prepare keeps no Tm and M (their pointers are Aqk's); with
    # `fwd_o` "fused" the state pass keeps nothing (S_c's and v_new's pointers are the fp32 final
    # state); with `fused_kq` "rows" kd and qg are fp32 row factors and the state pass
    # scales the raw q and k rows
    kq = {"p_kd": f32, "p_qg": f32} if rows else {}
    # the prepare's register caps as `_prepare` launches it (a spec's `maxnreg` reaches the AOT build)
    if _prep_maxnreg(config_for(size), False):
        prep = {**prep, "maxnreg": _prep_maxnreg(config_for(size), False)}
    no_grad = [variant(prep, {"p_Tm": ist, **kq}, KEEP_TM=False, ROWS=rows)]
    if _prep_maxnreg(config_for(size), rows):
        no_grad[0] = {**no_grad[0], "maxnreg": _prep_maxnreg(config_for(size), rows)}
    if fused:
        no_grad.append(variant(state, {"p_h": f32, "p_vn": f32, **kq}, KEEP=False, ROWS=rows))
    # the recomputing backward (param `recompute`) launches the prepare and the state pass with u fp32
    # (`_prepare(wide_u=True)`), its state pass keeping S_c and v_new: their own specs where u's
    # type differs
    wide_u = [variant(prep, {"p_u": f32}),
              variant(state, {"p_u": f32}, FUSE_O=False, KEEP=True)] if ist != f32 else []

    state_bwd = {"kernel": "gdn_state_bwd_kernel",
                 "signature": {"p_do": ptr, "p_A": ist, "p_kd": ist, "p_qg": ist, "p_w": ist, "p_gl": f32, "p_dht": f32,
                               "p_dh": ist, "p_du": ist, "p_dh0": f32, "T": "i32", "Tp": "i32", "NT": "i32", "HV": "i32",
                               "K": "i32", "V": "i32", "BT": "constexpr", "BK": "constexpr", "BV": "constexpr",
                               "STAGES": "constexpr", "DOT_PREC": "constexpr", "HAS_DHT": "constexpr"},
                 # HAS_DHT False: the training step's (no gradient on the final state); `state_bwd_dht` the other
                 "constexprs": {"BT": CHUNK_SIZE, "BK": c["BKF"], "BV": c["state_BV"], "STAGES": c["state_bwd_stages"],
                                "DOT_PREC": prec, "HAS_DHT": False},
                 "num_warps": nw, "num_stages": ns}
    # the reverse state pass with a gradient on the final state (`dht` given; the training step above
    # has none)
    state_bwd_dht = variant(state_bwd, {}, HAS_DHT=True)

    return [
        prep,
        state,
        *wide_u,
        *no_grad,
        {"kernel": "gdn_output_fwd_kernel",
         "signature": {"p_qg": ist, "p_h": ist, "p_A": ist, "p_vn": ist, "p_o": ptr, "T": "i32",
                       "Tp": "i32", "NT": "i32", "HV": "i32", "K": "i32", "V": "i32", "BT": "constexpr",
                       "BK": "constexpr", "BV": "constexpr", "DOT_PREC": "constexpr"},
         "constexprs": {"BT": CHUNK_SIZE, "BK": c["BKF"], "BV": c["BV"], "DOT_PREC": prec},
         "num_warps": nw, "num_stages": ns},
        state_bwd,
        state_bwd_dht,
        {"kernel": "gdn_chunk_bwd_wy_kernel",
         "signature": {"p_q": ptr, "p_k": ptr, "p_v": ptr, "p_g": "*fp32", "p_beta": ptr, "p_Tm": tm, "p_M": ist,
                       "p_A": ist, "p_h": ist, "p_dh": ist, "p_vn": ist, "p_du": ist, "p_do": ptr,
                       # dq, dk: KDA's fp32 scratch; GDN's per value head slots (IDT)
                       "p_dq": ist, "p_dk": ist, "p_dv": ptr,
                       # dbeta: GDN's in beta's dtype (stored once), KDA's fp32
                       "p_dg": f32, "p_dbeta": ptr,
                       "p_sdq": f32, "p_dqo": ptr, "p_dko": ptr,
                       "T": "i32", "Tp": "i32", "NT": "i32", "HK": "i32", "HV": "i32", "K": "i32", "V": "i32",
                       "scale": "fp32", "BT": "constexpr", "BK": "constexpr", "BV": "constexpr", "USE_L2": "constexpr",
                       "DOT_PREC": "constexpr", "TM_PREC": "constexpr", "G": "constexpr"},
         "constexprs": {"BT": CHUNK_SIZE, "BK": c["BK"], "BV": c["bwd_BV"], "USE_L2": True, "DOT_PREC": prec,
                        "TM_PREC": tm_prec, "G": 2},  # G 2: Qwen3-Next's two value heads per key head
         "num_warps": nw, "num_stages": ns},
        {"kernel": "gdn_group_sum_kernel",
         "signature": {"p_dq": ist, "p_dk": ist, "p_q": ptr, "p_sdq": f32, "p_dqo": ptr, "p_dko": ptr, "R": "i32",
                       "K": "i32", "G": "constexpr", "BR": "constexpr", "BK": "constexpr", "USE_L2": "constexpr",
                       "SUM_DK": "constexpr"},
         "constexprs": {"G": 2, "BR": GROUP_SUM_ROWS, "BK": c["BKF"], "USE_L2": True, "SUM_DK": True}, "num_warps": 4},
        {"kernel": "gdn_recurrent_fwd_kernel",
         "signature": {"p_q": ptr, "p_k": ptr, "p_v": ptr, "p_g": "*fp32", "p_beta": ptr, "p_h0": f32, "p_o": ptr,
                       "p_ht": f32, "T": "i32", "HK": "i32", "HV": "i32", "K": "i32", "V": "i32", "scale": "fp32",
                       "BK": "constexpr", "BV": "constexpr", "USE_L2": "constexpr", "HAS_H0": "constexpr"},
         "constexprs": {"BK": c["BKF"], "BV": c["BV"], "USE_L2": True, "HAS_H0": True}, "num_warps": nw, "num_stages": ns},
    ]
