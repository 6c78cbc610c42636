"""Modeling of the `onboard_hybrid` example model (Hugging Face remote code).

A miniature hybrid flagship, pure PyTorch and `torch.export`-friendly (no data-dependent shapes):

- "linear_attention" layers: gated delta net (GDN) with a causal depthwise conv1d + SiLU,
  L2-normalised q/k, a chunked gated delta rule and a gated RMSNorm on the output;
- sparse attention layers: DeepSeek-V3.2-style lightning indexer selecting the top-k keys per
  query, then GQA softmax attention restricted to them (RoPE, per-head q/k RMSNorm, sigmoid
  output gate);
- every layer's MLP: a routed mixture of SwiGLU experts (3-D weights) plus a gated shared expert.

Shape legend for suffixed names: B batch, T sequence, D hidden, H heads (Hk key heads, Hv value
heads, Hq/Hkv attention heads, Hi index heads), K key head dim, V value head dim, E experts,
F expert FFN width, N tokens (B*T), C chunk length, S kept keys (top-k).
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_onboard_hybrid import OnboardHybridConfig, is_sparse_attention, resolve_layer_types

# --------------------------------------------------------------------------------------------
# Gated delta rule


def _check_delta_rule_shapes(q, k, v, g, beta, initial_state):
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, Hk, K], got q {tuple(q.shape)}, k {tuple(k.shape)}")
    B, T, Hk, K = q.shape
    if v.dim() != 4 or v.shape[:2] != (B, T) or v.shape[2] % Hk:
        raise ValueError(
            f"v must be [B, T, Hv, V] with Hv a multiple of Hk={Hk}, got v {tuple(v.shape)}, q {tuple(q.shape)}"
        )
    Hv, V = v.shape[2], v.shape[3]
    if g.shape != (B, T, Hv) or beta.shape != (B, T, Hv):
        raise ValueError(
            f"g and beta must be [B, T, Hv] = {(B, T, Hv)}, got g {tuple(g.shape)}, beta {tuple(beta.shape)}"
        )
    if initial_state is not None and initial_state.shape != (B, Hv, K, V):
        raise ValueError(f"initial_state must be [B, Hv, K, V] = {(B, Hv, K, V)}, got {tuple(initial_state.shape)}")


def _delta_rule_inputs(q, k, v, g, beta, scale):
    """Repeat key heads onto value heads, move heads before time, upcast to the compute dtype."""
    compute_dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
    group = v.shape[2] // q.shape[2]
    if group > 1:
        q = q.repeat_interleave(group, dim=2)
        k = k.repeat_interleave(group, dim=2)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    q_BHTK = q.transpose(1, 2).to(compute_dtype) * scale
    k_BHTK = k.transpose(1, 2).to(compute_dtype)
    v_BHTV = v.transpose(1, 2).to(compute_dtype)
    g_BHT = g.transpose(1, 2).to(compute_dtype)
    beta_BHT = beta.transpose(1, 2).to(compute_dtype)
    return q_BHTK, k_BHTK, v_BHTV, g_BHT, beta_BHT


def recurrent_gated_delta_rule(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False
):
    """Naive token-by-token gated delta rule: the reference for `chunk_gated_delta_rule`.

    Same arguments, shapes and return value as `chunk_gated_delta_rule`. For each step t, with the
    state S of shape [K, V] per (batch, value head):

        S   <- exp(g_t) * S
        u_t  = v_t - S^T k_t
        S   <- S + beta_t * k_t u_t^T
        o_t  = S^T (scale * q_t)
    """
    _check_delta_rule_shapes(q, k, v, g, beta, initial_state)
    B, T, _, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    q_BHTK, k_BHTK, v_BHTV, g_BHT, beta_BHT = _delta_rule_inputs(q, k, v, g, beta, scale)
    if initial_state is None:
        S_BHKV = q_BHTK.new_zeros(B, Hv, K, V)
    else:
        S_BHKV = initial_state.to(q_BHTK.dtype)
    outputs = []
    for t in range(T):
        S_BHKV = S_BHKV * g_BHT[:, :, t].exp()[..., None, None]
        k_BHK = k_BHTK[:, :, t]
        u_BHV = v_BHTV[:, :, t] - torch.einsum("bhk,bhkv->bhv", k_BHK, S_BHKV)
        S_BHKV = S_BHKV + torch.einsum("bhk,bhv->bhkv", k_BHK * beta_BHT[:, :, t, None], u_BHV)
        outputs.append(torch.einsum("bhk,bhkv->bhv", q_BHTK[:, :, t], S_BHKV))
    o_BTHV = torch.stack(outputs, dim=1).to(v.dtype)
    return o_BTHV, (S_BHKV if output_final_state else None)


def chunk_gated_delta_rule(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, chunk_size=64
):
    """Chunked gated delta rule (pure PyTorch), exact up to rounding.

    The recurrence, per (batch, value head), with state S of shape [K, V]:

        S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t k_t v_t^T,    o_t = S_t^T (scale * q_t)

    Inside a chunk of C steps entered with state S0, let G_i = g_1 + ... + g_i (cumulative log
    decay) and u_i = v_i - k_i^T S_{i-1}' (the prediction error against the decayed state). The
    errors satisfy a unit lower-triangular system (the WY / UT representation)

        u_i + sum_{j<i} beta_j exp(G_i - G_j) (k_i . k_j) u_j = v_i - exp(G_i) S0^T k_i,

    solved once per chunk for both right-hand sides (U0 from v, W from exp(G) k), so that
    U = U0 - W S0 costs one matmul per chunk. Then

        o_i  = exp(G_i) S0^T q_i + sum_{j<=i} beta_j exp(G_i - G_j) (q_i . k_j) u_j
        S_C  = exp(G_C) S0 + sum_j beta_j exp(G_C - G_j) k_j u_j^T.

    Every exponent is <= 0 (differences are masked before `exp`), so nothing overflows. T is
    padded up to a multiple of `chunk_size` with g = 0 and beta = k = v = 0, which leaves the
    state unchanged. The chunk loop runs in Python: `torch.export` unrolls it (fixed T).

    Args:
        q: [B, T, Hk, K] queries (L2-normalise them beforehand if the model does).
        k: [B, T, Hk, K] keys (likewise).
        v: [B, T, Hv, V] values; Hv is a multiple of Hk, key head h // (Hv // Hk) serves value head h.
        g: [B, T, Hv] log decay per step (<= 0 for a contracting state).
        beta: [B, T, Hv] write strength per step, usually in (0, 1).
        scale: query scale; default K ** -0.5.
        initial_state: optional [B, Hv, K, V] state before the first step.
        output_final_state: also return the state after the last step.
        chunk_size: chunk length C.

    Returns:
        o: [B, T, Hv, V] in v's dtype (computed in fp32, or fp64 for fp64 inputs);
        final_state: [B, Hv, K, V] in the compute dtype, or None.
    """
    _check_delta_rule_shapes(q, k, v, g, beta, initial_state)
    B, T, _, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    C = chunk_size
    q_BHTK, k_BHTK, v_BHTV, g_BHT, beta_BHT = _delta_rule_inputs(q, k, v, g, beta, scale)

    pad = (-T) % C
    if pad:
        q_BHTK, k_BHTK, v_BHTV = (F.pad(x, (0, 0, 0, pad)) for x in (q_BHTK, k_BHTK, v_BHTV))
        g_BHT, beta_BHT = (F.pad(x, (0, pad)) for x in (g_BHT, beta_BHT))
    n_chunks = (T + pad) // C
    q_BHNCK, k_BHNCK = (x.reshape(B, Hv, n_chunks, C, K) for x in (q_BHTK, k_BHTK))
    v_BHNCV = v_BHTV.reshape(B, Hv, n_chunks, C, V)
    g_BHNC = g_BHT.reshape(B, Hv, n_chunks, C).cumsum(-1)
    beta_BHNC = beta_BHT.reshape(B, Hv, n_chunks, C)

    ones_CC = torch.ones(C, C, dtype=torch.bool, device=q.device)
    causal_CC = torch.tril(ones_CC)
    strictly_lower_CC = torch.tril(ones_CC, diagonal=-1)
    # exp(G_i - G_j) for j <= i, 0 above the diagonal (masked to -inf before exp: no overflow).
    decay_BHNCC = (g_BHNC[..., :, None] - g_BHNC[..., None, :]).masked_fill(~causal_CC, float("-inf")).exp()
    decay_beta_BHNCC = decay_BHNCC * beta_BHNC[..., None, :]

    a_BHNCC = (k_BHNCK @ k_BHNCK.transpose(-1, -2) * decay_beta_BHNCC).masked_fill(~strictly_lower_CC, 0.0)
    eye_CC = torch.eye(C, dtype=a_BHNCC.dtype, device=q.device)
    rhs_BHNC_VK = torch.cat([v_BHNCV, k_BHNCK * g_BHNC.exp()[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(a_BHNCC + eye_CC, rhs_BHNC_VK, upper=False, unitriangular=True)
    u0_BHNCV, w_BHNCK = solved[..., :V], solved[..., V:]

    qk_BHNCC = q_BHNCK @ k_BHNCK.transpose(-1, -2) * decay_beta_BHNCC
    q_decayed_BHNCK = q_BHNCK * g_BHNC.exp()[..., None]
    # beta_j exp(G_C - G_j): weight of step j's write in the state leaving the chunk.
    write_BHNC = beta_BHNC * (g_BHNC[..., -1:] - g_BHNC).exp()
    k_write_BHNCK = k_BHNCK * write_BHNC[..., None]
    chunk_decay_BHN = g_BHNC[..., -1].exp()

    if initial_state is None:
        S_BHKV = q_BHTK.new_zeros(B, Hv, K, V)
    else:
        S_BHKV = initial_state.to(q_BHTK.dtype)
    outputs = []
    for n in range(n_chunks):
        u_BHCV = u0_BHNCV[:, :, n] - w_BHNCK[:, :, n] @ S_BHKV
        outputs.append(q_decayed_BHNCK[:, :, n] @ S_BHKV + qk_BHNCC[:, :, n] @ u_BHCV)
        S_BHKV = S_BHKV * chunk_decay_BHN[:, :, n, None, None] + k_write_BHNCK[:, :, n].transpose(-1, -2) @ u_BHCV
    o_BHTV = torch.stack(outputs, dim=2).reshape(B, Hv, n_chunks * C, V)[:, :, :T]
    o_BTHV = o_BHTV.transpose(1, 2).to(v.dtype)
    return o_BTHV, (S_BHKV if output_final_state else None)


# --------------------------------------------------------------------------------------------
# Norms and rotary embedding


def _rms_normalize(x, eps):
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


class OnboardHybridRMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in fp32."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return (_rms_normalize(x, self.eps) * self.weight.float()).to(x.dtype)


class OnboardHybridRMSNormGated(nn.Module):
    """y = x / rms(x) * weight * silu(z), over the last dim, computed in fp32."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, z):
        y = _rms_normalize(x, self.eps) * self.weight.float() * F.silu(z.float())
        return y.to(x.dtype)


