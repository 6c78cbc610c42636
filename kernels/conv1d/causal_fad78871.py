# Rendered by onboard from kernel_templates/conv1d/conv1d.py.j2 (template version 3). Do not edit.
# family: conv1d  variant: causal
# params: {"activation": null, "kernel_size": 4}
"""causal_conv1d: causal depthwise 1-D convolution over time, kernel size W=4.

    a[b, t, c] = bias[c] + sum_{w < W} x[b, t - (W - 1) + w, c] * weight[c, w]    (x[b, <0, c] = 0)
    y = a

This equals nn.Conv1d(C, C, W, groups=C, padding=W - 1) on x.transpose(1, 2), cut to the first
T steps (the token mixer of Mamba / gated delta-net blocks).

Shapes: x [B, T, C] (channels last: the layout of hidden states, no transposes), weight [C, W]
(nn.Conv1d's [C, 1, W] is accepted by `causal_conv1d`), bias [C] or None; y [B, T, C].
The weight and bias gradients are
reduced as fp32 partial sums per program, then summed. Kernels load fp32/fp16/bf16 and compute in
fp32.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

TEMPLATE = 'conv1d/conv1d.py.j2'
TEMPLATE_VERSION = 3
FAMILY = 'conv1d'
VARIANT = 'causal'
PARAMS = {'activation': None, 'kernel_size': 4}
OP_NAME = "onboard::conv1d_causal_fad78871"
TUNING_SPACE = {'BLOCK_C': [32, 64, 128, 256], 'BLOCK_T': [8, 16, 32, 64, 128], 'BWD_BLOCK_T': [8, 16, 32, 64, 128], 'BWD_PER_SM': [2, 4, 8, 16], 'num_warps': [1, 2, 4, 8]}
DEFAULT_CONFIG = {'BLOCK_C': 128, 'BLOCK_T': 16, 'BWD_BLOCK_T': 16, 'BWD_PER_SM': 4, 'num_warps': 4}
# Buckets over C (channels).
SHAPE_BUCKETS = [{'config': {'BLOCK_C': 64}, 'dim': 'C', 'hi': 1024, 'lo': 1, 'name': 'c_le_1k'}, {'config': {'BWD_BLOCK_T': 64}, 'dim': 'C', 'hi': 2147483647, 'lo': 1025, 'name': 'c_big'}]
KERNEL_SIZE = 4

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


@triton.jit
def _preact(p_x, p_w, p_bias, o_bx, o_s, o_c, m_c, T, C, W: tl.constexpr, HAS_BIAS: tl.constexpr,
            BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """a at times o_s [BLOCK_T] for channels o_c [BLOCK_C] (fp32; rows with o_s outside [0, T) are junk)."""
    b_a = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        b_a += tl.load(p_bias + o_c, mask=m_c, other=0.0).to(tl.float32)[None, :]
    for i_w in tl.static_range(W):
        o_src = o_s - (W - 1) + i_w
        m_x = ((o_src >= 0) & (o_src < T))[:, None] & m_c[None, :]
        b_x = tl.load(p_x + o_bx + o_src[:, None] * C + o_c[None, :], mask=m_x, other=0.0).to(tl.float32)
        b_w = tl.load(p_w + o_c * W + i_w, mask=m_c, other=0.0).to(tl.float32)
        b_a += b_x * b_w[None, :]
    return b_a


@triton.jit
def conv1d_fwd_kernel(
    p_x,
    p_w,
    p_bias,
    p_y,
    T,
    C,
    W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    i_b, i_t, i_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_bx = i_b.to(tl.int64) * T * C
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m_c = o_c < C
    b_a = _preact(p_x, p_w, p_bias, o_bx, o_t, o_c, m_c, T, C, W, HAS_BIAS, BLOCK_T, BLOCK_C)
    m_tc = (o_t < T)[:, None] & m_c[None, :]
    tl.store(p_y + o_bx + o_t[:, None] * C + o_c[None, :], b_a.to(p_y.dtype.element_ty), mask=m_tc)


@triton.jit
def conv1d_bwd_kernel(
    p_x,
    p_w,
    p_bias,
    p_dy,
    p_dx,
    p_dw,
    p_db,
    T,
    C,
    NUM_T_BLOCKS,
    NUM_T_PROGRAMS,
    W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    # Grid (B, NUM_T_PROGRAMS, C blocks); each program strides over time blocks and writes one
    # fp32 partial of dweight [C, W] and dbias [C] at row (b * NUM_T_PROGRAMS + program). p_dy is
    # the pre-activation's gradient (dy itself).
    i_b, i_tp, i_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_bx = i_b.to(tl.int64) * T * C
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m_c = o_c < C
    o_w = tl.arange(0, BLOCK_W)
    b_dw = tl.zeros([BLOCK_C, BLOCK_W], dtype=tl.float32)
    b_db = tl.zeros([BLOCK_C], dtype=tl.float32)
    for i_t in range(i_tp, NUM_T_BLOCKS, NUM_T_PROGRAMS):
        o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
        m_tc = (o_t < T)[:, None] & m_c[None, :]
        b_dx = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for i_w in tl.static_range(W):
            # output time o_t + (W - 1) - i_w reads x[o_t] through weight[:, i_w]
            o_o = o_t + (W - 1) - i_w
            m_o = (o_o < T)[:, None] & m_c[None, :]
            b_da = tl.load(p_dy + o_bx + o_o[:, None] * C + o_c[None, :], mask=m_o, other=0.0).to(tl.float32)
            b_wc = tl.load(p_w + o_c * W + i_w, mask=m_c, other=0.0).to(tl.float32)
            b_dx += b_da * b_wc[None, :]
            if i_w == W - 1:
                # o_o == o_t: this tile's own da feeds dweight and dbias
                b_db += tl.sum(b_da, axis=0)
                for i_v in tl.static_range(W):
                    o_src = o_t - (W - 1) + i_v
                    m_x = ((o_src >= 0) & (o_src < T))[:, None] & m_c[None, :]
                    b_x = tl.load(p_x + o_bx + o_src[:, None] * C + o_c[None, :], mask=m_x, other=0.0).to(tl.float32)
                    b_part = tl.sum(b_da * b_x, axis=0)
                    b_dw += tl.where(o_w[None, :] == i_v, b_part[:, None], 0.0)
        tl.store(p_dx + o_bx + o_t[:, None] * C + o_c[None, :], b_dx.to(p_dx.dtype.element_ty), mask=m_tc)
    o_p = (i_b * NUM_T_PROGRAMS + i_tp).to(tl.int64)
    tl.store(p_dw + o_p * C * W + o_c[:, None] * W + o_w[None, :], b_dw, mask=m_c[:, None] & (o_w < W)[None, :])
    tl.store(p_db + o_p * C + o_c, b_db, mask=m_c)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    shapes = f"x {tuple(x.shape)}, weight {tuple(weight.shape)}, bias {None if bias is None else tuple(bias.shape)}"
    if x.dim() != 3:
        raise ValueError(f"causal_conv1d: x must be [B, T, C]; got {shapes}")
    C = x.shape[-1]
    if weight.shape != (C, KERNEL_SIZE):
        raise ValueError(f"causal_conv1d: weight must be [C, {KERNEL_SIZE}] (rendered kernel_size); got {shapes}")
    if bias is not None and bias.shape != (C,):
        raise ValueError(f"causal_conv1d: bias must be [C] or None; got {shapes}")


def _forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    _check(x, weight, bias)
    B, T, C = x.shape
    x = x.contiguous()
    y = _empty((B, T, C), x.dtype, x.device)
    if B * T * C == 0:
        return y
    cfg = config_for(C)
    grid = (B, triton.cdiv(T, cfg["BLOCK_T"]), triton.cdiv(C, cfg["BLOCK_C"]))
    conv1d_fwd_kernel[grid](
        x, weight.contiguous(), x if bias is None else bias.contiguous(), y, T, C,
        W=KERNEL_SIZE, HAS_BIAS=bias is not None, BLOCK_T=cfg["BLOCK_T"], BLOCK_C=cfg["BLOCK_C"],
        num_warps=cfg["num_warps"],
    )
    return y


def _backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]):
    _check(x, weight, bias)
    B, T, C = x.shape
    x = x.contiguous()
    cfg = config_for(C)
    # the backward's own time tile and grid-stride width (BWD_*): its programs loop over time
    # blocks, so their size and count set its memory parallelism apart from the forward's
    num_t_blocks = triton.cdiv(T, cfg["BWD_BLOCK_T"])
    num_c_blocks = triton.cdiv(C, cfg["BLOCK_C"])
    programs = _num_programs(B * num_t_blocks * num_c_blocks, x.device, per_sm=cfg["BWD_PER_SM"])
    num_t_programs = max(1, min(num_t_blocks, programs // max(1, B * num_c_blocks)))
    dx = _empty((B, T, C), x.dtype, x.device)
    dw_partial = _empty((B * num_t_programs, C, KERNEL_SIZE), torch.float32, x.device)
    db_partial = _empty((B * num_t_programs, C), torch.float32, x.device)
    if B * T * C == 0:
        return dx, torch.zeros_like(weight), torch.zeros(C, dtype=x.dtype if bias is None else bias.dtype, device=x.device)
    dy = dy.contiguous()
    conv1d_bwd_kernel[(B, num_t_programs, num_c_blocks)](
        x, weight.contiguous(), x if bias is None else bias.contiguous(), dy, dx, dw_partial, db_partial,
        T, C, num_t_blocks, num_t_programs,
        W=KERNEL_SIZE, HAS_BIAS=bias is not None, BLOCK_T=cfg["BWD_BLOCK_T"], BLOCK_C=cfg["BLOCK_C"],
        BLOCK_W=triton.next_power_of_2(KERNEL_SIZE), num_warps=cfg["num_warps"],
    )
    db = db_partial.sum(0).to(x.dtype if bias is None else bias.dtype)
    return dx, dw_partial.sum(0).to(weight.dtype), db


@torch.library.custom_op(OP_NAME, mutates_args=())
def causal_conv1d_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return _forward(x, weight, bias)


@causal_conv1d_op.register_fake
def _(x, weight, bias):
    _check(x, weight, bias)
    return x.new_empty(x.shape)


@torch.library.custom_op(OP_NAME + "_bwd", mutates_args=())
def causal_conv1d_bwd_op(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias); dbias is computed (as da summed) even when bias is None."""
    return _backward(dy, x, weight, bias)


