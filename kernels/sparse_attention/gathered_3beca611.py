# Rendered by onboard from kernel_templates/sparse_attention/sparse_attention.py.j2 (template version 11). Do not edit.
# family: sparse_attention  variant: gathered
# params: {"d_v": 512, "indexer_relu": true, "layout": "mha", "topk": 2048}
"""sparse_attention: attention of each query over only its top-k selected key/value positions.

    o[b, t, h] = sum_j p_j v[b, i_j, g(h)],  p = softmax_j(scale * q[b, t, h] . k[b, i_j, g(h)])

    i_j = indices[b, t, j] (j < K; entries < 0 or >= S are padding and skipped); g(h) = h // (H / HK).
    An attention sink adds exp(sink[h]) to the softmax denominator (a learned per-head logit).
    A row with no valid index (and no sink) gives o = 0 (the dense reference gives NaN there).

Shapes: q [B, T, H, D_QK], k [B, S, HK, D_QK], v [B, S, HK, D_V],
indices int32 [B, T, K] (unique per row), sink [H] or None; o [B, T, H, D_V] in q's dtype.
One program serves one query and BLOCK_H heads of one KV group (the M dimension of every dot),
so each gathered KV block is read once per head block; the head blocks of one query are
neighbouring programs, so a group wider than BLOCK_H re-reads the block from L2. Dots run in
the inputs' 16-bit dtype on a GPU (`_dot_mode`: bf16/fp16 operands, fp32 accumulation; the
probabilities and dS are rounded to it as operands, as in flash attention) and in fp32 in the
interpreter. Online softmax in fp32 forward; the backward recomputes the probabilities from
the saved log-sum-exp, writes dq per program and scatters dk/dv summed over its head block
with relaxed fp32 reductions, one per gathered element and head block (a position selected by
many queries receives many adds).
"""

from typing import Optional

import torch
import triton
import triton.language as tl

TEMPLATE = 'sparse_attention/sparse_attention.py.j2'
TEMPLATE_VERSION = 11
FAMILY = 'sparse_attention'
VARIANT = 'gathered'
PARAMS = {'d_v': 512, 'indexer_relu': True, 'layout': 'mha', 'topk': 2048}
OP_NAME = "onboard::sparse_attention_gathered_3beca611"
TUNING_SPACE = {'BLOCK_H': [16, 32, 64, 128], 'BLOCK_H_BWD': [16, 32, 64, 128], 'BLOCK_H_DKV': [16, 32, 64, 128], 'BLOCK_H_DQ': [0, 16, 32, 64, 128], 'BLOCK_K': [16, 32, 64, 128], 'BLOCK_K_BWD': [16, 32, 64, 128], 'BLOCK_K_DKV': [16, 32, 64, 128], 'BLOCK_K_DQ': [0, 16, 32, 64, 128], 'BLOCK_SEL': [16, 32, 64, 128, 256, 512, 1024, 2048, 4096], 'BLOCK_T': [16, 32, 64, 128], 'BWD_SPLIT': [0, 1], 'BWD_STAGES': [1, 2, 3], 'FWD_DV_SPLIT': [1, 2], 'FWD_EARLY_GATHER': [0, 1], 'FWD_ROW_END': [0, 1], 'FWD_SPLIT_SCORES': [0, 1], 'FWD_STAGES': [1, 2, 3, 4], 'FWD_TWO_PASS': [0, 1], 'SEL_RADIX': [2, 4, 8], 'dot_precision': ['tf32', 'ieee'], 'num_warps': [1, 2, 4, 8]}
DEFAULT_CONFIG = {'BLOCK_H': 16, 'BLOCK_H_BWD': 16, 'BLOCK_H_DKV': 32, 'BLOCK_H_DQ': 0, 'BLOCK_K': 32, 'BLOCK_K_BWD': 32, 'BLOCK_K_DKV': 64, 'BLOCK_K_DQ': 0, 'BLOCK_SEL': 1024, 'BLOCK_T': 64, 'BWD_SPLIT': 0, 'BWD_STAGES': 1, 'FWD_DV_SPLIT': 1, 'FWD_EARLY_GATHER': 0, 'FWD_ROW_END': 0, 'FWD_SPLIT_SCORES': 0, 'FWD_STAGES': 3, 'FWD_TWO_PASS': 0, 'SEL_RADIX': 4, 'dot_precision': 'tf32', 'num_warps': 4}
# Buckets over the q/k head dim: it decides the register tiles (BLOCK_H x D) of a program.
SHAPE_BUCKETS = [{'config': {'BLOCK_K': 64, 'BLOCK_K_BWD': 64}, 'dim': 'D_QK', 'hi': 64, 'lo': 0, 'name': 'd_le_64'}, {'config': {'BLOCK_K': 32}, 'dim': 'D_QK', 'hi': 128, 'lo': 65, 'name': 'd_le_128'}, {'config': {'BLOCK_K': 32, 'num_warps': 8}, 'dim': 'D_QK', 'hi': 256, 'lo': 129, 'name': 'd_le_256'}, {'config': {'BLOCK_H': 64, 'BLOCK_H_BWD': 32, 'BLOCK_H_DKV': 32, 'BLOCK_H_DQ': 64, 'BLOCK_K': 64, 'BLOCK_K_BWD': 16, 'BLOCK_K_DKV': 64, 'BLOCK_K_DQ': 32, 'BWD_SPLIT': 1, 'BWD_STAGES': 2, 'FWD_EARLY_GATHER': 1, 'FWD_ROW_END': 1, 'FWD_SPLIT_SCORES': 1, 'FWD_STAGES': 3, 'num_warps': 8}, 'dim': 'D_QK', 'hi': 1024, 'lo': 257, 'name': 'd_le_1024'}]

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