def l2_normalize(x, eps=1e-6):
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


class OnboardHybridRotaryEmbedding(nn.Module):
    """cos/sin tables for half-split RoPE over a head of size `dim`.

    The inverse frequencies are recomputed in forward instead of living in a buffer, so the
    module holds no state (nothing to initialise, and a model built on `meta` needs no fix-up).
    """

    def __init__(self, dim, theta):
        super().__init__()
        if dim % 2:
            raise ValueError(f"RoPE head dim must be even, got {dim}")
        self.dim = dim
        self.theta = theta

    def forward(self, position_ids_BT, dtype):
        exponent = torch.arange(0, self.dim, 2, dtype=torch.float32, device=position_ids_BT.device) / self.dim
        inv_freq = 1.0 / (self.theta**exponent)
        freqs_BTR = position_ids_BT.float()[..., None] * inv_freq
        angles = torch.cat([freqs_BTR, freqs_BTR], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x_BTHK, cos_BTK, sin_BTK):
    """Half-split RoPE: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]."""
    x1, x2 = x_BTHK.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x_BTHK * cos_BTK[:, :, None] + rotated * sin_BTK[:, :, None]


# --------------------------------------------------------------------------------------------
# Gated delta net (linear attention)


class OnboardHybridGatedDeltaNet(nn.Module):
    def __init__(self, config: OnboardHybridConfig):
        super().__init__()
        D = config.hidden_size
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.chunk_size = config.linear_chunk_size
        key_dim = self.num_k_heads * self.head_k_dim
        value_dim = self.num_v_heads * self.head_v_dim
        self.key_dim, self.value_dim = key_dim, value_dim

        self.q_proj = nn.Linear(D, key_dim, bias=False)
        self.k_proj = nn.Linear(D, key_dim, bias=False)
        self.v_proj = nn.Linear(D, value_dim, bias=False)
        self.z_proj = nn.Linear(D, value_dim, bias=False)
        self.b_proj = nn.Linear(D, self.num_v_heads, bias=False)
        self.a_proj = nn.Linear(D, self.num_v_heads, bias=False)
        conv_channels = 2 * key_dim + value_dim
        self.conv1d = nn.Conv1d(
            conv_channels,
            conv_channels,
            kernel_size=config.linear_conv_kernel_dim,
            groups=conv_channels,
            padding=config.linear_conv_kernel_dim - 1,
            bias=False,
        )
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = OnboardHybridRMSNormGated(self.head_v_dim, eps=config.rms_norm_eps)
        self.out_proj = nn.Linear(value_dim, D, bias=False)

    def forward(self, x_BTD, attention_mask=None):
        B, T, _ = x_BTD.shape
        if attention_mask is not None:
            # Padded tokens write nothing: zero inputs give q = k = v = 0 after conv + SiLU.
            x_BTD = x_BTD * attention_mask[:, :, None].to(x_BTD.dtype)
        qkv_BTC = torch.cat([self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD)], dim=-1)
        # Depthwise causal conv: pad k-1 on both sides, keep the first T outputs.
        qkv_BTC = F.silu(self.conv1d(qkv_BTC.transpose(1, 2))[..., :T].transpose(1, 2))
        q, k, v = qkv_BTC.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q_BTHK = l2_normalize(q.reshape(B, T, self.num_k_heads, self.head_k_dim))
        k_BTHK = l2_normalize(k.reshape(B, T, self.num_k_heads, self.head_k_dim))
        v_BTHV = v.reshape(B, T, self.num_v_heads, self.head_v_dim)

        beta_BTH = torch.sigmoid(self.b_proj(x_BTD).float())
        g_BTH = -self.A_log.float().exp() * F.softplus(self.a_proj(x_BTD).float() + self.dt_bias.float())

        o_BTHV, _ = chunk_gated_delta_rule(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, chunk_size=self.chunk_size)
        z_BTHV = self.z_proj(x_BTD).reshape(B, T, self.num_v_heads, self.head_v_dim)
        o_BTHV = self.norm(o_BTHV, z_BTHV)
        return self.out_proj(o_BTHV.reshape(B, T, self.value_dim))


