# Rendered by onboard from kernel_templates/moe_router/moe_router.py.j2 (template version 2). Do not edit.
# family: moe_router  variant: softmax
# params: {"n_group": 1, "renormalize": true, "routed_scaling_factor": 1.0, "score_bias": false, "top_k": 4, "topk_group": 1}
"""moe_router: softmax scoring, top-4 expert selection.

    logits = x W^T (+ gate_bias)                      (in x's dtype, PyTorch: autograd gives dW, dx)
    s      = softmax(logits, dim=-1)                    (fp32)
    c      = s                                         (selection score)
    idx    = topk(c, 4) (sorted, descending)
    w      = s[idx] / (sum(s[idx]) + 1e-20)
    counts = tokens per expert (bincount of idx)

Shapes: x [N, D] (or [..., D], flattened), weight [E, D];
logits [N, E] (x's dtype), topk_weights [N, 4] fp32, topk_indices [N, 4] int64,
counts [E] int64. Gradients flow to the logits through w (the selection is discrete; the bias
gets none), so to x and W through the linear. As transformers' DeepseekV3TopkRouter /
Qwen3MoeTopKRouter / Mixtral routers, indices sorted by selection score.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

TEMPLATE = 'moe_router/moe_router.py.j2'
TEMPLATE_VERSION = 2
FAMILY = 'moe_router'
VARIANT = 'softmax'
PARAMS = {'n_group': 1, 'renormalize': True, 'routed_scaling_factor': 1.0, 'score_bias': False, 'top_k': 4, 'topk_group': 1}
OP_NAME = "onboard::moe_router_softmax_b6e7da42"
TUNING_SPACE = {'BLOCK_N': [1, 2, 4, 8, 16, 32, 64], 'num_warps': [1, 2, 4, 8]}
DEFAULT_CONFIG = {'BLOCK_N': 16, 'num_warps': 4}
# Buckets over E (the number of experts): the whole row of E scores sits in one tile.
SHAPE_BUCKETS = [{'config': {'BLOCK_N': 32}, 'dim': 'E', 'hi': 64, 'lo': 1, 'name': 'e_le_64'}, {'config': {'BLOCK_N': 8}, 'dim': 'E', 'hi': 256, 'lo': 65, 'name': 'e_le_256'}, {'config': {'BLOCK_N': 2, 'num_warps': 8}, 'dim': 'E', 'hi': 4096, 'lo': 257, 'name': 'e_big'}]
TOP_K = 4
N_GROUP = 1
TOPK_GROUP = 1
SCALE = 1.0

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
def _scores(b_l, m_e):
    # fp32 scores of a [BLOCK_N, BLOCK_E] logits tile; padded experts score 0.
    b_l = tl.where(m_e[None, :], b_l, float("-inf"))
    b_m = tl.max(b_l, 1)
    b_x = tl.where(m_e[None, :], tl.exp(b_l - b_m[:, None]), 0.0)
    return b_x / tl.sum(b_x, 1)[:, None]


@triton.jit
def moe_router_fwd_kernel(
    p_l,
    p_b,
    p_w,
    p_i,
    p_cnt,
    N,
    E,
    GROUP_SIZE,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    i_n = tl.program_id(0)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    o_e = tl.arange(0, BLOCK_E)
    m_n = o_n < N
    m_e = o_e < E
    b_l = tl.load(p_l + o_n[:, None] * E + o_e[None, :], mask=m_n[:, None] & m_e[None, :], other=0.0).to(tl.float32)
    b_s = _scores(b_l, m_e)
    b_c = b_s
    b_c = tl.where(m_e[None, :], b_c, float("-inf"))
    b_sum = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(4):
        b_mj = tl.max(b_c, 1)
        # lowest index among ties, as torch.topk on distinct values
        b_ij = tl.min(tl.where(b_c == b_mj[:, None], o_e[None, :], BLOCK_E), 1)
        b_sj = tl.sum(tl.where(o_e[None, :] == b_ij[:, None], b_s, 0.0), 1)
        b_sum += b_sj
        tl.store(p_i + o_n * 4 + j, b_ij.to(tl.int64), mask=m_n)
        tl.store(p_w + o_n * 4 + j, b_sj, mask=m_n)
        tl.atomic_add(p_cnt + b_ij, tl.full([BLOCK_N], 1, tl.int32), mask=m_n)
        b_c = tl.where(o_e[None, :] == b_ij[:, None], float("-inf"), b_c)
    for j in tl.static_range(4):
        b_sj = tl.load(p_w + o_n * 4 + j, mask=m_n, other=0.0)
        b_sj = b_sj / (b_sum + 1e-20)
        tl.store(p_w + o_n * 4 + j, b_sj * 1.0, mask=m_n)


@triton.jit
def moe_router_bwd_kernel(
    p_l,
    p_i,
    p_dw,
    p_dl,
    N,
    E,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    i_n = tl.program_id(0)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    o_e = tl.arange(0, BLOCK_E)
    m_n = o_n < N
    m_e = o_e < E
    m_ne = m_n[:, None] & m_e[None, :]
    b_l = tl.load(p_l + o_n[:, None] * E + o_e[None, :], mask=m_ne, other=0.0).to(tl.float32)
    b_s = _scores(b_l, m_e)
    # w_j = c * s_j / S, S = sum_k s_k + 1e-20: ds_j = c * (dw_j / S - sum_k dw_k s_k / S^2)
    b_sum = tl.zeros([BLOCK_N], tl.float32)
    b_dot = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(4):
        b_ij = tl.load(p_i + o_n * 4 + j, mask=m_n, other=-1)
        b_dwj = tl.load(p_dw + o_n * 4 + j, mask=m_n, other=0.0).to(tl.float32)
        b_sj = tl.sum(tl.where(o_e[None, :] == b_ij[:, None], b_s, 0.0), 1)
        b_sum += b_sj
        b_dot += b_dwj * b_sj
    b_sum += 1e-20
    b_ds = tl.zeros([BLOCK_N, BLOCK_E], tl.float32)
    for j in tl.static_range(4):
        b_ij = tl.load(p_i + o_n * 4 + j, mask=m_n, other=-1)
        b_dwj = tl.load(p_dw + o_n * 4 + j, mask=m_n, other=0.0).to(tl.float32)
        b_dsj = (b_dwj / b_sum - b_dot / (b_sum * b_sum)) * 1.0
        b_ds = tl.where(o_e[None, :] == b_ij[:, None], b_ds + b_dsj[:, None], b_ds)
    b_dl = b_s * (b_ds - tl.sum(b_ds * b_s, 1)[:, None])
    tl.store(p_dl + o_n[:, None] * E + o_e[None, :], b_dl.to(p_dl.dtype.element_ty), mask=m_ne)


def _check_logits(logits: torch.Tensor, bias: torch.Tensor | None) -> None:
    if logits.dim() != 2 or logits.shape[1] < TOP_K:
        raise ValueError(f"moe_router: logits must be [N, E] with E >= top_k={TOP_K}, got {tuple(logits.shape)}")
    E = logits.shape[1]
    if bias is not None:
        raise ValueError(f"moe_router: rendered without score_bias, got a bias {tuple(bias.shape)}")


def _blocks(N: int, E: int):
    cfg = config_for(E)
    return cfg, triton.next_power_of_2(E), (triton.cdiv(N, cfg["BLOCK_N"]),)


def _forward(logits: torch.Tensor, bias: torch.Tensor | None):
    _check_logits(logits, bias)
    logits = logits.contiguous()
    N, E = logits.shape
    w = _empty((N, TOP_K), torch.float32, logits.device)
    idx = _empty((N, TOP_K), torch.int64, logits.device) if not _POISON_OUTPUTS else \
        torch.full((N, TOP_K), -1, dtype=torch.int64, device=logits.device)
    cnt = torch.zeros(E, dtype=torch.int32, device=logits.device)
    if N > 0:
        cfg, BE, grid = _blocks(N, E)
        moe_router_fwd_kernel[grid](
            logits, bias.contiguous() if bias is not None else logits, w, idx, cnt, N, E, E // N_GROUP,
            BLOCK_N=cfg["BLOCK_N"], BLOCK_E=BE, BLOCK_G=triton.next_power_of_2(N_GROUP),
            num_warps=cfg["num_warps"],
        )
    return w, idx, cnt.to(torch.int64)


def _backward(dw: torch.Tensor, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    logits = logits.contiguous()
    N, E = logits.shape
    dl = _empty((N, E), logits.dtype, logits.device)
    if N > 0:
        cfg, BE, grid = _blocks(N, E)
        moe_router_bwd_kernel[grid](
            logits, idx.contiguous(), dw.contiguous(), dl, N, E,
            BLOCK_N=cfg["BLOCK_N"], BLOCK_E=BE, num_warps=cfg["num_warps"],
        )
    return dl


@torch.library.custom_op(OP_NAME, mutates_args=())
def moe_router_op(logits: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(logits, bias)


@moe_router_op.register_fake
def _(logits: torch.Tensor, bias: torch.Tensor | None):
    _check_logits(logits, bias)
    N, E = logits.shape
    return (logits.new_empty((N, TOP_K), dtype=torch.float32), logits.new_empty((N, TOP_K), dtype=torch.int64),
            logits.new_empty((E,), dtype=torch.int64))


@torch.library.custom_op(OP_NAME + "_bwd", mutates_args=())
def moe_router_bwd_op(dw: torch.Tensor, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return _backward(dw, logits, idx)


@moe_router_bwd_op.register_fake
def _(dw: torch.Tensor, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return logits.new_empty(logits.shape)


class MoeRouterFunction(torch.autograd.Function):
    """Autograd wiring: the gradient of the top-k weights to the logits (indices, counts: none)."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], output[1])
        ctx.mark_non_differentiable(output[1], output[2])

    @staticmethod
    def backward(ctx, dw, didx, dcnt):
        logits, idx = ctx.saved_tensors
        if dw is None:
            return None, None
        return moe_router_bwd_op(dw, logits, idx), None


