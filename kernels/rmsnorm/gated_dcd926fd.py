# Rendered by onboard from kernel_templates/rmsnorm/rmsnorm.py.j2 (template version 3). Do not edit.
# family: rmsnorm  variant: gated
# params: {"activation": "silu", "eps": 1e-06, "has_weight": true, "unit_offset": false}
"""rmsnorm_gated: gated RMSNorm (norm, then weight, then SiLU gate).

    y = x * rsqrt(mean(x^2) + eps) * w * silu(gate)

Shapes: x [..., D] (flattened to [N, D]), gate [..., D] like x, weight [D]; y like x.
Kernels load any of fp32/fp16/bf16 and compute in fp32; y has x's dtype, the weight
gradient has the weight's dtype. The weight gradient is reduced across rows as fp32 partial
sums per program (a grid-stride loop over row blocks, `programs_per_sm` programs per SM), then
summed column-wise by a second small kernel in a fixed order.
"""

import torch
import triton
import triton.language as tl

TEMPLATE = 'rmsnorm/rmsnorm.py.j2'
TEMPLATE_VERSION = 3
FAMILY = 'rmsnorm'
VARIANT = 'gated'
PARAMS = {'activation': 'silu', 'eps': 1e-06, 'has_weight': True, 'unit_offset': False}
OP_NAME = "onboard::rmsnorm_gated_dcd926fd"
TUNING_SPACE = {'BLOCK_N': [1, 2, 4, 8, 16, 32], 'BWD_BLOCK_N': [1, 2, 4, 8, 16, 32], 'bwd_warps': [1, 2, 4, 8, 16, 32], 'num_warps': [1, 2, 4, 8, 16, 32], 'programs_per_sm': [1, 2, 4, 8]}
DEFAULT_CONFIG = {'BLOCK_N': 4, 'BWD_BLOCK_N': 4, 'bwd_warps': 4, 'num_warps': 4, 'programs_per_sm': 4}
# Buckets over D (the row length): it decides BLOCK_D and so the best BLOCK_N / num_warps.
SHAPE_BUCKETS = [{'config': {'BLOCK_N': 8, 'BWD_BLOCK_N': 8, 'bwd_warps': 4, 'num_warps': 4}, 'dim': 'D', 'hi': 512, 'lo': 1, 'name': 'd_le_512'}, {'config': {'BLOCK_N': 2, 'BWD_BLOCK_N': 2, 'bwd_warps': 4, 'num_warps': 4}, 'dim': 'D', 'hi': 2048, 'lo': 513, 'name': 'd_le_2k'}, {'config': {'BLOCK_N': 2, 'BWD_BLOCK_N': 2, 'bwd_warps': 8, 'num_warps': 8, 'programs_per_sm': 2}, 'dim': 'D', 'hi': 4096, 'lo': 2049, 'name': 'd_le_4k'}, {'config': {'BLOCK_N': 1, 'BWD_BLOCK_N': 1, 'bwd_warps': 16, 'num_warps': 16}, 'dim': 'D', 'hi': 8192, 'lo': 4097, 'name': 'd_le_8k'}, {'config': {'BLOCK_N': 1, 'BWD_BLOCK_N': 1, 'bwd_warps': 32, 'num_warps': 32}, 'dim': 'D', 'hi': 65536, 'lo': 8193, 'name': 'd_le_64k'}]
MAX_D = 65536

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
def rmsnorm_gated_fwd_kernel(
    p_x,
    p_z,
    p_w,
    p_y,
    N,
    D,
    eps,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_n = tl.program_id(0)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    m_nd = (o_n < N)[:, None] & m_d[None, :]
    o_nd = o_n[:, None] * D + o_d[None, :]
    b_x = tl.load(p_x + o_nd, mask=m_nd, other=0.0).to(tl.float32)
    b_r = tl.rsqrt(tl.sum(b_x * b_x, axis=1) / D + eps)
    b_y = b_x * b_r[:, None]
    b_w = tl.load(p_w + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_y = b_y * b_w[None, :]
    b_z = tl.load(p_z + o_nd, mask=m_nd, other=0.0).to(tl.float32)
    b_y = b_y * b_z * tl.sigmoid(b_z)
    tl.store(p_y + o_nd, b_y.to(p_y.dtype.element_ty), mask=m_nd)


@triton.jit
def rmsnorm_gated_bwd_kernel(
    p_x,
    p_z,
    p_w,
    p_dy,
    p_dx,
    p_dz,
    p_dw,
    N,
    D,
    eps,
    NUM_BLOCKS,
    NUM_PROGRAMS,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Grid-stride over row blocks; each program keeps one fp32 partial weight gradient.
    i_p = tl.program_id(0)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_w = tl.load(p_w + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i_b in range(i_p, NUM_BLOCKS, NUM_PROGRAMS):
        # int64 offsets: N * D may pass 2^31 (the loop index is a plain int in the interpreter)
        o_n = i_b * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
        m_nd = (o_n < N)[:, None] & m_d[None, :]
        o_nd = o_n[:, None] * D + o_d[None, :]
        b_x = tl.load(p_x + o_nd, mask=m_nd, other=0.0).to(tl.float32)
        b_dy = tl.load(p_dy + o_nd, mask=m_nd, other=0.0).to(tl.float32)
        b_r = tl.rsqrt(tl.sum(b_x * b_x, axis=1) / D + eps)
        b_n = b_x * b_r[:, None]
        b_z = tl.load(p_z + o_nd, mask=m_nd, other=0.0).to(tl.float32)
        b_sig = tl.sigmoid(b_z)
        # d silu(z)/dz = sig(z) * (1 + z * (1 - sig(z)))
        b_dz = b_dy * b_n * b_w[None, :] * b_sig * (1.0 + b_z * (1.0 - b_sig))
        tl.store(p_dz + o_nd, b_dz.to(p_dz.dtype.element_ty), mask=m_nd)
        b_g = b_dy * b_z * b_sig
        b_dw += tl.sum(b_g * b_n, axis=0)
        b_dn = b_g * b_w[None, :]
        b_c = tl.sum(b_dn * b_n, axis=1) / D
        b_dx = b_r[:, None] * (b_dn - b_n * b_c[:, None])
        tl.store(p_dx + o_nd, b_dx.to(p_dx.dtype.element_ty), mask=m_nd)
    tl.store(p_dw + i_p.to(tl.int64) * D + o_d, b_dw, mask=m_d)


@triton.jit
def rmsnorm_gated_dw_sum_kernel(p_part, p_out, P, D, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    # Column sums of the [P, D] fp32 per-program partials, in a fixed order (deterministic).
    o_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    m_c = o_c < D
    b_acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for i_p in range(0, P, BLOCK_P):
        o_p = i_p + tl.arange(0, BLOCK_P)
        m = (o_p < P)[:, None] & m_c[None, :]
        b_acc += tl.sum(tl.load(p_part + o_p[:, None] * D + o_c[None, :], mask=m, other=0.0), axis=0)
    tl.store(p_out + o_c, b_acc.to(p_out.dtype.element_ty), mask=m_c)


def _col_sum(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[D] in `dtype`: the column sums of the [P, D] fp32 partials."""
    P, D = part.shape
    out = _empty((D,), dtype, part.device)
    rmsnorm_gated_dw_sum_kernel[(triton.cdiv(D, 256),)](part, out, P, D, BLOCK_P=32, BLOCK_C=256)
    return out


def _col_sum_spec(ptr: str) -> dict:
    """The AOT spec of the column-sum kernel writing a `ptr` output."""
    return {"kernel": "rmsnorm_gated_dw_sum_kernel",
            "signature": {"p_part": "*fp32", "p_out": ptr, "P": "i32", "D": "i32", "BLOCK_P": "constexpr",
                          "BLOCK_C": "constexpr"},
            "constexprs": {"BLOCK_P": 32, "BLOCK_C": 256}, "num_warps": 4}


def _check(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"rmsnorm_gated: x must be [..., D] with D > 0, got {tuple(x.shape)}")
    if x.shape[-1] > MAX_D:
        raise ValueError(f"rmsnorm_gated: D={x.shape[-1]} exceeds MAX_D={MAX_D} (x {tuple(x.shape)})")
    if gate.shape != x.shape:
        raise ValueError(f"rmsnorm_gated: gate {tuple(gate.shape)} must match x {tuple(x.shape)}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"rmsnorm_gated: weight {tuple(weight.shape)} must be [D] for x {tuple(x.shape)}")


def _forward(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check(x, gate, weight)
    D = x.shape[-1]
    x2 = x.reshape(-1, D).contiguous()
    N = x2.shape[0]
    y = _empty((N, D), x.dtype, x.device)
    if N > 0:
        cfg = config_for(D)
        rmsnorm_gated_fwd_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](
            x2,
            gate.reshape(-1, D).contiguous(),
            weight.contiguous(),
            y, N, D, eps,
            BLOCK_N=cfg["BLOCK_N"], BLOCK_D=triton.next_power_of_2(D), num_warps=cfg["num_warps"],
        )
    return y.view(x.shape)


def _backward(dy: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float):
    _check(x, gate, weight)
    D = x.shape[-1]
    x2 = x.reshape(-1, D).contiguous()
    N = x2.shape[0]
    cfg = config_for(D)
    num_blocks = triton.cdiv(N, cfg["BWD_BLOCK_N"])
    num_programs = _num_programs(num_blocks, x.device, cfg["programs_per_sm"])
    dx = _empty((N, D), x.dtype, x.device)
    dz = _empty((N, D), gate.dtype, x.device)
    dw_partial = _empty((num_programs, D), torch.float32, x.device)
    if N > 0:
        rmsnorm_gated_bwd_kernel[(num_programs,)](
            x2,
            gate.reshape(-1, D).contiguous(),
            weight.contiguous(),
            dy.reshape(-1, D).contiguous(),
            dx,
            dz,
            dw_partial,
            N, D, eps, num_blocks, num_programs,
            BLOCK_N=cfg["BWD_BLOCK_N"], BLOCK_D=triton.next_power_of_2(D), num_warps=cfg["bwd_warps"],
        )
        dw = _col_sum(dw_partial, weight.dtype)
    else:
        dw = torch.zeros_like(weight)
    return dx.view(x.shape), dz.view(x.shape), dw


@torch.library.custom_op(OP_NAME, mutates_args=())
def rmsnorm_gated_op(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _forward(x, gate, weight, eps)


@rmsnorm_gated_op.register_fake
def _(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check(x, gate, weight)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op(OP_NAME + "_bwd", mutates_args=())
def rmsnorm_gated_bwd_op(dy: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(dy, x, gate, weight, eps)


@rmsnorm_gated_bwd_op.register_fake
def _(dy: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float):
    _check(x, gate, weight)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    return dx, torch.empty_like(gate, memory_format=torch.contiguous_format), torch.empty_like(weight)


class RmsnormGatedFunction(torch.autograd.Function):
    """Autograd wiring of the op: forward and backward both run the Triton kernels."""

    @staticmethod
    def forward(x, gate, weight, eps):
        return rmsnorm_gated_op(x, gate, weight, eps)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, gate, weight, eps = inputs
        ctx.save_for_backward(x, gate, weight)
        ctx.eps = eps

    @staticmethod
    def backward(ctx, dy):
        x, gate, weight, = ctx.saved_tensors
        dx, dz, dw = rmsnorm_gated_bwd_op(dy, x, gate, weight, ctx.eps)
        return dx, dz, dw, None


rmsnorm_gated_op.register_autograd(RmsnormGatedFunction.backward, setup_context=RmsnormGatedFunction.setup_context)


def rmsnorm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-06) -> torch.Tensor:
    """y = x * rsqrt(mean(x^2) + eps) * weight * silu(gate); x [..., D], weight [D]."""
    return rmsnorm_gated_op(x, gate, weight, eps)


def reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-06) -> torch.Tensor:
    """Pure-PyTorch rmsnorm_gated in fp32 (same signature as `rmsnorm_gated`), cast back to x's dtype."""
    _check(x, gate, weight)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = y * (weight.float())
    y = y * torch.nn.functional.silu(gate.float())
    return y.to(x.dtype)


entry = rmsnorm_gated
OPS = (rmsnorm_gated_op, rmsnorm_gated_bwd_op)


def op_samples(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-06) -> list:
    """(op, args) pairs exercising every custom op of this module, for torch.library.opcheck."""
    dy = torch.randn_like(x)
    plain = [t.detach() for t in (x, gate, weight,)]
    return [(rmsnorm_gated_op, (x, gate, weight, eps)), (rmsnorm_gated_bwd_op, (dy, *plain, eps))]


def aot_specs(dtype: str = "bf16", size: int = 4096) -> list[dict]:
    """Signatures and constexprs of every kernel, for ahead-of-time compilation at D=`size`."""
    cfg = config_for(size)
    consts = {"BLOCK_N": cfg["BLOCK_N"], "BLOCK_D": triton.next_power_of_2(size)}
    bwd_consts = {"BLOCK_N": cfg["BWD_BLOCK_N"], "BLOCK_D": triton.next_power_of_2(size)}
    ptr = "*" + dtype
    fwd = {"p_x": ptr, "p_z": ptr, "p_w": ptr, "p_y": ptr}
    bwd = {"p_x": ptr, "p_z": ptr, "p_w": ptr, "p_dy": ptr, "p_dx": ptr, "p_dz": ptr, "p_dw": "*fp32"}
    scalars = {"N": "i32", "D": "i32", "eps": "fp32"}
    tail = {"BLOCK_N": "constexpr", "BLOCK_D": "constexpr"}
    return [
        {"kernel": "rmsnorm_gated_fwd_kernel", "signature": {**fwd, **scalars, **tail}, "constexprs": consts,
         "num_warps": cfg["num_warps"]},
        {"kernel": "rmsnorm_gated_bwd_kernel",
         "signature": {**bwd, **scalars, "NUM_BLOCKS": "i32", "NUM_PROGRAMS": "i32", **tail},
         "constexprs": bwd_consts, "num_warps": cfg["bwd_warps"]},
        _col_sum_spec(ptr),
    ]
