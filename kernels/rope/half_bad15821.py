# Rendered by onboard from kernel_templates/rope/rope.py.j2 (template version 1). Do not edit.
# family: rope  variant: half
# params: {"head_dim": null, "rotary_dim": 32}
"""rope: rotary position embedding of q and k, half-split (rotate_half) layout.

    out[..., :R] = x[..., :R] * cos + rot(x[..., :R]) * sin,    out[..., R:] = x[..., R:]
    rot(x) = cat(-x[R/2:], x[:R/2])                        (cos/sin hold each frequency twice)

R = cos.shape[-1] is the rotary dim (R < D: partial rotary, the rest passes through).
Backward applies the transpose: dx = dout * cos + rot^T(dout * sin), i.e. rotation by -theta.
Gradients to cos/sin (rare: they come from buffers) go through the PyTorch reference.

Shapes: q [B, T, H, D], k [B, T, Hk, D] (any strides with a unit last stride, so the
transformers layout [B, H, T, D] is passed as q.transpose(1, 2) without a copy); cos, sin
[T, R] or [B, T, R]. Outputs have the strides of q / k when those are dense, else contiguous.
Kernels load fp32/fp16/bf16 and compute in fp32.
"""

import torch
import triton
import triton.language as tl

TEMPLATE = 'rope/rope.py.j2'
TEMPLATE_VERSION = 1
FAMILY = 'rope'
VARIANT = 'half'
PARAMS = {'head_dim': None, 'rotary_dim': 32}
OP_NAME = "onboard::rope_half_bad15821"
TUNING_SPACE = {'BLOCK_H': [1, 2, 4, 8, 16, 32, 64], 'BLOCK_T': [1, 2, 4, 8, 16, 32], 'num_warps': [1, 2, 4, 8]}
DEFAULT_CONFIG = {'BLOCK_H': 8, 'BLOCK_T': 4, 'num_warps': 4}
# Buckets over D (the head dim).
SHAPE_BUCKETS = [{'config': {'BLOCK_T': 8}, 'dim': 'D', 'hi': 64, 'lo': 1, 'name': 'd_le_64'}, {'config': {}, 'dim': 'D', 'hi': 128, 'lo': 65, 'name': 'd_le_128'}, {'config': {'BLOCK_T': 2}, 'dim': 'D', 'hi': 256, 'lo': 129, 'name': 'd_le_256'}, {'config': {'BLOCK_H': 4, 'BLOCK_T': 1}, 'dim': 'D', 'hi': 1024, 'lo': 257, 'name': 'd_big'}]
HEAD_DIM = None
ROTARY_DIM = 32

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
def rope_kernel(
    p_x,
    p_o,
    p_cos,
    p_sin,
    NT,
    T,
    H,
    R2,
    DP,
    stride_xb,
    stride_xt,
    stride_xh,
    stride_ob,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ct,
    BACKWARD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    # One program: BLOCK_T tokens (flattened b*T + t) x BLOCK_H heads, all R/2 rotation pairs,
    # plus the DP pass-through columns. BACKWARD applies the transposed rotation.
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    o_bt = i_t * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    o_b = o_bt // T
    o_t = o_bt % T
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    o_r = tl.arange(0, BLOCK_R)
    m_th = (o_bt < NT)[:, None, None] & (o_h < H)[None, :, None]
    m_r = m_th & (o_r < R2)[None, None, :]
    o_1 = o_r
    o_2 = o_r + R2
    o_x = (o_b * stride_xb + o_t * stride_xt)[:, None, None] + (o_h * stride_xh)[None, :, None]
    o_o = (o_b * stride_ob + o_t * stride_ot)[:, None, None] + (o_h * stride_oh)[None, :, None]
    o_c = (o_b * stride_cb + o_t * stride_ct)[:, None, None]
    m_c = (o_bt < NT)[:, None, None] & (o_r < R2)[None, None, :]
    b_c1 = tl.load(p_cos + o_c + o_1[None, None, :], mask=m_c, other=0.0).to(tl.float32)
    b_c2 = tl.load(p_cos + o_c + o_2[None, None, :], mask=m_c, other=0.0).to(tl.float32)
    b_s1 = tl.load(p_sin + o_c + o_1[None, None, :], mask=m_c, other=0.0).to(tl.float32)
    b_s2 = tl.load(p_sin + o_c + o_2[None, None, :], mask=m_c, other=0.0).to(tl.float32)
    b_x1 = tl.load(p_x + o_x + o_1[None, None, :], mask=m_r, other=0.0).to(tl.float32)
    b_x2 = tl.load(p_x + o_x + o_2[None, None, :], mask=m_r, other=0.0).to(tl.float32)
    if BACKWARD:
        b_o1 = b_x1 * b_c1 + b_x2 * b_s2
        b_o2 = b_x2 * b_c2 - b_x1 * b_s1
    else:
        b_o1 = b_x1 * b_c1 - b_x2 * b_s1
        b_o2 = b_x2 * b_c2 + b_x1 * b_s2
    tl.store(p_o + o_o + o_1[None, None, :], b_o1.to(p_o.dtype.element_ty), mask=m_r)
    tl.store(p_o + o_o + o_2[None, None, :], b_o2.to(p_o.dtype.element_ty), mask=m_r)
    if BLOCK_P > 0:
        o_p = 2 * R2 + tl.arange(0, BLOCK_P)
        m_p = m_th & (tl.arange(0, BLOCK_P) < DP)[None, None, :]
        b_p = tl.load(p_x + o_x + o_p[None, None, :], mask=m_p, other=0.0)
        tl.store(p_o + o_o + o_p[None, None, :], b_p.to(p_o.dtype.element_ty), mask=m_p)


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}"
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"rope: q must be [B, T, H, D] and k [B, T, Hk, D]; got {shapes}")
    B, T, _, D = q.shape
    R = cos.shape[-1]
    if cos.shape != sin.shape or cos.shape not in ((T, R), (B, T, R)):
        raise ValueError(f"rope: cos and sin must both be [T, R] or [B, T, R]; got {shapes}")
    if R % 2 != 0 or R == 0 or R > D:
        raise ValueError(f"rope: rotary dim R=cos.shape[-1] must be even and in (0, D]; got {shapes}")
    if HEAD_DIM is not None and D != HEAD_DIM:
        raise ValueError(f"rope: rendered for head_dim={HEAD_DIM}; got {shapes}")
    if ROTARY_DIM is not None and R != ROTARY_DIM:
        raise ValueError(f"rope: rendered for rotary_dim={ROTARY_DIM}; got {shapes}")


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _like(t: torch.Tensor) -> torch.Tensor:
    """An output with t's strides when t is dense (as empty_like keeps them), else contiguous."""
    if _POISON_OUTPUTS:
        return torch.full_like(t, float("nan"))
    return torch.empty_like(t)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    x = _unit_last(x)
    out = _like(x)
    if out.stride(-1) != 1:
        out = out.contiguous()
    B, T, H, D = x.shape
    R = cos.shape[-1]
    NT = B * T
    if NT == 0 or H == 0:
        return out
    cos, sin = cos.contiguous(), sin.contiguous()
    stride_cb = cos.stride(0) if cos.dim() == 3 else 0
    cfg = config_for(D)
    block_h = min(cfg["BLOCK_H"], triton.next_power_of_2(H))
    grid = (triton.cdiv(NT, cfg["BLOCK_T"]), triton.cdiv(H, block_h))
    rope_kernel[grid](
        x, out, cos, sin, NT, T, H, R // 2, D - R,
        x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1), out.stride(2),
        stride_cb, cos.stride(-2),
        BACKWARD=backward, BLOCK_T=cfg["BLOCK_T"], BLOCK_H=block_h,
        BLOCK_R=triton.next_power_of_2(R // 2), BLOCK_P=0 if D == R else triton.next_power_of_2(D - R),
        num_warps=cfg["num_warps"],
    )
    return out