moe_router_op.register_autograd(MoeRouterFunction.backward, setup_context=MoeRouterFunction.setup_context)


def moe_router(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               gate_bias: torch.Tensor | None = None):
    """(logits [N, E], topk_weights [N, k] fp32, topk_indices [N, k] int64, counts [E] int64); see
    the module docstring. `gate_bias` [E]: a bias of the logits' linear itself (gpt-oss)."""
    if x.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(f"moe_router: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [..., D] and [E, D]")
    logits = F.linear(x.reshape(-1, x.shape[-1]), weight, gate_bias)
    w, idx, cnt = moe_router_op(logits, bias)
    return logits, w, idx, cnt


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              gate_bias: torch.Tensor | None = None):
    """Pure-PyTorch router (transformers' DeepseekV3TopkRouter / Qwen3MoeTopKRouter /
    DeepseekV4TopKRouter, indices sorted)."""
    if x.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(f"moe_router: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [..., D] and [E, D]")
    logits = F.linear(x.reshape(-1, x.shape[-1]), weight, gate_bias)
    _check_logits(logits, bias)
    N, E = logits.shape
    scores = torch.softmax(logits.float(), dim=-1)
    choice = scores.detach()
    idx = torch.topk(choice, k=TOP_K, dim=-1, sorted=True)[1]
    w = scores.gather(1, idx)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    w = w * SCALE
    return logits, w, idx, torch.bincount(idx.flatten(), minlength=E)


