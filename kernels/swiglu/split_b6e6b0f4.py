# Rendered by onboard from kernel_templates/swiglu/swiglu.py.j2 (template version 2). Do not edit.
# family: swiglu  variant: split
# params: {"alpha": 1.0, "clamp_style": "pre_act", "layout": "halves", "limit": null, "up_offset": 0.0}
"""swiglu: the gated-linear-unit activation of a SwiGLU MLP.

    g = gate
    a = silu(g)
    y = (up) * a

Shapes: gate [..., F], up [..., F]; y [..., F].
Kernels load fp32/fp16/bf16 and compute in fp32; y and the gradients have the input dtype.
"""

import torch
import triton
import triton.language as tl

TEMPLATE = 'swiglu/swiglu.py.j2'
TEMPLATE_VERSION = 2
FAMILY = 'swiglu'
VARIANT = 'split'
PARAMS = {'alpha': 1.0, 'clamp_style': 'pre_act', 'layout': 'halves', 'limit': None, 'up_offset': 0.0}
OP_NAME = "onboard::swiglu_split_b6e6b0f4"
TUNING_SPACE = {'BLOCK_F': [64, 128, 256, 512, 1024, 2048], 'BLOCK_N': [1, 2, 4, 8, 16, 32], 'num_warps': [1, 2, 4, 8, 16]}
DEFAULT_CONFIG = {'BLOCK_F': 1024, 'BLOCK_N': 4, 'num_warps': 4}
# Buckets over F (the intermediate width).
SHAPE_BUCKETS = [{'config': {'BLOCK_F': 512, 'BLOCK_N': 8}, 'dim': 'F', 'hi': 1024, 'lo': 1, 'name': 'f_le_1k'}, {'config': {}, 'dim': 'F', 'hi': 8192, 'lo': 1025, 'name': 'f_le_8k'}, {'config': {'BLOCK_F': 2048, 'BLOCK_N': 2, 'num_warps': 8}, 'dim': 'F', 'hi': 2147483647, 'lo': 8193, 'name': 'f_big'}]

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
def swiglu_fwd_kernel(
    p_g,
    p_u,
    p_y,
    N,
    F,
    stride_g,
    stride_u,
    COL_STEP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    # gate/up element (n, f) sits at p_g + n * stride_g + f * COL_STEP (likewise for up), so one
    # kernel serves separate tensors, [gate | up] halves and interleaved pairs.
    i_n, i_f = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    o_f = i_f * BLOCK_F + tl.arange(0, BLOCK_F)
    m_nf = (o_n < N)[:, None] & (o_f < F)[None, :]
    b_g = tl.load(p_g + o_n[:, None] * stride_g + o_f[None, :] * COL_STEP, mask=m_nf, other=0.0).to(tl.float32)
    b_u = tl.load(p_u + o_n[:, None] * stride_u + o_f[None, :] * COL_STEP, mask=m_nf, other=0.0).to(tl.float32)
    b_a = b_g * tl.sigmoid(b_g)
    tl.store(p_y + o_n[:, None] * F + o_f[None, :], (b_u * b_a).to(p_y.dtype.element_ty), mask=m_nf)


@triton.jit
def swiglu_bwd_kernel(
    p_g,
    p_u,
    p_dy,
    p_dg,
    p_du,
    N,
    F,
    stride_g,
    stride_u,
    COL_STEP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    # dg/du use the same layout (strides, COL_STEP) as g/u.
    i_n, i_f = tl.program_id(0), tl.program_id(1)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    o_f = i_f * BLOCK_F + tl.arange(0, BLOCK_F)
    m_nf = (o_n < N)[:, None] & (o_f < F)[None, :]
    o_g = o_n[:, None] * stride_g + o_f[None, :] * COL_STEP
    o_u = o_n[:, None] * stride_u + o_f[None, :] * COL_STEP
    b_g = tl.load(p_g + o_g, mask=m_nf, other=0.0).to(tl.float32)
    b_u = tl.load(p_u + o_u, mask=m_nf, other=0.0).to(tl.float32)
    b_dy = tl.load(p_dy + o_n[:, None] * F + o_f[None, :], mask=m_nf, other=0.0).to(tl.float32)
    b_gc = b_g
    b_sig = tl.sigmoid(b_gc)
    b_a = b_gc * b_sig
    b_uc = b_u
    b_du = b_dy * b_a
    b_da = b_dy * (b_uc)
    # d/dg [g * sig(s g)] = sig + s * g * sig * (1 - sig)
    b_dg = b_da * (b_sig + b_gc * b_sig * (1.0 - b_sig))
    tl.store(p_dg + o_g, b_dg.to(p_dg.dtype.element_ty), mask=m_nf)
    tl.store(p_du + o_u, b_du.to(p_du.dtype.element_ty), mask=m_nf)


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.dim() < 1 or gate.shape[-1] == 0 or gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must both be [..., F]")
    if gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate {gate.dtype} and up {up.dtype} must share a dtype")


def _views(t2: torch.Tensor, F: int):
    """(gate view, up view, row stride, column step) into a contiguous [N, F] tensor."""
    return t2, None, F, 1


def _launch_shape(N: int, F: int):
    cfg = config_for(F)
    return cfg, (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(F, cfg["BLOCK_F"]))


def _forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    _check(gate, up)
    F = gate.shape[-1]
    out_shape = gate.shape
    g, u = gate.reshape(-1, F).contiguous(), up.reshape(-1, F).contiguous()
    stride, step = F, 1
    dtype, device = gate.dtype, gate.device
    N = g.shape[0]
    y = _empty((N, F), dtype, device)
    if N > 0:
        cfg, grid = _launch_shape(N, F)
        swiglu_fwd_kernel[grid](
            g, u, y, N, F, stride, stride, COL_STEP=step,
            BLOCK_N=cfg["BLOCK_N"], BLOCK_F=cfg["BLOCK_F"], num_warps=cfg["num_warps"],
        )
    return y.view(out_shape)


def _backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    _check(gate, up)
    F = gate.shape[-1]
    g, u = gate.reshape(-1, F).contiguous(), up.reshape(-1, F).contiguous()
    stride, step = F, 1
    N = g.shape[0]
    dg, du = _empty((N, F), gate.dtype, gate.device), _empty((N, F), up.dtype, up.device)
    if N > 0:
        cfg, grid = _launch_shape(N, F)
        swiglu_bwd_kernel[grid](
            g, u, dy.reshape(-1, F).contiguous(), dg, du, N, F, stride, stride, COL_STEP=step,
            BLOCK_N=cfg["BLOCK_N"], BLOCK_F=cfg["BLOCK_F"], num_warps=cfg["num_warps"],
        )
    return dg.view(gate.shape), du.view(up.shape)


@torch.library.custom_op(OP_NAME, mutates_args=())
def swiglu_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _forward(gate, up)


@swiglu_op.register_fake
def _(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    _check(gate, up)
    return gate.new_empty(gate.shape)


@torch.library.custom_op(OP_NAME + "_bwd", mutates_args=())
def swiglu_bwd_op(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(dy, gate, up)


@swiglu_bwd_op.register_fake
def _(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    _check(gate, up)
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


class SwigluFunction(torch.autograd.Function):
    """Autograd wiring of the op: forward and backward both run the Triton kernels."""

    @staticmethod
    def forward(gate, up):
        return swiglu_op(gate, up)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, dy):
        return swiglu_bwd_op(dy, *ctx.saved_tensors)


swiglu_op.register_autograd(SwigluFunction.backward, setup_context=SwigluFunction.setup_context)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """y = (up) * a(g), see the module docstring; gate, up [..., F] -> y [..., F]."""
    return swiglu_op(gate, up)


def reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Pure-PyTorch swiglu in fp32 (same signature as `swiglu`), cast back to the input dtype."""
    _check(gate, up)
    g, u = gate.float(), up.float()
    a = g * torch.sigmoid(g)
    return ((u) * a).to(gate.dtype)


entry = swiglu
OPS = (swiglu_op, swiglu_bwd_op)


def op_samples(gate: torch.Tensor, up: torch.Tensor) -> list:
    """(op, args) pairs exercising every custom op of this module, for torch.library.opcheck."""
    plain = [t.detach() for t in (gate, up,)]
    dy = torch.randn_like(gate)
    return [(swiglu_op, (gate, up,)), (swiglu_bwd_op, (dy, *plain))]


def aot_specs(dtype: str = "bf16", size: int = 4096) -> list[dict]:
    """Signatures and constexprs of every kernel, for ahead-of-time compilation at F=`size`."""
    cfg = config_for(size)
    consts = {"COL_STEP": 1, "BLOCK_N": cfg["BLOCK_N"], "BLOCK_F": cfg["BLOCK_F"]}
    ptr = "*" + dtype
    scalars = {"N": "i32", "F": "i32", "stride_g": "i32", "stride_u": "i32"}
    tail = {"COL_STEP": "constexpr", "BLOCK_N": "constexpr", "BLOCK_F": "constexpr"}
    return [
        {"kernel": "swiglu_fwd_kernel", "signature": {"p_g": ptr, "p_u": ptr, "p_y": ptr, **scalars, **tail},
         "constexprs": consts, "num_warps": cfg["num_warps"]},
        {"kernel": "swiglu_bwd_kernel",
         "signature": {"p_g": ptr, "p_u": ptr, "p_dy": ptr, "p_dg": ptr, "p_du": ptr, **scalars, **tail},
         "constexprs": consts, "num_warps": cfg["num_warps"]},
    ]