def _pow2(n: int, lo: int = 16) -> int:
    # tl.dot needs every tile dim >= 16 on the GPU
    return max(lo, triton.next_power_of_2(max(int(n), 1)))


def _mode(cfg: dict, *tensors: torch.Tensor) -> str:
    """The `_dot` mode of one call: the inputs' own 16-bit dot when they share a 16-bit dtype on
    a GPU (see `_dot_mode`), else the config's fp32 precision (mixed dtypes are not rounded)."""
    dtypes = {t.dtype for t in tensors}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    return _dot_mode(cfg["dot_precision"], dtype, tensors[0].device)


@triton.jit
def _exp(x, BASE2: tl.constexpr):
    if BASE2:
        return tl.math.exp2(x)
    else:
        return tl.exp(x)


@triton.jit
def _softmax_step(b_s, m_k, b_m, b_l, BASE2: tl.constexpr, DOT_MODE: tl.constexpr):
    """One key block of the online softmax: scaled scores b_s [BLOCK_H, BLOCK_K] (masked here by
    m_k), running max b_m and sum b_l -> (new max, the factor alpha that rescales the old sum
    and output, new sum, the probabilities as the value dot's operand). BASE2: scores and max
    in log2 units (exp2)."""
    b_s = tl.where(m_k[None, :], b_s, float("-inf"))
    b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
    # a row with nothing valid yet keeps m = -inf; shift by 0 then, not by -inf (NaN)
    b_shift = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
    b_p = _exp(b_s - b_shift[:, None], BASE2)
    b_alpha = _exp(b_m - b_shift, BASE2)
    b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
    return b_m_new, b_alpha, b_l, _cast_operand(b_p, DOT_MODE)