# --------------------------------------------------------------------------------------------
# Top-k sparse attention (DSA-style)


class OnboardHybridIndexer(nn.Module):
    """Lightning indexer: score[t, s] = sum_h w_h(t) * relu(q_h(t) . k(s)), causal, then top-k.

    Keys are shared across index heads; queries and keys get RoPE. The selection (`torch.topk`)
    is not differentiable, so the indexer's weights get no gradient from the language-model loss
    (DeepSeek-V3.2 trains them with a separate distillation objective).
    """

    def __init__(self, config: OnboardHybridConfig):
        super().__init__()
        D = config.hidden_size
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.topk = config.index_topk
        self.q_proj = nn.Linear(D, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(D, self.head_dim, bias=False)
        self.weights_proj = nn.Linear(D, self.n_heads, bias=False)
        self.rotary = OnboardHybridRotaryEmbedding(self.head_dim, config.rope_theta)

    def forward(self, x_BTD, position_ids_BT, attention_mask=None):
        """Returns a [B, T, T] bool mask of the kept keys (causal, at most `topk` per query)."""
        B, T, _ = x_BTD.shape
        cos, sin = self.rotary(position_ids_BT, x_BTD.dtype)
        q_BTHK = apply_rope(self.q_proj(x_BTD).reshape(B, T, self.n_heads, self.head_dim), cos, sin)
        k_BTK = apply_rope(self.k_proj(x_BTD)[:, :, None], cos, sin)[:, :, 0]
        w_BTH = self.weights_proj(x_BTD).float() * (self.n_heads**-0.5 * self.head_dim**-0.5)
        logits_BHTT = torch.relu(torch.einsum("bthk,bsk->bhts", q_BTHK, k_BTK).float())
        scores_BTT = torch.einsum("bhts,bth->bts", logits_BHTT, w_BTH)

        allowed_BTT = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x_BTD.device))[None]
        if attention_mask is not None:
            allowed_BTT = allowed_BTT & attention_mask[:, None, :].bool()
        scores_BTT = scores_BTT.masked_fill(~allowed_BTT, float("-inf"))
        kept = min(self.topk, T)
        index_BTS = scores_BTT.topk(kept, dim=-1).indices
        selected_BTT = torch.zeros_like(allowed_BTT.expand(B, T, T)).scatter(-1, index_BTS, True)
        # Early queries have fewer than `kept` allowed keys: topk then also returns masked ones.
        return selected_BTT & allowed_BTT