@causal_conv1d_bwd_op.register_fake
def _(dy, x, weight, bias):
    _check(x, weight, bias)
    return x.new_empty(x.shape), weight.new_empty(weight.shape), (x if bias is None else bias).new_empty((x.shape[-1],))


class CausalConv1dFunction(torch.autograd.Function):
    """Autograd wiring of the op: forward and backward both run the Triton kernels."""

    @staticmethod
    def forward(x, weight, bias):
        return causal_conv1d_op(x, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias = inputs
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias = ctx.saved_tensors
        dx, dw, db = causal_conv1d_bwd_op(dy, x, weight, bias)
        return dx, dw, (db if ctx.has_bias else None)


causal_conv1d_op.register_autograd(CausalConv1dFunction.backward, setup_context=CausalConv1dFunction.setup_context)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = causal depthwise conv(x, weight) + bias; x [B, T, C], weight [C, W] (or [C, 1, W]), bias [C] or None."""
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight.squeeze(1)
    return causal_conv1d_op(x, weight, bias)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Pure-PyTorch causal_conv1d in fp32 (same signature), cast back to x's dtype."""
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight.squeeze(1)
    _check(x, weight, bias)
    T, C = x.shape[1], x.shape[2]
    xf = x.float().transpose(1, 2)
    a = torch.nn.functional.conv1d(
        xf, weight.float().unsqueeze(1), None if bias is None else bias.float(), padding=KERNEL_SIZE - 1, groups=C
    )[..., :T]
    return a.transpose(1, 2).to(x.dtype)


entry = causal_conv1d
OPS = (causal_conv1d_op, causal_conv1d_bwd_op)


def op_samples(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> list:
    """(op, args) pairs exercising every custom op of this module, for torch.library.opcheck."""
    dy = torch.randn_like(x.detach())
    plain = (x.detach(), weight.detach(), None if bias is None else bias.detach())
    return [(causal_conv1d_op, (x, weight, bias)), (causal_conv1d_bwd_op, (dy, *plain))]


def aot_specs(dtype: str = "bf16", size: int = 4096) -> list[dict]:
    """Signatures and constexprs of every kernel (with bias), for AOT compilation at C=`size`."""
    cfg = config_for(size)
    consts = {"W": KERNEL_SIZE, "HAS_BIAS": True, "BLOCK_T": cfg["BLOCK_T"], "BLOCK_C": cfg["BLOCK_C"]}
    ptr = "*" + dtype
    tail = {"W": "constexpr", "HAS_BIAS": "constexpr", "BLOCK_T": "constexpr", "BLOCK_C": "constexpr"}
    return [
        {"kernel": "conv1d_fwd_kernel",
         "signature": {"p_x": ptr, "p_w": ptr, "p_bias": ptr, "p_y": ptr, "T": "i32", "C": "i32", **tail},
         "constexprs": consts, "num_warps": cfg["num_warps"]},
        {"kernel": "conv1d_bwd_kernel",
         "signature": {"p_x": ptr, "p_w": ptr, "p_bias": ptr, "p_dy": ptr, "p_dx": ptr,
                       "p_dw": "*fp32",
                       "p_db": "*fp32", "T": "i32", "C": "i32", "NUM_T_BLOCKS": "i32", "NUM_T_PROGRAMS": "i32", **tail,
                       "BLOCK_W": "constexpr"},
         "constexprs": {**consts, "BLOCK_T": cfg["BWD_BLOCK_T"], "BLOCK_W": triton.next_power_of_2(KERNEL_SIZE)},
         "num_warps": cfg["num_warps"]},
    ]