@triton.jit
def sparse_attention_fwd_kernel(
    p_q, p_k, p_v, p_i, p_end, p_sink, p_o, p_lse,
    T, S, H, HK, K, scale,
    D_QK: tl.constexpr,
    D_A: tl.constexpr,
    D_R: tl.constexpr,
    D_V: tl.constexpr,
    SHARED_KV: tl.constexpr,
    HAS_SINK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_DA: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DOT_MODE: tl.constexpr,
    ROW_END: tl.constexpr,
    SPLIT_SCORES: tl.constexpr,
    EARLY_GATHER: tl.constexpr,
):
    # "a" = the key columns dotted with q's first D_A columns (all of D_QK, or with a shared
    # latent its first D_V columns, which double as v); "r" = the latent's D_R rope columns.
    # Axis 0 walks the head blocks of one query before the next query: the programs that read
    # the same gathered rows run together and share them in L2.
    i_th, i_b = tl.program_id(0), tl.program_id(1)
    G = H // HK
    NHB = tl.cdiv(G, BLOCK_H)
    i_t, i_hb = i_th // (HK * NHB), i_th % (HK * NHB)
    i_g = i_hb // NHB
    o_h = (i_hb % NHB) * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < G
    o_hq = (i_g * G + o_h).to(tl.int64)
    o_qrow = (i_b * T + i_t).to(tl.int64) * H + o_hq
    o_da = tl.arange(0, BLOCK_DA)
    m_da = o_da < D_A
    o_dv = tl.arange(0, BLOCK_DV)
    m_dv = o_dv < D_V
    b_qa = _operand(tl.load(p_q + o_qrow[:, None] * D_QK + o_da[None, :], mask=m_h[:, None] & m_da[None, :],
                   other=0.0), DOT_MODE)
    if SHARED_KV:
        o_dr = tl.arange(0, BLOCK_DR)
        m_dr = o_dr < D_R
        b_qr = _operand(tl.load(p_q + o_qrow[:, None] * D_QK + D_A + o_dr[None, :],
                       mask=m_h[:, None] & m_dr[None, :], other=0.0), DOT_MODE)
    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    p_irow = p_i + (i_b * T + i_t).to(tl.int64) * K
    # ROW_END: stop after the row's last valid index (p_end); the blocks past it hold padding
    # only, whose probabilities are 0 and leave m, l and acc as they are
    n_k = K
    if ROW_END:
        n_k = tl.load(p_end + i_b * T + i_t)
    # SPLIT_SCORES: the softmax in base 2, the scale folded into log2(e) (m and the scores are
    # then in log2 units; lse is converted back), and the score block split over the warp groups:
    # Triton gives a dot whose result reaches another dot (here the scores -> p -> the value
    # dot) all warps along M, which for BLOCK_H 64 at 8 warps is both warp groups computing the
    # same [64, BLOCK_K] scores (twice the score MMAs, each m64n{BLOCK_K/2} reading all of q from
    # shared memory). The softmax below runs inside a branch that is always taken: the scores'
    # uses end in its region, the value dot uses the branch's results, so the score dots no
    # longer see a chained dot and their warps split the key columns ([4, 2]): each warp group
    # its own half, the row max crossing the two through shared memory. The two score dots are
    # scaled and summed rather than accumulated one into the other (that is a chain too).
    # EARLY_GATHER: the value dot (with the output's rescale) runs inside a branch that is always
    # taken. Triton's loop scheduler puts the next block's gathered loads after the key block's
    # compute; an `if` whose results reach no other op it schedules goes to the loop's end, after
    # them. So the gather of block j + 1 is issued right after block j's score dots and overlaps
    # block j's softmax and value dot, not the value dot alone (block j - 1's value dot, which read
    # the buffer it fills, was waited inside its branch; without the option it is left in flight
    # to the next block's score dots). The mask's index load is no longer pipelined (a plain load);
    # with the mask applied before the softmax's branch it is issued before the block's gather
    # wait and score dots, which hide its latency (inside the branch it came right before the
    # softmax).
    qk_scale = scale
    if SPLIT_SCORES:
        qk_scale = scale * 1.4426950408889634
    for i_k in range(0, n_k, BLOCK_K):
        o_k = i_k + tl.arange(0, BLOCK_K)
        b_idx = tl.load(p_irow + o_k, mask=o_k < K, other=-1)
        m_k = (b_idx >= 0) & (b_idx < S)
        o_krow = ((i_b * S + tl.where(m_k, b_idx, 0)).to(tl.int64) * HK + i_g)
        b_ka = _operand(tl.load(p_k + o_krow[:, None] * D_QK + o_da[None, :], mask=m_k[:, None] & m_da[None, :],
                       other=0.0), DOT_MODE)
        if SHARED_KV:
            b_kr = _operand(tl.load(p_k + o_krow[:, None] * D_QK + D_A + o_dr[None, :],
                           mask=m_k[:, None] & m_dr[None, :], other=0.0), DOT_MODE)
            b_v = b_ka
        else:
            b_v = _operand(tl.load(p_v + o_krow[:, None] * D_V + o_dv[None, :], mask=m_k[:, None] & m_dv[None, :],
                          other=0.0), DOT_MODE)
        if SPLIT_SCORES:
            b_s = _dot(b_qa, tl.trans(b_ka), DOT_MODE) * qk_scale
            if SHARED_KV:
                b_s += _dot(b_qr, tl.trans(b_kr), DOT_MODE) * qk_scale
            m_s = m_k
            if EARLY_GATHER:
                b_s = tl.where(m_k[None, :], b_s, float("-inf"))
                m_s = o_k >= 0  # all true: masked above
            if i_k < n_k:  # always (the loop's own bound): the region that ends the scores' uses
                b_m_new, b_alpha, b_l, b_p = _softmax_step(b_s, m_s, b_m, b_l, True, DOT_MODE)
            else:  # never runs; it only gives the branch's results their types
                b_m_new, b_alpha, b_p = b_m, tl.full([BLOCK_H], 1.0, tl.float32), _cast_operand(b_s, DOT_MODE)
        else:
            b_s = _dot(b_qa, tl.trans(b_ka), DOT_MODE)
            if SHARED_KV:
                b_s += _dot(b_qr, tl.trans(b_kr), DOT_MODE)
            b_m_new, b_alpha, b_l, b_p = _softmax_step(b_s * qk_scale, m_k, b_m, b_l, False, DOT_MODE)
        if EARLY_GATHER:
            if i_k < n_k + BLOCK_K:  # always; not the bound above (Triton would merge the branches)
                b_acc = b_acc * b_alpha[:, None] + _dot(b_p, b_v, DOT_MODE)
        else:
            b_acc = b_acc * b_alpha[:, None] + _dot(b_p, b_v, DOT_MODE)
        b_m = b_m_new
    if HAS_SINK:
        b_sink = tl.load(p_sink + o_hq, mask=m_h, other=0.0).to(tl.float32)
        if SPLIT_SCORES:
            b_sink = b_sink * 1.4426950408889634
        b_m_new = tl.maximum(b_m, b_sink)
        b_alpha = _exp(b_m - b_m_new, SPLIT_SCORES)
        b_l = b_l * b_alpha + _exp(b_sink - b_m_new, SPLIT_SCORES)
        b_acc = b_acc * b_alpha[:, None]
        b_m = b_m_new
    b_o = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]
    tl.store(p_o + o_qrow[:, None] * D_V + o_dv[None, :], b_o.to(p_o.dtype.element_ty),
             mask=m_h[:, None] & m_dv[None, :])
    if SPLIT_SCORES:  # m in log2 units
        b_m = b_m * 0.6931471805599453
    tl.store(p_lse + o_qrow, b_m + tl.log(b_l), mask=m_h)