class OnboardHybridSparseAttention(nn.Module):
    """GQA softmax attention over the indexer's top-k keys, with a sigmoid output gate.

    Dense masked eager form: scores over all T keys, -inf outside the kept set, softmax in fp32.
    """

    def __init__(self, config: OnboardHybridConfig):
        super().__init__()
        D = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(D, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(D, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(D, self.num_kv_heads * self.head_dim, bias=bias)
        self.gate_proj = nn.Linear(D, self.num_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, D, bias=bias)
        if config.qk_norm:
            self.q_norm = OnboardHybridRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = OnboardHybridRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.indexer = OnboardHybridIndexer(config)

    def forward(self, x_BTD, cos, sin, position_ids_BT, attention_mask=None):
        B, T, _ = x_BTD.shape
        q_BTHK = self.q_proj(x_BTD).reshape(B, T, self.num_heads, self.head_dim)
        k_BTHK = self.k_proj(x_BTD).reshape(B, T, self.num_kv_heads, self.head_dim)
        v_BTHK = self.v_proj(x_BTD).reshape(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q_BTHK, k_BTHK = self.q_norm(q_BTHK), self.k_norm(k_BTHK)
        q_BTHK, k_BTHK = apply_rope(q_BTHK, cos, sin), apply_rope(k_BTHK, cos, sin)

        selected_BTT = self.indexer(x_BTD, position_ids_BT, attention_mask)
        # A fully padded query row keeps itself, so softmax never sees a row of -inf only.
        selected_BTT = selected_BTT | torch.eye(T, dtype=torch.bool, device=x_BTD.device)
        bias_B1TT = torch.zeros(selected_BTT.shape, dtype=torch.float32, device=x_BTD.device)
        bias_B1TT = bias_B1TT.masked_fill(~selected_BTT, float("-inf"))[:, None]

        group = self.num_heads // self.num_kv_heads
        q_BHTK = q_BTHK.transpose(1, 2)
        k_BHTK = k_BTHK.transpose(1, 2).repeat_interleave(group, dim=1)
        v_BHTK = v_BTHK.transpose(1, 2).repeat_interleave(group, dim=1)
        scores_BHTT = (q_BHTK @ k_BHTK.transpose(-1, -2)).float() * self.scaling + bias_B1TT
        probs_BHTT = scores_BHTT.softmax(dim=-1).to(v_BHTK.dtype)
        o_BTHK = (probs_BHTT @ v_BHTK).transpose(1, 2)

        o_BTX = o_BTHK.reshape(B, T, self.num_heads * self.head_dim) * torch.sigmoid(self.gate_proj(x_BTD))
        return self.o_proj(o_BTX)


# --------------------------------------------------------------------------------------------
# Mixture of experts


class OnboardHybridMLP(nn.Module):
    """Dense SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class OnboardHybridRouter(nn.Module):
    """Token -> top-k experts. Scores are softmax or sigmoid of a linear map, in fp32.

    Returns (router_logits [N, E], top_k_weights [N, k], top_k_index [N, k]).
    """

    def __init__(self, config: OnboardHybridConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.scoring_func = config.scoring_func
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))

    def forward(self, x_ND):
        logits_NE = F.linear(x_ND, self.weight).float()
        if self.scoring_func == "softmax":
            scores_NE = logits_NE.softmax(dim=-1)
        else:
            scores_NE = logits_NE.sigmoid()
        weights_NK, index_NK = scores_NE.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights_NK = weights_NK / (weights_NK.sum(dim=-1, keepdim=True) + 1e-20)
        weights_NK = weights_NK * self.routed_scaling_factor
        return logits_NE, weights_NK, index_NK


class OnboardHybridExperts(nn.Module):
    """E SwiGLU experts stored as 3-D weights: gate_up_proj [E, 2F, D], down_proj [E, D, F].

    forward(x [N, D], top_k_index [N, k], top_k_weights [N, k]) -> [N, D], where token n gets
    sum_j top_k_weights[n, j] * expert_{top_k_index[n, j]}(x_n). Both dispatches have fixed shapes:

    - "masked": loop over experts, each applied to all N tokens and scaled by the token's routed
      weight for it (zero when not routed). E/k times the routed FLOPs; any device and dtype.
    - "grouped_mm": sort the N*k token slots by expert (argsort), gather, two `torch._grouped_mm`
      calls with per-expert offsets, weight, scatter-add back. Offsets are data but not shapes.
    """

    def __init__(self, config: OnboardHybridConfig):
        super().__init__()
        E, D, Fi = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts = E
        self.intermediate_size = Fi
        self.dispatch = config.moe_dispatch
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * Fi, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, Fi))

    def forward(self, x_ND, top_k_index, top_k_weights):
        if self.dispatch == "grouped_mm":
            return self._forward_grouped_mm(x_ND, top_k_index, top_k_weights)
        return self._forward_masked(x_ND, top_k_index, top_k_weights)

    def _forward_masked(self, x_ND, top_k_index, top_k_weights):
        N = x_ND.shape[0]
        combine_NE = torch.zeros(N, self.num_experts, dtype=top_k_weights.dtype, device=x_ND.device)
        combine_NE = combine_NE.scatter_add(1, top_k_index, top_k_weights)
        out_ND = torch.zeros_like(x_ND)
        for e in range(self.num_experts):
            gate_NF, up_NF = F.linear(x_ND, self.gate_up_proj[e]).chunk(2, dim=-1)
            y_ND = F.linear(F.silu(gate_NF) * up_NF, self.down_proj[e])
            out_ND = out_ND + y_ND * combine_NE[:, e, None].to(y_ND.dtype)
        return out_ND

    def _forward_grouped_mm(self, x_ND, top_k_index, top_k_weights):
        N, top_k = top_k_index.shape
        expert_S = top_k_index.reshape(-1)
        order_S = expert_S.argsort(stable=True)
        token_S = order_S // top_k
        counts_E = torch.zeros(self.num_experts, dtype=torch.int32, device=x_ND.device)
        counts_E = counts_E.scatter_add(0, expert_S, torch.ones_like(expert_S, dtype=torch.int32))
        offsets_E = counts_E.cumsum(0, dtype=torch.int32)
        x_SD = x_ND[token_S]
        h_SF2 = torch._grouped_mm(x_SD, self.gate_up_proj.transpose(1, 2), offs=offsets_E)
        gate_SF, up_SF = h_SF2.chunk(2, dim=-1)
        y_SD = torch._grouped_mm(F.silu(gate_SF) * up_SF, self.down_proj.transpose(1, 2), offs=offsets_E)
        y_SD = y_SD * top_k_weights.reshape(-1)[order_S, None].to(y_SD.dtype)
        return torch.zeros_like(x_ND).index_add(0, token_S, y_SD)


class OnboardHybridSparseMoeBlock(nn.Module):
    """Routed experts + shared expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, config: OnboardHybridConfig):
        super().__init__()
        self.gate = OnboardHybridRouter(config)
        self.experts = OnboardHybridExperts(config)
        if config.shared_expert_intermediate_size > 0:
            self.shared_expert = OnboardHybridMLP(config.hidden_size, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x_BTD):
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        _, weights_NK, index_NK = self.gate(x_ND)
        out_ND = self.experts(x_ND, index_NK, weights_NK)
        if self.shared_expert is not None:
            out_ND = out_ND + self.shared_expert(x_ND) * torch.sigmoid(self.shared_expert_gate(x_ND))
        return out_ND.reshape(B, T, D)


# --------------------------------------------------------------------------------------------
# Decoder


class OnboardHybridDecoderLayer(nn.Module):
    def __init__(self, config: OnboardHybridConfig, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = OnboardHybridRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if is_sparse_attention(self.layer_type):
            self.self_attn = OnboardHybridSparseAttention(config)
        else:
            self.linear_attn = OnboardHybridGatedDeltaNet(config)
        self.post_attention_layernorm = OnboardHybridRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = OnboardHybridSparseMoeBlock(config)

    def forward(self, x_BTD, cos, sin, position_ids_BT, attention_mask=None):
        h_BTD = self.input_layernorm(x_BTD)
        if is_sparse_attention(self.layer_type):
            h_BTD = self.self_attn(h_BTD, cos, sin, position_ids_BT, attention_mask)
        else:
            h_BTD = self.linear_attn(h_BTD, attention_mask)
        x_BTD = x_BTD + h_BTD
        return x_BTD + self.mlp(self.post_attention_layernorm(x_BTD))


class OnboardHybridPreTrainedModel(PreTrainedModel):
    config_class = OnboardHybridConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["OnboardHybridDecoderLayer"]

    @torch.no_grad()
    def _init_weights(self, module):
        # `transformers.initialization` functions skip tensors already loaded from a checkpoint.
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Conv1d)):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, (OnboardHybridRMSNorm, OnboardHybridRMSNormGated)):
            init.ones_(module.weight)
        elif isinstance(module, OnboardHybridRouter):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, OnboardHybridExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, OnboardHybridGatedDeltaNet):
            # Per-head decay rates exp(A_log) spread over [1, 16], and softplus(dt_bias) = 1.
            init.copy_(module.A_log, torch.empty_like(module.A_log).uniform_(1.0, 16.0).log())
            init.constant_(module.dt_bias, torch.tensor(1.0).expm1().log().item())