@torch.library.custom_op(OP_NAME, mutates_args=())
def rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check(q, k, cos, sin)
    return _rotate(q, cos, sin, False), _rotate(k, cos, sin, False)


@rope_op.register_fake
def _(q, k, cos, sin):
    _check(q, k, cos, sin)
    return torch.empty_like(_unit_last(q)), torch.empty_like(_unit_last(k))


@torch.library.custom_op(OP_NAME + "_bwd", mutates_args=())
def rope_bwd_op(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check(dq, dk, cos, sin)
    return _rotate(dq, cos, sin, True), _rotate(dk, cos, sin, True)


@rope_bwd_op.register_fake
def _(dq, dk, cos, sin):
    _check(dq, dk, cos, sin)
    return torch.empty_like(_unit_last(dq)), torch.empty_like(_unit_last(dk))


class RopeFunction(torch.autograd.Function):
    """Autograd wiring of the op: forward and backward both run the Triton kernel."""

    @staticmethod
    def forward(q, k, cos, sin):
        return rope_op(q, k, cos, sin)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, cos, sin = inputs
        ctx.table_grad = cos.requires_grad or sin.requires_grad
        # q and k are kept only when cos/sin need a gradient.
        ctx.save_for_backward(cos, sin, *((q, k) if ctx.table_grad else ()))

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        cos, sin = ctx.saved_tensors[:2]
        dq, dk = rope_bwd_op(dq_out, dk_out, cos, sin)
        dcos = dsin = None
        if ctx.table_grad:
            q, k = ctx.saved_tensors[2:]
            with torch.enable_grad():
                c, s = cos.detach().requires_grad_(), sin.detach().requires_grad_()
                qo, ko = reference(q.detach(), k.detach(), c, s)
                dcos, dsin = torch.autograd.grad((qo, ko), (c, s), (dq_out, dk_out))
        return dq, dk, dcos, dsin


rope_op.register_autograd(RopeFunction.backward, setup_context=RopeFunction.setup_context)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) rotated by cos/sin (rotate_half); q [B, T, H, D], k [B, T, Hk, D], cos/sin [T, R] or [B, T, R]."""
    return rope_op(q, k, cos, sin)


def _rot(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-PyTorch rope in fp32 (same signature as `rope`), cast back to the input dtypes."""
    _check(q, k, cos, sin)
    R = cos.shape[-1]
    # [T, R] / [B, T, R] -> broadcast over heads: [.., T, 1, R]
    c, s = cos.float().unsqueeze(-2), sin.float().unsqueeze(-2)

    def one(x):
        xr, xp = x[..., :R].float(), x[..., R:]
        return torch.cat(((xr * c + _rot(xr) * s).to(x.dtype), xp), dim=-1)

    return one(q), one(k)