@triton.jit
def sparse_attention_bwd_kernel(
    p_q, p_k, p_v, p_i, p_do, p_lse, p_delta, p_dq, p_dk, p_dv,
    T, S, H, HK, K, scale,
    D_QK: tl.constexpr,
    D_A: tl.constexpr,
    D_R: tl.constexpr,
    D_V: tl.constexpr,
    SHARED_KV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_DA: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    DOT_MODE: tl.constexpr,
):
    # dq per program; dk/dv (or the shared latent's gradient, in p_dk) by fp32 atomic adds.
    # Axis 0 walks the head blocks of one query before the next query: the programs that read
    # the same gathered rows run together and share them in L2.
    i_th, i_b = tl.program_id(0), tl.program_id(1)
    G = H // HK
    NHB = tl.cdiv(G, BLOCK_H)
    i_t, i_hb = i_th // (HK * NHB), i_th % (HK * NHB)
    i_g = i_hb // NHB
    o_h = (i_hb % NHB) * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < G
    o_hq = (i_g * G + o_h).to(tl.int64)
    o_qrow = (i_b * T + i_t).to(tl.int64) * H + o_hq
    o_da = tl.arange(0, BLOCK_DA)
    m_da = o_da < D_A
    o_dv = tl.arange(0, BLOCK_DV)
    m_dv = o_dv < D_V
    b_qa = _operand(tl.load(p_q + o_qrow[:, None] * D_QK + o_da[None, :], mask=m_h[:, None] & m_da[None, :],
                   other=0.0), DOT_MODE)
    if SHARED_KV:
        o_dr = tl.arange(0, BLOCK_DR)
        m_dr = o_dr < D_R
        b_qr = _operand(tl.load(p_q + o_qrow[:, None] * D_QK + D_A + o_dr[None, :],
                       mask=m_h[:, None] & m_dr[None, :], other=0.0), DOT_MODE)
        b_dqr = tl.zeros([BLOCK_H, BLOCK_DR], dtype=tl.float32)
    b_do = _operand(tl.load(p_do + o_qrow[:, None] * D_V + o_dv[None, :], mask=m_h[:, None] & m_dv[None, :],
                   other=0.0), DOT_MODE)
    b_lse = tl.load(p_lse + o_qrow, mask=m_h, other=0.0)
    b_lse = tl.where(b_lse == float("-inf"), 0.0, b_lse)
    b_delta = tl.load(p_delta + o_qrow, mask=m_h, other=0.0)
    b_dqa = tl.zeros([BLOCK_H, BLOCK_DA], dtype=tl.float32)
    p_irow = p_i + (i_b * T + i_t).to(tl.int64) * K
    for i_k in range(0, K, BLOCK_K):
        o_k = i_k + tl.arange(0, BLOCK_K)
        b_idx = tl.load(p_irow + o_k, mask=o_k < K, other=-1)
        m_k = (b_idx >= 0) & (b_idx < S)
        o_krow = ((i_b * S + tl.where(m_k, b_idx, 0)).to(tl.int64) * HK + i_g)
        b_ka = _operand(tl.load(p_k + o_krow[:, None] * D_QK + o_da[None, :], mask=m_k[:, None] & m_da[None, :],
                       other=0.0), DOT_MODE)
        b_s = _dot(b_qa, tl.trans(b_ka), DOT_MODE)
        if SHARED_KV:
            b_kr = _operand(tl.load(p_k + o_krow[:, None] * D_QK + D_A + o_dr[None, :],
                           mask=m_k[:, None] & m_dr[None, :], other=0.0), DOT_MODE)
            b_s += _dot(b_qr, tl.trans(b_kr), DOT_MODE)
            b_v = b_ka
        else:
            b_v = _operand(tl.load(p_v + o_krow[:, None] * D_V + o_dv[None, :], mask=m_k[:, None] & m_dv[None, :],
                          other=0.0), DOT_MODE)
        m_hk = m_h[:, None] & m_k[None, :]
        b_p = tl.where(m_hk, tl.exp(b_s * scale - b_lse[:, None]), 0.0)
        b_dp = _dot(b_do, tl.trans(b_v), DOT_MODE)
        b_ds = b_p * (b_dp - b_delta[:, None]) * scale
        b_dqa += _dot(b_ds, b_ka, DOT_MODE)
        b_dka = _dot(tl.trans(b_ds), b_qa, DOT_MODE)
        b_dv = _dot(tl.trans(b_p), b_do, DOT_MODE)
        if SHARED_KV:
            b_dqr += _dot(b_ds, b_kr, DOT_MODE)
            # v is the latent's first D_V columns: its gradient lands on the same columns as dk's
            tl.atomic_add(p_dk + o_krow[:, None] * D_QK + o_da[None, :], b_dka + b_dv,
                          mask=m_k[:, None] & m_da[None, :], sem="relaxed")
            tl.atomic_add(p_dk + o_krow[:, None] * D_QK + D_A + o_dr[None, :],
                          _dot(tl.trans(b_ds), b_qr, DOT_MODE),
                          mask=m_k[:, None] & m_dr[None, :], sem="relaxed")
        else:
            tl.atomic_add(p_dk + o_krow[:, None] * D_QK + o_da[None, :], b_dka,
                          mask=m_k[:, None] & m_da[None, :], sem="relaxed")
            tl.atomic_add(p_dv + o_krow[:, None] * D_V + o_dv[None, :], b_dv,
                          mask=m_k[:, None] & m_dv[None, :], sem="relaxed")
    tl.store(p_dq + o_qrow[:, None] * D_QK + o_da[None, :], b_dqa.to(p_dq.dtype.element_ty),
             mask=m_h[:, None] & m_da[None, :])
    if SHARED_KV:
        tl.store(p_dq + o_qrow[:, None] * D_QK + D_A + o_dr[None, :], b_dqr.to(p_dq.dtype.element_ty),
                 mask=m_h[:, None] & m_dr[None, :])


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, sink: Optional[torch.Tensor]) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or indices.dim() != 3:
        raise ValueError(f"sparse_attention: need q [B, T, H, D_QK], k [B, S, HK, D], indices [B, T, K]; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, indices {tuple(indices.shape)}")
    B, T, H, D_QK = q.shape
    if k.shape[0] != B or k.shape[-1] != D_QK or v.shape[:3] != k.shape[:3] or H % k.shape[2]:
        raise ValueError(f"sparse_attention: k {tuple(k.shape)} / v {tuple(v.shape)} do not fit q {tuple(q.shape)} "
                         "(same B and D_QK, HK dividing H)")
    if indices.shape[:2] != (B, T) or indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sparse_attention: indices {tuple(indices.shape)} {indices.dtype} must be int "
                         f"[B, T, K] for q {tuple(q.shape)}")
    if sink is not None and tuple(sink.shape) != (H,):
        raise ValueError(f"sparse_attention: sink {tuple(sink.shape)} must be [H] = ({H},)")