class OnboardHybridModel(OnboardHybridPreTrainedModel):
    def __init__(self, config: OnboardHybridConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [OnboardHybridDecoderLayer(config, layer_type) for layer_type in resolve_layer_types(config)]
        )
        self.norm = OnboardHybridRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = OnboardHybridRotaryEmbedding(config.head_dim, config.rope_theta)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, **kwargs):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        B, T, _ = inputs_embeds.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=inputs_embeds.device)[None].expand(B, T)
        cos, sin = self.rotary_emb(position_ids, inputs_embeds.dtype)
        x_BTD = inputs_embeds
        for layer in self.layers:
            x_BTD = layer(x_BTD, cos, sin, position_ids, attention_mask)
        return self.norm(x_BTD)


class OnboardHybridForCausalLM(OnboardHybridPreTrainedModel, GenerationMixin):
    def __init__(self, config: OnboardHybridConfig):
        super().__init__(config)
        self.model = OnboardHybridModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
        self.generation_config.use_cache = False  # no KV cache (see prepare_inputs_for_generation)

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        """No KV cache: every step of `generate` runs the whole prefix (the default would feed
        only the new token once a cache exists)."""
        return {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False}

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        use_cache=False,
        **kwargs,
    ):
        """Causal LM forward. `use_cache` and cache kwargs are accepted and ignored (no KV cache).

        labels: [B, T] token ids (-100 ignored); the loss predicts labels[:, 1:] from logits[:, :-1].
        """
        hidden_BTD = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, inputs_embeds=inputs_embeds
        )
        logits = self.lm_head(hidden_BTD)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].float().reshape(-1, self.vocab_size),
                labels[:, 1:].reshape(-1).to(logits.device),
                ignore_index=-100,
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits)


__all__ = [
    "OnboardHybridForCausalLM",
    "OnboardHybridModel",
    "OnboardHybridPreTrainedModel",
    "chunk_gated_delta_rule",
    "recurrent_gated_delta_rule",
]