entry = moe_router
OPS = (moe_router_op, moe_router_bwd_op)


def op_samples(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> list:
    """(op, args) pairs exercising every custom op of this module, for torch.library.opcheck."""
    logits = F.linear(x.reshape(-1, x.shape[-1]), weight).detach().requires_grad_(x.requires_grad)
    b = None if bias is None else bias.detach()
    w, idx, _ = _forward(logits.detach(), b)
    dw = torch.randn_like(w)
    return [(moe_router_op, (logits, b)), (moe_router_bwd_op, (dw, logits.detach(), idx))]


def aot_specs(dtype: str = "bf16", size: int = 256) -> list[dict]:
    """Signatures and constexprs of every kernel, for ahead-of-time compilation at E=`size`."""
    cfg = config_for(size)
    be = triton.next_power_of_2(size)
    ptr = "*" + dtype
    return [
        {"kernel": "moe_router_fwd_kernel",
         "signature": {"p_l": ptr, "p_b": "*fp32", "p_w": "*fp32", "p_i": "*i64", "p_cnt": "*i32", "N": "i32",
                       "E": "i32", "GROUP_SIZE": "i32", "BLOCK_N": "constexpr", "BLOCK_E": "constexpr",
                       "BLOCK_G": "constexpr"},
         "constexprs": {"BLOCK_N": cfg["BLOCK_N"], "BLOCK_E": be, "BLOCK_G": triton.next_power_of_2(N_GROUP)},
         "num_warps": cfg["num_warps"]},
        {"kernel": "moe_router_bwd_kernel",
         "signature": {"p_l": ptr, "p_i": "*i64", "p_dw": "*fp32", "p_dl": ptr, "N": "i32", "E": "i32",
                       "BLOCK_N": "constexpr", "BLOCK_E": "constexpr"},
         "constexprs": {"BLOCK_N": cfg["BLOCK_N"], "BLOCK_E": be}, "num_warps": cfg["num_warps"]},
    ]