def _blocks(H: int, HK: int, D_QK: int, D_V: int, mode: str, backward: bool) -> dict:
    cfg = config_for(D_QK)
    G = H // HK
    shared = False
    d_a = D_V if shared else D_QK
    bh, bk = (cfg["BLOCK_H_BWD"], cfg["BLOCK_K_BWD"]) if backward else (cfg["BLOCK_H"], cfg["BLOCK_K"])
    # a head block never wider than the group (>= 16: the dot's M)
    return {"BLOCK_H": min(bh, _pow2(G)), "BLOCK_K": bk, "BLOCK_DA": _pow2(d_a),
            "BLOCK_DR": _pow2(D_QK - D_V) if shared else 16, "BLOCK_DV": _pow2(D_V),
            "DOT_MODE": mode, "num_warps": cfg["num_warps"]}


def _row_ends(indices: torch.Tensor, S: int) -> torch.Tensor:
    """int32 [B, T]: 1 + the last slot of each row that holds a valid index (0: none); the
    forward's ROW_END stops there (the slots past it are padding: early rows, -1 filled)."""
    K = indices.shape[-1]
    valid = (indices >= 0) & (indices < S)
    slot = torch.arange(1, K + 1, device=indices.device, dtype=torch.int32)
    return torch.where(valid, slot, 0).amax(-1).to(torch.int32).contiguous()


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, sink: Optional[torch.Tensor], scale: float):
    _check(q, k, v, indices, sink)
    k, v = k.contiguous(), v.contiguous()
    D_V_ = v.shape[-1]
    B, T, H, D_QK = q.shape
    S, HK, K = k.shape[1], k.shape[2], indices.shape[-1]
    o = _empty((B, T, H, D_V_), q.dtype, q.device)
    lse = _empty((B, T, H), torch.float32, q.device)
    if o.numel():
        cfg = config_for(D_QK)
        blk = _blocks(H, HK, D_QK, D_V_, _mode(cfg, q, k, v), backward=False)
        stages = cfg.get("FWD_STAGES", 3)
        idx = indices.to(torch.int32).contiguous()
        row_end = bool(cfg.get("FWD_ROW_END", 0)) and K > 0
        ends = _row_ends(idx, S) if row_end else idx  # an unread placeholder without ROW_END
        grid = (T * HK * triton.cdiv(H // HK, blk["BLOCK_H"]), B)
        sparse_attention_fwd_kernel[grid](
            q.contiguous(), k, v, idx, ends,
            lse if sink is None else sink.contiguous(), o, lse,
            T, S, H, HK, K, scale, D_QK=D_QK, D_A=D_V_ if False else D_QK,
            D_R=D_QK - D_V_ if False else 0, D_V=D_V_, SHARED_KV=False,
            HAS_SINK=sink is not None, ROW_END=row_end, SPLIT_SCORES=bool(cfg.get("FWD_SPLIT_SCORES", 0)),
            EARLY_GATHER=bool(cfg.get("FWD_EARLY_GATHER", 0)), num_stages=stages, **blk,
        )
    return o, lse


def _backward(do, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, sink, o, lse, scale):
    _check(q, k, v, indices, sink)
    k, v = k.contiguous(), v.contiguous()
    D_V_ = v.shape[-1]
    B, T, H, D_QK = q.shape
    S, HK, K = k.shape[1], k.shape[2], indices.shape[-1]
    delta = (do.float() * o.float()).sum(-1).contiguous()  # [B, T, H]
    dq = _empty(q.shape, q.dtype, q.device)
    # accumulators: must start at zero, never poisoned
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = dk if False else torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    cfg = config_for(D_QK)
    blk = _blocks(H, HK, D_QK, D_V_, _mode(cfg, q, k, v, do), backward=True)
    if dq.numel():
        grid = (T * HK * triton.cdiv(H // HK, blk["BLOCK_H"]), B)
        sparse_attention_bwd_kernel[grid](
            q.contiguous(), k, v, indices.to(torch.int32).contiguous(), do.contiguous(), lse.contiguous(),
            delta, dq, dk, dv, T, S, H, HK, K, scale, D_QK=D_QK, D_A=D_V_ if False else D_QK,
            D_R=D_QK - D_V_ if False else 0, D_V=D_V_, SHARED_KV=False, **blk,
        )
    if sink is not None:
        # d sink_h = -sum_{b,t} p_sink * delta, p_sink = exp(sink_h - lse)
        dsink = -(torch.exp(sink.float() - lse) * delta).sum((0, 1)).to(sink.dtype)
    else:
        dsink = q.new_empty((0,))
    return dq, dk.to(k.dtype), dv.to(v.dtype), dsink


@torch.library.custom_op(OP_NAME, mutates_args=())
def sparse_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, sink: Optional[torch.Tensor], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, indices, sink, scale)


@sparse_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, sink: Optional[torch.Tensor], scale: float):
    _check(q, k, v, indices, sink)
    B, T, H, _ = q.shape
    d_v = v.shape[-1]
    return q.new_empty((B, T, H, d_v)), q.new_empty((B, T, H), dtype=torch.float32)


@torch.library.custom_op(OP_NAME + "_bwd", mutates_args=())
def sparse_attention_bwd_op(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, sink: Optional[torch.Tensor], o: torch.Tensor, lse: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(do, q, k, v, indices, sink, o, lse, scale)


@sparse_attention_bwd_op.register_fake
def _(do, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, sink, o, lse, scale):
    _check(q, k, v, indices, sink)
    dsink = torch.empty_like(sink) if sink is not None else q.new_empty((0,))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsink


def _setup_context(ctx, inputs, output):
    q, k, v, indices, sink, scale = inputs
    o, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.has_sink = sink is not None
    ctx.save_for_backward(q, k, v, indices, sink, o, lse)
    ctx.scale = scale


def _backward_rule(ctx, do, _dlse):
    q, k, v, indices, sink, o, lse = ctx.saved_tensors
    dq, dk, dv, dsink = sparse_attention_bwd_op(do, q, k, v, indices, sink, o, lse, ctx.scale)
    return dq, dk, dv, None, dsink if ctx.has_sink else None, None


sparse_attention_op.register_autograd(_backward_rule, setup_context=_setup_context)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, sink: Optional[torch.Tensor] = None, scale: Optional[float] = None) -> torch.Tensor:
    """o [B, T, H, D_V]: softmax attention of each query over its selected positions (module doc).

    scale defaults to D_QK ** -0.5; sink [H] is a per-head logit in the denominator.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return sparse_attention_op(q, k, v, indices, sink, scale)[0]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, sink: Optional[torch.Tensor] = None, scale: Optional[float] = None) -> torch.Tensor:
    """Dense attention with -inf outside the selected set (transformers' DeepseekV32 eager path),
    fp32, cast back to q's dtype; a sink is a last softmax column that is then dropped."""
    _check(q, k, v, indices, sink)
    B, T, H, D_QK = q.shape
    S, HK = k.shape[1], k.shape[2]
    scale = D_QK ** -0.5 if scale is None else float(scale)
    idx = indices.long()
    valid = (idx >= 0) & (idx < S)
    keep = torch.zeros(B, T, S + 1, dtype=torch.bool, device=q.device)
    keep = keep.scatter(2, torch.where(valid, idx, S), True)[..., :S]
    kf = k.float().repeat_interleave(H // HK, dim=2)
    vf = v.float().repeat_interleave(H // HK, dim=2)
    logits = torch.einsum("bthd,bshd->bhts", q.float(), kf) * scale
    logits = logits.masked_fill(~keep[:, None], float("-inf"))
    if sink is not None:
        col = sink.float().view(1, H, 1, 1).expand(B, H, T, 1)
        probs = torch.softmax(torch.cat([logits, col], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(logits, dim=-1)
    return torch.einsum("bhts,bshd->bthd", probs, vf).to(q.dtype)


entry = sparse_attention
OPS = (sparse_attention_op, sparse_attention_bwd_op)


def op_samples(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, sink: Optional[torch.Tensor] = None, scale: Optional[float] = None) -> list:
    """(op, args) pairs exercising every custom op of this module, for torch.library.opcheck."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    plain = [t.detach() if isinstance(t, torch.Tensor) else t for t in (q, k, v, indices, sink)]
    o, lse = (t.detach() for t in _forward(*plain, scale))
    do = torch.randn_like(o)
    return [(sparse_attention_op, (q, k, v, indices, sink, scale)), (sparse_attention_bwd_op, (do, *plain, o, lse, scale))]


def aot_specs(dtype: str = "bf16", size: int = 128) -> list[dict]:
    """Signatures and constexprs of both kernels, for ahead-of-time compilation at D_QK=`size`
    (D_V=D_QK, 16 query heads per KV head);
    bf16/fp16 pointers compile the 16-bit dot the GPU runs for such inputs."""
    ptr = "*" + dtype
    d_v = size
    mode = _aot_dot_mode(dtype, config_for(size)["dot_precision"])
    d_a, d_r = (d_v, size - d_v) if False else (size, 0)
    dims = {"D_QK": size, "D_A": d_a, "D_R": d_r, "D_V": d_v, "SHARED_KV": False}
    scalars = {"T": "i32", "S": "i32", "H": "i32", "HK": "i32", "K": "i32", "scale": "fp32"}
    fwd = {"p_q": ptr, "p_k": ptr, "p_v": ptr, "p_i": "*i32", "p_end": "*i32", "p_sink": "*fp32", "p_o": ptr,
           "p_lse": "*fp32"}
    bwd = {"p_q": ptr, "p_k": ptr, "p_v": ptr, "p_i": "*i32", "p_do": ptr, "p_lse": "*fp32",
           "p_delta": "*fp32", "p_dq": ptr, "p_dk": "*fp32", "p_dv": "*fp32"}
    specs = []
    stages = config_for(size).get("FWD_STAGES", 3)
    row_end = bool(config_for(size).get("FWD_ROW_END", 0))
    split_scores = bool(config_for(size).get("FWD_SPLIT_SCORES", 0))
    early_gather = bool(config_for(size).get("FWD_EARLY_GATHER", 0))
    for name, args, extra, backward in (("fwd", fwd, {"HAS_SINK": True, "ROW_END": row_end,
                                                      "SPLIT_SCORES": split_scores,
                                                      "EARLY_GATHER": early_gather}, False),
                                        ("bwd", bwd, {}, True)):
        blk = _blocks(16, 1, size, d_v, mode, backward)
        warps = blk.pop("num_warps")
        consts = {**dims, **extra, **blk}
        specs.append({"kernel": "sparse_attention_" + name + "_kernel",
                      "signature": {**args, **scalars, **{k: "constexpr" for k in consts}},
                      "constexprs": consts, "num_warps": warps, "num_stages": 1 if backward else stages})
    return specs