entry = rope
OPS = (rope_op, rope_bwd_op)


def op_samples(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> list:
    """(op, args) pairs exercising every custom op of this module, for torch.library.opcheck."""
    dq, dk = torch.randn_like(q.detach()), torch.randn_like(k.detach())
    return [(rope_op, (q, k, cos, sin)), (rope_bwd_op, (dq, dk, cos.detach(), sin.detach()))]


def aot_specs(dtype: str = "bf16", size: int = 128) -> list[dict]:
    """Signature and constexprs of the kernel (both directions), for AOT compilation at D=`size`."""
    cfg = config_for(size)
    R = ROTARY_DIM or size
    ptr = "*" + dtype
    ints = ["NT", "T", "H", "R2", "DP", "stride_xb", "stride_xt", "stride_xh", "stride_ob", "stride_ot",
            "stride_oh", "stride_cb", "stride_ct"]
    sig = {"p_x": ptr, "p_o": ptr, "p_cos": "*fp32", "p_sin": "*fp32", **{n: "i64" if n.startswith("stride") else "i32" for n in ints},
           "BACKWARD": "constexpr", "BLOCK_T": "constexpr", "BLOCK_H": "constexpr", "BLOCK_R": "constexpr", "BLOCK_P": "constexpr"}
    specs = []
    for backward in (False, True):
        consts = {"BACKWARD": backward, "BLOCK_T": cfg["BLOCK_T"], "BLOCK_H": cfg["BLOCK_H"],
                  "BLOCK_R": triton.next_power_of_2(R // 2), "BLOCK_P": 0 if size == R else triton.next_power_of_2(size - R)}
        specs.append({"kernel": "rope_kernel", "signature": sig, "constexprs": consts, "num_warps": cfg["num_warps"]})
    return specs
