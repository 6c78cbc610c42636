"""Parsing tiny proxies and classifying their blocks by structure."""

from __future__ import annotations

import json

import pytest

from onboarding.graph.opgraph import BLOCK_KINDS, OpGraph


def kinds_of(g):
    return {b.kind for b in g.blocks}


def test_qwen3_next(parse_model):
    g = parse_model("hf:qwen3_next")
    assert g.capture == "export"
    k = kinds_of(g)
    assert {"linear_attention.gated_delta", "attention.gated", "moe.router", "moe.experts",
            "moe.shared_expert", "norm.rms_gated", "conv.causal1d", "norm.rms", "rope",
            "embedding", "lm_head"} <= k
    assert "linear_attention.kimi_delta" not in k and "unknown" not in k
    assert g.layer_pattern == "DE DE DE AE"
    norm = g.by_kind("norm.rms")[0]
    assert norm.attrs["unit_offset"] is True  # Qwen3-Next scales by (1 + weight)


def test_kimi_linear(parse_model):
    g = parse_model("hf:kimi_linear")
    k = kinds_of(g)
    assert {"linear_attention.kimi_delta", "attention.mla", "moe.router", "moe.experts",
            "moe.shared_expert", "mlp.dense", "norm.rms_gated", "conv.causal1d"} <= k
    assert "linear_attention.gated_delta" not in k and "unknown" not in k
    # the forget gate's low-rank projection (f_b(f_a(x)), no activation between) is the
    # attention's, no MLP: before, `KFF KEF KEF KEF ME`
    assert g.layer_pattern == "KF KE KE KE ME"
    kda = g.by_kind("linear_attention.kimi_delta")[0]
    assert kda.attrs["per_channel_decay"] is True
    assert g.by_kind("norm.rms_gated")[0].attrs["gate_activation"] == "sigmoid"


def test_deepseek_v32(parse_model):
    g = parse_model("hf:deepseek_v32")
    k = kinds_of(g)
    assert {"sparse_attention.topk", "moe.router", "moe.experts", "moe.shared_expert",
            "mlp.dense", "norm.layer"} <= k
    sparse = g.by_kind("sparse_attention.topk")[0]
    assert sparse.attrs["layout"] == "mla" and sparse.attrs["indexer_relu"]
    router = g.by_kind("moe.router")[0]
    assert router.attrs["scoring"] == "sigmoid" and router.attrs["group_limited"]
    assert "unknown" not in k


def test_router_over_as_many_experts_as_tokens_is_not_attention(parse_model):
    # A router's softmax/top-k over n_experts == seq looks like attention scores by shape; its
    # logits come from a weight projection, not from q.k^T.
    from onboarding.load.model import load_model
    from onboarding.graph.parse import load_stage, parse_stage

    info = load_stage(load_model("hf:qwen3_moe"))
    n_experts = info.proxy_config.num_experts
    assert n_experts > info.proxy_config.num_experts_per_tok  # a real choice of experts
    g = parse_stage(info, seq=n_experts)  # as many tokens as experts
    k = kinds_of(g)
    assert "moe.router" in k and not k & {"sparse_attention.topk", "unknown"}


_SELECT_ALL = '''
import torch
from torch import nn


class Selector(nn.Module):
    """Scores 8 slots with a linear and keeps the top K of them, then mixes a value per slot."""

    def __init__(self, d=32, k=8):
        super().__init__()
        self.k = k
        self.score = nn.Linear(d, 8, bias=False)
        self.values = nn.Parameter(torch.randn(8, d))

    def forward(self, x):
        w, idx = self.score(x).softmax(-1).topk(self.k, dim=-1)
        return x + (w[..., None] * self.values[idx]).sum(-2)


class SelectLM(nn.Module):
    def __init__(self, vocab=97, d=32, k=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.sel = Selector(d, k)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        return self.head(self.sel(self.embed(ids)))


class SelectAllLM(SelectLM):
    def __init__(self):
        super().__init__(k=8)


class SelectTwoLM(SelectLM):
    def __init__(self):
        super().__init__(k=2)
'''


def test_a_top_k_of_every_scored_slot_is_no_router(parse_model, tmp_path):
    """A linear to 8 logits with a top-8 of them keeps everything it scores: no routing (as
    DeepSeek-V4's compressed-attention indexer on a short proxy sequence). The same module with
    a top-2 is a router."""
    path = tmp_path / "select.py"
    path.write_text(_SELECT_ALL)
    routers = {name: [b.path for b in parse_model(f"{path}:{name}").by_kind("moe.router")]
               for name in ("SelectAllLM", "SelectTwoLM")}
    assert routers == {"SelectAllLM": [], "SelectTwoLM": ["sel"]}, routers


@pytest.mark.parametrize("ref", ["hf:qwen3_moe", "hf:mixtral"])
def test_plain_moe(parse_model, ref):
    g = parse_model(ref)
    k = kinds_of(g)
    assert {"attention.full", "moe.router", "moe.experts", "norm.rms", "rope"} <= k
    assert not k & {"moe.shared_expert", "mlp.dense", "unknown"}
    from onboarding.load.model import load_model
    from onboarding.graph.parse import load_stage

    r = g.by_kind("moe.router")[0]
    top_k = load_stage(load_model(ref)).proxy_config.num_experts_per_tok  # the proxy's config
    assert r.attrs["scoring"] == "softmax" and r.attrs["top_k"] == top_k >= 2


def test_example_hybrid(parse_model):
    g = parse_model("onboard_hybrid")
    k = kinds_of(g)
    assert {"linear_attention.gated_delta", "sparse_attention.topk", "moe.router",
            "moe.experts", "moe.shared_expert", "norm.rms_gated", "conv.causal1d"} <= k
    assert "unknown" not in k
    mixers = [p[0] for p in g.layer_pattern.split()]
    assert mixers.count("D") == 3 * mixers.count("S")  # 3/4 linear attention


def test_example_dense(parse_model):
    g = parse_model("tiny_dense")
    assert {"attention.full", "mlp.dense", "norm.rms", "embedding", "lm_head"} <= kinds_of(g)


def test_export_failure_falls_back_and_still_classifies(parse_model):
    g = parse_model("tests/fixtures/user_models.py:DataDependentMoELM")
    assert g.capture == "dispatch"
    assert "torch.export failed" in g.capture_note
    k = kinds_of(g)
    assert {"attention.full", "moe.router", "moe.experts", "norm.layer", "embedding",
            "lm_head"} <= k
    experts = g.by_kind("moe.experts")[0]
    assert experts.attrs["layout"] == "module_list" and experts.attrs["n_experts"] == 4
    assert "unknown" not in k


def test_every_block_has_evidence_shapes_and_cost(parse_model):
    g = parse_model("hf:qwen3_next")
    for b in g.blocks:
        assert b.kind in BLOCK_KINDS
        assert b.evidence, b.path
        assert b.op_histogram, b.path
        if b.kind not in ("rope",):
            assert b.inputs and b.outputs, b.path
        if b.kind.startswith(("attention", "linear_attention", "moe.experts", "mlp")):
            assert b.flops > 0 and b.bytes > 0, b.path


def test_unseen_structure_is_unknown_not_guessed(tmp_path):
    src = tmp_path / "odd.py"
    src.write_text(
        "import torch\nfrom torch import nn\n"
        "class Mixer(nn.Module):\n"
        "    def __init__(s):\n        super().__init__()\n"
        "        s.a = nn.Linear(16, 16)\n        s.b = nn.Linear(16, 16)\n"
        "    def forward(s, x):\n        return s.b(torch.cos(s.a(x)) * x)\n"
        "class Odd(nn.Module):\n"
        "    def __init__(s):\n        super().__init__()\n"
        "        s.embed = nn.Embedding(50, 16)\n        s.mix = Mixer()\n"
        "    def forward(s, ids):\n        return s.mix(s.embed(ids))\n")
    from onboarding.load.model import load_model
    from onboarding.graph.parse import load_stage, parse_stage

    g = parse_stage(load_stage(load_model(f"{src}:Odd")))
    assert g.by_kind("unknown")[0].path == "mix"


def test_opgraph_json_roundtrip(parse_model, tmp_path):
    g = parse_model("hf:mixtral")
    g.save(tmp_path / "opgraph.json")
    back = OpGraph.load(tmp_path / "opgraph.json")
    assert back.to_dict() == json.loads((tmp_path / "opgraph.json").read_text())
    assert [b.kind for b in back.blocks] == [b.kind for b in g.blocks]


def test_unreadable_export_graph_falls_back_to_the_dispatch_recording(parse_model):
    g = parse_model("tests/fixtures/user_models.py:UnbackedSizeLM")
    assert g.capture == "dispatch" and "graph could not be read" in g.capture_note
    assert {"embedding", "lm_head"} <= kinds_of(g)


@pytest.mark.parametrize("ref,kinds", [
    # attention with a sink column, alternating sliding/full layers, clamped experts
    ("hf:gpt_oss", {"attention.sliding", "attention.full", "moe.router", "moe.experts"}),
    # mamba mixers beside attention, MoE every other layer (its parse took 33 s in CI: nightly)
    pytest.param("hf:jamba", {"linear_attention.mamba", "attention.full", "moe.experts", "mlp.dense",
                              "conv.causal1d"}, marks=pytest.mark.slow),
    # torch.export fails on its zero-expert routing: in the dispatch recording SDPA runs its math
    # path (bmm, _safe_softmax, bmm) and the two MLA attentions per layer must still read as such
    ("hf:longcat_flash", {"attention.mla", "moe.router", "moe.experts", "mlp.dense"}),
])
def test_architectures_beyond_the_dev_set(parse_model, ref, kinds):
    k = kinds_of(parse_model(ref))
    assert kinds <= k and "unknown" not in k


def test_a_loop_over_time_is_a_recurrent_mixer_not_a_gated_mlp(parse_model):
    """Projections around a Python loop over the positions (sigmoid-gated output, products,
    four projections from the width and back) are a recurrence, `linear_attention.other`, which
    coverage lists as an uncovered core; before this rule the MLP rule read it as a gated SiLU
    MLP and claimed the swiglu kernel."""
    from onboarding.coverage import build_coverage

    g = parse_model("tests/fixtures/uncovered_models.py:LoopLM", seq=12)  # short: export unrolls the loop
    mixers = [b for b in g.blocks if b.path.endswith(".mixer")]
    assert len(mixers) == 2
    for b in mixers:
        assert b.kind == "linear_attention.other", (b.path, b.kind, b.evidence)
        assert b.attrs == {"recurrence": "time_loop", "steps": 12}
    cov = build_coverage(g)
    core = [e for e in cov.entries if e.path.endswith(".mixer") and e.status == "uncovered"]
    assert [e.op for e in core] == ["linear-attention recurrence"] * 2
    assert not any(e.family == "swiglu" for e in cov.entries)


def test_a_gated_short_conv_is_a_token_mixer_not_an_mlp(parse_model):
    """Projections around a causal depthwise conv over the sequence, its input and output gated
    by elementwise products (LFM2's ShortConv, written here as our own fixture) mix tokens: a
    `conv.gated` mixer (letter C), not a dense MLP with an unknown ("other") activation as the
    MLP rule read it before; the conv stays its own `conv.causal1d` block, which the conv1d family
    serves, and the mixer's projections are GEMMs (nothing uncovered, no MLP kernel claimed)."""
    from onboarding.coverage import build_coverage

    g = parse_model("tests/fixtures/conv_mixer_models.py:GatedConvLM", seq=12)
    by = {b.path: b for b in g.blocks}
    assert g.layer_pattern == "CF CF"
    for i in (0, 1):
        mixer = by[f"layers.{i}.mixer"]
        assert mixer.kind == "conv.gated", (mixer.kind, mixer.evidence)
        assert mixer.attrs == {"conv": f"layers.{i}.mixer.conv", "channels": 16, "kernel_size": 3,
                               "input_gate": True, "output_gate": True, "hidden": 16,
                               "projected": 48}
        assert by[f"layers.{i}.mixer.conv"].kind == "conv.causal1d"
        assert by[f"layers.{i}.mlp"].kind == "mlp.dense"
    cov = build_coverage(g)
    mixer_entries = [e for e in cov.entries if e.path.endswith(".mixer")]
    assert {(e.op, e.status) for e in mixer_entries} == {("projections (GEMM)", "torch_fast")}
    assert {e.family for e in cov.entries if e.path.endswith(".mixer.conv")} == {"conv1d"}
    assert not cov.by_status("uncovered")


def test_an_ungated_conv_mixer_is_unknown_not_an_mlp(parse_model):
    """The same projections and conv with no product around the conv: no rule explains it, so it
    is one `unknown` block at the mixer (the split-out conv does not cut it into projections),
    never a dense MLP."""
    g = parse_model("tests/fixtures/conv_mixer_models.py:UngatedConvLM", seq=12)
    by = {b.path: b for b in g.blocks}
    assert g.layer_pattern == "?F ?F"
    assert by["layers.0.mixer"].kind == "unknown"
    assert by["layers.0.mixer.conv"].kind == "conv.causal1d"
    assert not any(b.kind == "mlp.dense" and ".mixer" in b.path for b in g.blocks)


def test_lfm3_short_conv_is_a_gated_conv_mixer(parse_model):
    """LFM3's ShortConv layers (in_proj to B, C, x; B * x; a causal depthwise conv through
    transformers' causal_conv1d_fn, whose conv op runs in the mixer's own forward; C * y;
    out_proj): `conv.gated`, so the layer pattern shows a mixer in every layer."""
    g = parse_model("hf:lfm3")
    mixers = [b for b in g.blocks if b.kind == "conv.gated"]
    assert mixers and all(b.path.endswith(".conv") for b in mixers)
    assert all(b.attrs["input_gate"] and b.attrs["output_gate"] for b in mixers)
    assert all(b.attrs["projected"] == 3 * b.attrs["channels"] for b in mixers)
    assert all(tok[0] != "-" for tok in g.layer_pattern.split())  # every layer has a mixer
    assert not any(b.kind == "mlp.dense" and b.path.endswith(".conv") for b in g.blocks)


def test_headwise_weights_in_a_loop_over_time_are_no_experts(parse_model):
    """A recurrence whose gate projection holds per-head [heads, w, w] weights (stacked like
    packed experts, every token through every head, nothing routing) inside a loop over the
    positions, wrapped by x / gate projections and a causal conv (Griffin's recurrent block,
    RecurrentGemma's RG-LRU; our own fixture): one `linear_attention.other` mixer holding the
    recurrence, not `moe.experts` inside a gelu-gated `mlp.dense` as before."""
    from onboarding.coverage import build_coverage

    g = parse_model("tests/fixtures/conv_mixer_models.py:ConvRecurrentLM", seq=12)
    by = {b.path: b for b in g.blocks}
    assert g.layer_pattern == "LF LF"
    mixer = by["layers.0.mixer"]
    assert mixer.kind == "linear_attention.other", (mixer.kind, mixer.evidence)
    assert mixer.attrs == {"recurrence": "time_loop", "steps": 12, "conv": "layers.0.mixer.conv"}
    assert "layers.0.mixer.rec" not in by and "rec.w" in mixer.params  # taken into the mixer
    assert mixer.op_histogram.get("bmm") == 1  # the recurrence's ops count in the mixer
    assert not any(b.kind.startswith("moe.") for b in g.blocks)
    cov = build_coverage(g)
    assert [e.op for e in cov.by_status("uncovered")] == ["linear-attention recurrence"] * 2


def test_a_gated_output_projection_is_the_attentions_not_an_mlp(parse_model):
    """An output projection module handed the attention output and the layer input, gating the
    first by sigmoid(gate(second)) before the out projection (Inkling 2's; our own fixture): the
    MLP rule read D -> F, sigmoid product, F -> D as a written-out SiLU MLP (`AF` and the swiglu
    kernel's claim); the module is given a tensor of width F, so the product gates that input,
    and the attention takes the module in as `attention.gated`."""
    g = parse_model("tests/fixtures/gated_out_models.py:GatedOutLM", seq=12)
    assert g.layer_pattern == "A- A-"
    by = {b.path: b for b in g.blocks}
    assert by["layers.0.attn"].kind == "attention.gated", by["layers.0.attn"].evidence
    assert not any(b.kind == "mlp.dense" for b in g.blocks)


def test_a_router_scored_by_an_mlp_is_a_router_not_a_dense_mlp(parse_model):
    """ZAYA's router: a down projection, then an MLP (norm, two gelu layers, a projection to the
    experts plus a skip slot), softmax and top-k. The MLP was read as the layer's dense MLP (the
    `F` in `A?EF`) and no router was found; the router now takes its scorer in (`scorer: mlp`),
    which the moe_router family (one [E, D] linear) does not serve."""
    from onboarding.coverage import build_coverage

    g = parse_model("hf:zaya")
    by = {b.path: b for b in g.blocks}
    router = by["model.layers.0.mlp.gate"]
    assert router.kind == "moe.router" and router.attrs["scorer"] == "mlp", router.evidence
    assert "model.layers.0.mlp.gate.router_mlp" not in by
    assert "F" not in g.layer_pattern
    cov = build_coverage(g)
    entries = [e for e in cov.entries if e.path == router.path]
    assert not any(e.family == "moe_router" for e in entries)
    assert ("router scoring + top-k", "uncovered") in {(e.op, e.status) for e in entries}


@pytest.mark.slow  # 50.6 s under -n 2 on a 2-core host (forty-ninth session, --durations)
def test_zamba_multihead_mamba_is_a_recurrence_not_experts(parse_model):
    """Zamba's Mamba mixer keeps per-head [H, ., .] weights (x_proj, dt_proj, A_log) and, on the
    CPU, scans in a Python loop over the positions: it read as `moe.experts` (H "experts", no
    router); a loop over time whose 3-D weights are used whole (no expert taken one at a time)
    is a recurrence, `linear_attention.other`."""
    g = parse_model("hf:zamba")
    mixers = [b for b in g.blocks if b.path.endswith(".mamba")]
    assert mixers and all(b.kind == "linear_attention.other" for b in mixers), \
        [(b.path, b.kind) for b in mixers]
    assert not any(b.kind.startswith("moe.") for b in g.blocks)


# RWKV-4 (its WKV time mix is a loop over the positions on the CPU; its channel mix gates the
# output, after the last projection: no gated MLP); a 10-20 s parse: nightly
@pytest.mark.slow
def test_rwkv_time_mix_is_a_recurrence_and_its_channel_mix_no_gated_mlp(parse_model):
    g = parse_model("hf:rwkv")
    by = {b.path: b for b in g.blocks}
    mix = by["rwkv.blocks.0.attention"]
    assert mix.kind == "linear_attention.other" and mix.attrs["recurrence"] == "time_loop"
    ffn = by["rwkv.blocks.0.feed_forward"]
    assert ffn.kind == "mlp.dense" and ffn.attrs["gated"] is False


@pytest.mark.parametrize("ref,path,attrs", [
    ("hf:mamba", "backbone.layers.0.mixer", {"norm_dt": False, "norm_bc": False, "dt_rank": 48}),
    # weighted RMS norms of dt, B and C (Jamba, dt_rank 256; parsed above too), weightless ones
    # (Falcon-Mamba); both nightly, a 10-33 s parse each
    pytest.param("hf:jamba", "model.layers.0.mamba", {"norm_dt": True, "norm_bc": True, "dt_rank": 256},
                 marks=pytest.mark.slow),
    pytest.param("hf:falcon_mamba", "backbone.layers.0.mixer",
                 {"norm_dt": True, "norm_bc": True, "dt_rank": 48}, marks=pytest.mark.slow),
])
def test_mamba1_mixers_are_read_by_structure(parse_model, ref, path, attrs):
    """A Mamba-1 mixer (per-channel [inner, state] decay, softplus step, x_proj / dt_proj, conv)
    is a selective-scan `linear_attention.mamba` block at the mixer's own path, with its widths;
    before, its ops were left unclaimed and Jamba's reached the whole model, where the mask's
    integer cumsum read as a decay."""
    g = parse_model(ref)
    mixers = [b for b in g.blocks if b.kind == "linear_attention.mamba"]
    assert mixers and all(b.path.endswith((".mixer", ".mamba")) for b in mixers), \
        [b.path for b in mixers]
    block = next(b for b in mixers if b.path == path)
    assert block.attrs["scan"] == "selective" and block.attrs["per_channel_decay"]
    assert {k: block.attrs[k] for k in ("inner", "state", "conv_width", "has_d", "gate")} == {
        "inner": 256, "state": 16, "conv_width": 4, "has_d": True, "gate": "silu"}
    assert {k: block.attrs[k] for k in attrs} == attrs
    assert "unknown" not in kinds_of(g)


@pytest.mark.parametrize("ref,style", [
    # gate clamped from above, up on both sides, then g * sigmoid(1.702 g) * (up + 1)
    ("hf:gpt_oss", {"clamp": 7.0, "clamp_style": "pre_act", "alpha": 1.702, "up_offset": 1.0}),
    # the same clamps before a plain SiLU
    ("hf:deepseek_v4", {"clamp": 10.0, "clamp_style": "pre_act"}),
])
def test_clamped_experts_carry_their_clamp_style(parse_model, ref, style):
    """The clamp's place and the GLU's scalars, read off the op order, so that a clamped
    SwiGLU can be matched (and patching then checks it against the block's own output)."""
    pytest.importorskip(f"transformers.models.{ref[3:]}")
    experts = parse_model(ref).by_kind("moe.experts")[0]
    assert {k: experts.attrs.get(k) for k in style} == style
    assert "up_offset" in style or "up_offset" not in experts.attrs


def test_layer_norm_written_in_torch_ops_is_no_rms_norm(parse_model):
    """Cohere's LayerNorm (mean subtracted, then mean of squares and rsqrt, in torch ops) is a
    norm.layer: as norm.rms the RMSNorm kernel would be matched to it (and rejected at patch)."""
    g = parse_model("hf:cohere2_moe")
    kinds = {b.class_name: b.kind for b in g.blocks if "Norm" in b.class_name}
    assert kinds.get("Cohere2MoeLayerNorm") == "norm.layer", kinds
    assert all(k == "norm.rms" for c, k in kinds.items() if "RMSNorm" in c)


def test_rms_norm_with_its_inverse_root_as_pow(parse_model):
    """Gemma 4's RMSNorm writes the inverse root as pow(mean_sq, -0.5), not rsqrt: still a
    norm.rms (before, its ops fell into the decoder layer's own block)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if "gemma4_text" not in CONFIG_MAPPING_NAMES:
        pytest.skip("this transformers has no gemma4_text")
    g = parse_model("hf:gemma4_text")
    norms = [b for b in g.blocks if b.class_name == "Gemma4RMSNorm"]
    assert norms and all(b.kind == "norm.rms" for b in norms), {b.kind for b in norms}


def test_rope_tables_of_several_widths_pin_no_width(parse_model):
    """Gemma 4's rotary module makes one cos/sin table per layer type, sliding and full of
    different widths, in the order of a Python set (hash-seeded): the block pins no width (a rope
    kernel pinned to the first table's would refuse the other layers' calls) and lists both."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from onboarding.families.discover import match_block

    if "gemma4_text" not in CONFIG_MAPPING_NAMES:
        pytest.skip("this transformers has no gemma4_text")
    ropes = [b for b in parse_model("hf:gemma4_text").blocks if b.kind == "rope"]
    assert len(ropes) == 1
    dims = ropes[0].attrs["rotary_dims"]
    assert ropes[0].attrs["rotary_dim"] is None and len(dims) == 2 and dims == sorted(dims)
    assert [(f, m["params"]["rotary_dim"]) for f, m in match_block(ropes[0])] == [("rope", None)]


@pytest.mark.parametrize("ref, cls, act, gated", [
    ("hf:apertus1p5_text", "Apertus1p5TextMLP", "other", False),  # up -> xIELU (softplus / expm1 / where) -> down
    ("hf:minimax_m3_vl_text", "MiniMaxM3VLDenseMLP", "silu", True),  # clamped g * sigmoid(alpha g) * (up + 1)
])
def test_dense_mlp_with_a_written_out_activation(parse_model, ref, cls, act, gated):
    """Two projections out of the model width and back with only elementwise ops between are
    an MLP even when no named activation op says which (both were `unknown` blocks); the
    activation's own products do not make it gated."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if ref.removeprefix("hf:") not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"this transformers has no {ref}")
    g = parse_model(ref)
    blocks = [b for b in g.blocks if b.class_name == cls]
    assert blocks and all(b.kind in ("mlp.dense", "moe.shared_expert") for b in blocks), \
        {b.kind for b in blocks}
    assert {b.attrs["activation"] for b in blocks} == {act}
    assert {b.attrs["gated"] for b in blocks} == {gated}
    assert not [b for b in g.blocks if b.kind == "unknown"]


def test_capture_keeps_string_and_scalar_keyword_arguments():
    """gelu's approximate="tanh" (a keyword, a string) survives both captures: it is what tells
    the tanh GELU from the exact one."""
    import torch
    from torch import nn

    from onboarding.graph import capture

    class TwoGelus(nn.Module):
        def forward(self, x):
            return nn.functional.gelu(x, approximate="tanh") + nn.functional.gelu(x)

    x = torch.randn(3, 4)
    for cap in (capture.capture(TwoGelus(), (x,), {}), capture.record_eager(TwoGelus(), (x,), {})):
        gelus = [r.kwargs for r in cap.records if r.op == "gelu"]
        assert gelus == [{"approximate": "tanh"}, {}], (cap.method, gelus)


def test_transformers_kernel_wrappers_take_their_torch_path_on_cpu_runs(monkeypatch):
    """transformers' kernel-with-fallback wrappers call an importable kernel package whatever the
    device (fla on a GPU machine, with Qwen3-Next): parsing's CPU forward runs their torch
    function instead, as torch.export does, and the switch is undone afterwards."""
    import sys
    import types

    import torch
    from torch import nn

    hub_kernels = pytest.importorskip("transformers.integrations.hub_kernels")
    if not hasattr(hub_kernels, "use_kernel_func_from_hub_with_fallback"):
        pytest.skip("this transformers has no kernel-with-fallback wrappers")
    from onboarding.graph import capture
    from onboarding.graph.torch_paths import torch_reference_paths

    pkg = types.ModuleType("onboard_fake_gpu_kernels")

    def doubled(x):  # what a Triton kernel does with CPU tensors
        raise RuntimeError("0 active drivers ([]). There should only be one.")

    pkg.doubled = doubled
    monkeypatch.setitem(sys.modules, "onboard_fake_gpu_kernels", pkg)

    @hub_kernels.use_kernel_func_from_hub_with_fallback("doubled", "onboard_fake_gpu_kernels")
    def doubled_torch(x):
        return x * 2

    class UsesWrapper(nn.Module):
        def forward(self, x):
            return doubled_torch(x) + 1

    with pytest.raises(RuntimeError, match="active drivers"):
        UsesWrapper()(torch.ones(2))  # the wrapper picked the package
    rec = capture.record_eager(UsesWrapper(), (torch.ones(2),), {})
    assert {r.op for r in rec.records} >= {"mul", "add"}
    with torch_reference_paths():
        assert torch.equal(UsesWrapper()(torch.ones(2)), torch.full((2,), 3.0))
    with pytest.raises(RuntimeError, match="active drivers"):
        UsesWrapper()(torch.ones(2))  # undone


def test_a_gpu_kernel_library_on_cpu_tensors_is_named():
    """Model code that picked a GPU kernel package (importable here) fails on parsing's CPU
    tensors inside Triton's launcher: the error names that package. Frames of an installed
    package and of triton are stood in for by code compiled under such file names."""
    import torch
    from torch import nn

    from onboarding.graph import capture
    from onboarding.errors import ModelRunError

    def module_at(path: str, src: str) -> dict:
        ns: dict = {}
        exec(compile(src, path, "exec"), ns)
        return ns

    site = "/env/lib/python3.12/site-packages"
    launcher = module_at(f"{site}/triton/runtime/jit.py", "def run(x):\n"
                         "    raise ValueError('Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)')\n")
    kernels = module_at(f"{site}/fastlinattn/ops/chunk.py", "def chunk(x, run):\n    return run(x)\n")

    class PicksKernels(nn.Module):
        def forward(self, x):
            return kernels["chunk"](x, launcher["run"])

    with pytest.raises(ModelRunError, match=r"Pointer argument.*Triton kernel of 'fastlinattn'.*without 'fastlinattn'"):
        capture.record_eager(PicksKernels(), (torch.randn(2, 3),), {})
    # any other failure keeps its message as it was
    with pytest.raises(ModelRunError) as err:
        capture.record_eager(nn.Linear(3, 2), (torch.randn(2, 4),), {})
    assert "Triton" not in str(err.value)


def test_parse_of_a_built_model_equals_a_fresh_build(parse_model):
    """Training's set-up hands `parse_stage` the model it built (one billion-parameter build, not
    two): the op graph equals the one from parse_stage's own build, the weights are untouched and
    the model's train mode comes back."""
    import torch

    from onboarding.graph.parse import parse_stage
    from onboarding.train import setup as S
    from onboarding.train.config import TrainConfig

    cfg = TrainConfig(model="hf:qwen3_moe", proxy="tiny", dtype="fp32", device="cpu")
    info = S.model_info(cfg)
    model = S.base_model(cfg, info).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert (S.PARSE_SEQ, cfg.seed) == (64, 0)  # parse_stage's defaults: the session's cached parse
    fresh = parse_model("hf:qwen3_moe")  # parse_stage's own build
    given = parse_stage(info, seq=S.PARSE_SEQ, seed=cfg.seed, model=model)
    assert json.dumps(given.to_dict(), sort_keys=True) == json.dumps(fresh.to_dict(), sort_keys=True)
    assert model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_weight_used_through_a_transpose_is_a_gemm_for_coverage(parse_model):
    """Projections written `x @ W.T` (Falcon's FalconLinear; our own TransposedWeightLM here) are
    `matmul` ops in the export capture, where F.linear is `linear`: the blocks count them
    (`weight_matmuls`) and coverage lists them as GEMMs like linears. Before, the non-gated GELU
    MLP had no fast path ("no family, template or fast path": 2 uncovered) and the attention no
    projections entry. The attention core (fused SDPA) is no weight matmul."""
    from onboarding.coverage import build_coverage

    g = parse_model("tests/fixtures/sweep3_models.py:TransposedWeightLM", seq=12)
    by = {b.path: b for b in g.blocks}
    assert g.layer_pattern == "AF AF"
    for i in (0, 1):
        assert by[f"layers.{i}.mlp"].kind == "mlp.dense"
        assert by[f"layers.{i}.mlp"].attrs["weight_matmuls"] == 2
        assert by[f"layers.{i}.attn"].attrs == {  # qkv and o; the SDPA core's heads, widths
            "weight_matmuls": 2, "core_widths": {"heads": 2, "d_qk": 8, "d_v": 8}}
    assert "weight_matmuls" not in by["lm_head"].attrs  # F.linear
    cov = build_coverage(g)
    assert not cov.by_status("uncovered")
    for i in (0, 1):
        for part in ("mlp", "attn"):
            assert [e.reason for e in cov.entries if e.path == f"layers.{i}.{part}"
                    and e.op == "projections (GEMM)"] == ["2 dense GEMMs: cuBLAS"]


def test_a_dense_squared_relu_is_named_as_the_experts_name_it(parse_model):
    """relu(x)^2 in a dense MLP (BitNet's, Arcee's) is `relu2`, as the experts rule names it; it
    read "relu" before."""
    g = parse_model("tests/fixtures/sweep3_models.py:ReluSquaredLM", seq=12)
    mlps = [b for b in g.blocks if b.kind == "mlp.dense"]
    assert len(mlps) == 2 and {b.attrs["activation"] for b in mlps} == {"relu2"}
    assert {b.attrs["gated"] for b in mlps} == {False}


@pytest.mark.parametrize("ref", ["hf:bitnet", "hf:arcee"])
def test_relu2_dense_mlps_of_transformers_models(parse_model, ref):
    g = parse_model(ref)
    assert {b.attrs["activation"] for b in g.blocks if b.kind == "mlp.dense"} == {"relu2"}


def test_a_conv_after_the_callers_left_pad_is_causal(parse_model):
    """An unpadded depthwise conv whose input the caller padded on the left only is causal: by
    K-1 (our own LeftPadConvLM: the gated conv mixer of GatedConvLM written with F.pad), and by
    more, for a conv after it (ChainedPadConvLM: ZAYA's CCA pads (2-1) + (3-1) for a depthwise
    then a grouped conv). Both were `unknown`, causal: false (`?` in the pattern). The conv1d
    family serves `left_pad` (its binding intercepts the unpadded call too:
    tests/kernel_tests/test_conv1d.py). A pad on both sides is no causal conv."""
    from onboarding.coverage import build_coverage

    g = parse_model("tests/fixtures/sweep3_models.py:LeftPadConvLM", seq=12)
    by = {b.path: b for b in g.blocks}
    assert g.layer_pattern == "CF CF"  # as GatedConvLM, whose conv pads itself
    conv = by["layers.0.mixer.conv"]
    assert conv.kind == "conv.causal1d", conv.evidence
    assert conv.attrs == {"channels": 16, "kernel_size": 3, "activation": None,
                          "followed_by": None, "causal": True, "left_pad": 2}
    assert by["layers.0.mixer"].kind == "conv.gated"
    cov = build_coverage(g)
    assert {(e.op, e.status) for e in cov.entries if e.path == "layers.0.mixer.conv"} == \
        {("conv1d", "template")}

    g = parse_model("tests/fixtures/sweep3_models.py:ChainedPadConvLM", seq=12)
    by = {b.path: b for b in g.blocks}
    dw = by["layers.0.mixer.depthwise"]
    assert dw.kind == "conv.causal1d" and dw.attrs["left_pad"] == 3 and dw.attrs["kernel_size"] == 2

    g = parse_model("tests/fixtures/sweep3_models.py:CenteredPadConvLM", seq=12)
    conv = {b.path: b for b in g.blocks}["layers.0.mixer.conv"]
    assert conv.kind == "conv.noncausal1d" and conv.attrs["causal"] is False
    assert "left_pad" not in conv.attrs and conv.attrs["padding"] == [1, 1]


def test_zaya_cca_depthwise_conv_is_causal(parse_model):
    """ZAYA's CCA pads the sequence for its two chained convs itself: its depthwise conv is
    causal (`conv.causal1d`, left_pad 2 for kernels 2 and 2); its layers read `AE`, not `A?E`."""
    g = parse_model("hf:zaya")
    convs = [b for b in g.blocks if b.path.endswith("conv_qk_depthwise")]
    assert convs and {b.kind for b in convs} == {"conv.causal1d"}
    # the default config's kernels: depthwise 2, grouped 2: the pad is (2 - 1) + (2 - 1)
    assert {(b.attrs["kernel_size"], b.attrs["left_pad"]) for b in convs} == {(2, 2)}
    assert "?" not in g.layer_pattern


@pytest.mark.parametrize("model, padding", [("CentredConvLM", [2, 2]), ("SamePadConvLM", [1, 2])])
def test_a_noncausal_conv_mixer_is_a_bidirectional_conv_mixer_not_an_mlp(parse_model, model,
                                                                        padding):
    """A gated conv mixer whose depthwise conv over the sequence pads both sides (our own
    fixtures: a centred window, padding (K-1)/2; padding="same" with an even kernel, 1 left and
    2 right, read off the output length as torch keeps no string among the op's scalars): every
    output sees later positions, so the conv is `conv.noncausal1d` (uncovered: the conv1d family
    serves causal convs only) and the module around it a `conv.gated` mixer with `causal` false.
    Before, the conv was `unknown` and the mixer a dense MLP ("other") as the MLP rule looked
    at causal convs only: `?FF ?FF`."""
    from onboarding.coverage import build_coverage

    g = parse_model(f"tests/fixtures/noncausal_conv_models.py:{model}", seq=12)
    by = {b.path: b for b in g.blocks}
    assert g.layer_pattern == "CF CF"
    kernel = {"CentredConvLM": 5, "SamePadConvLM": 4}[model]
    for i in (0, 1):
        conv = by[f"layers.{i}.mixer.conv"]
        assert conv.kind == "conv.noncausal1d", (conv.kind, conv.evidence)
        assert conv.attrs == {"channels": 16, "kernel_size": kernel, "activation": None,
                              "followed_by": None, "causal": False, "padding": padding}
        mixer = by[f"layers.{i}.mixer"]
        assert mixer.kind == "conv.gated", (mixer.kind, mixer.evidence)
        assert mixer.attrs == {"conv": f"layers.{i}.mixer.conv", "channels": 16,
                               "kernel_size": kernel, "input_gate": True, "output_gate": True,
                               "hidden": 16, "projected": 48, "causal": False}
        assert by[f"layers.{i}.mlp"].kind == "mlp.dense"
    cov = build_coverage(g)
    assert {(e.op, e.status) for e in cov.entries if e.path == "layers.0.mixer"} == \
        {("projections (GEMM)", "torch_fast")}
    assert {(e.op, e.status) for e in cov.entries if e.path == "layers.0.mixer.conv"} == \
        {("depthwise conv over the sequence (not causal)", "uncovered")}
    assert not any(e.family == "conv1d" for e in cov.entries)


def test_an_ungated_noncausal_conv_mixer_is_unknown_not_an_mlp(parse_model):
    """Projection, centred conv, SiLU, projection (our own fixture): a token mixer no rule
    explains, one `unknown` block at the mixer beside its `conv.noncausal1d`, never a dense MLP
    (the conv over the sequence mixes tokens, causal or not)."""
    g = parse_model("tests/fixtures/noncausal_conv_models.py:UngatedCentredConvLM", seq=12)
    by = {b.path: b for b in g.blocks}
    assert g.layer_pattern == "?F ?F"
    assert by["layers.0.mixer"].kind == "unknown"
    assert by["layers.0.mixer.conv"].kind == "conv.noncausal1d"
    assert not any(b.kind == "mlp.dense" and ".mixer" in b.path for b in g.blocks)


def test_a_low_rank_linear_residual_branch_is_no_mlp(parse_model):
    """Two projections D -> r -> D with nothing between them and no activation, added back to
    the block's input (Gemma 3n's LAuReL, written here as our own fixture): a rank-r linear map
    on the residual path, `residual.low_rank`, no layer letter. Before, the MLP rule read it as
    `mlp.dense` with an "other" activation, an extra F in every layer (`AFF AFF`)."""
    from onboarding.coverage import build_coverage

    g = parse_model("tests/fixtures/residual_stream_models.py:LowRankResidualLM", seq=12)
    by = {b.path: b for b in g.blocks}
    assert g.layer_pattern == "AF AF"
    for i in (0, 1):
        low = by[f"layers.{i}.low_rank"]
        assert low.kind == "residual.low_rank", (low.kind, low.evidence)
        assert low.attrs == {"hidden": 32, "rank": 8}
        assert by[f"layers.{i}.mlp"].kind == "mlp.dense"
    cov = build_coverage(g)
    assert {(e.op, e.status) for e in cov.entries if e.path == "layers.0.low_rank"} == \
        {("projections (GEMM)", "torch_fast")}


def test_residual_streams_mixed_by_routed_coefficients(parse_model):
    """Several residual streams [n, B, T, D] through the layers, mixed per token by an n x n
    matrix and n weights that a small router computes (Gemma 3n's AltUp, written here as our own
    fixture: the mixing runs in the layer's forward, the coefficient module's methods compute
    the coefficients), the extra streams made from the embedding by n-1 projections and folded
    back by n-1 more: `residual.streams` blocks with roles mix / expand / collapse. Before, the
    router was `unknown` (a `?` in every layer) and so were both projection lists."""
    from onboarding.coverage import build_coverage

    g = parse_model("tests/fixtures/residual_stream_models.py:StreamLM", seq=12)
    by = {b.path: b for b in g.blocks}
    assert g.layer_pattern == "AF AF"
    assert not any(b.kind == "unknown" for b in g.blocks)
    for i in (0, 1):
        mix = by[f"layers.{i}.streams"]
        assert mix.kind == "residual.streams", (mix.kind, mix.evidence)
        assert mix.attrs == {"role": "mix", "streams": 4, "stream_width": 32}
        assert by[f"layers.{i}.low_rank"].kind == "residual.low_rank"
    assert by["expand"].kind == by["collapse"].kind == "residual.streams"
    assert by["expand"].attrs == {"role": "expand", "streams": 4, "stream_width": 32}
    assert by["collapse"].attrs == {"role": "collapse", "streams": 4, "stream_width": 32}
    cov = build_coverage(g)
    assert {(e.op, e.status) for e in cov.entries if e.path == "layers.0.streams"} == \
        {("projections (GEMM)", "torch_fast"), ("residual stream mixing", "uncovered")}
    assert {(e.op, e.status) for e in cov.entries if e.path == "expand"} == \
        {("projections (GEMM)", "torch_fast")}


def _assert_stream_mixes(by: dict, attrs: dict) -> None:
    """Both layers' hyper-connection modules around attention and MLP read `residual.streams`
    mix over 4 streams of width 32, with ``attrs``."""
    for i in (0, 1):
        for hc in ("attn_hc", "mlp_hc"):
            b = by[f"layers.{i}.{hc}"]
            assert b.kind == "residual.streams", (b.kind, b.evidence)
            assert b.attrs == {"role": "mix", "streams": 4, "stream_width": 32, **attrs}


@pytest.mark.parametrize("cls,attrs", [
    ("StaticHyperLM", {"coefficients": "static"}),
    ("DynamicHyperLM", {"coefficients": "dynamic", "projection": "per_stream"}),
    ("FusedHyperLM", {"coefficients": "dynamic", "projection": "flattened",
                      "normalisation": "sinkhorn"}),
    ("WeightsOnlyHyperLM", {"coefficients": "dynamic", "projection": "flattened",
                            "matrix": False}),
])
def test_hyper_connections_are_residual_stream_blocks(parse_model, cls, attrs):
    """Hyper-connections (our own fixtures): n = 4 residual streams [B, T, n, D]; around each
    attention and MLP a module reads the streams into the sublayer's input and mixes them by an
    n x n matrix, from static parameters, per-stream projections (the layer's own forward does
    the mixing matmul) or one fused projection of the flattened streams to n^2 + 2n
    coefficients normalised by Sinkhorn iterations, or without a matrix (2n weights: the
    streams read and written back, never mixed; `matrix` false). Each such module is
    `residual.streams` mix
    (before: no block at all, the mixing silently dropped, or `unknown` where two matmuls met);
    the attention and MLP still read `AF`; the fused model's final weighted sum of the streams is
    `collapse`. Coverage: the coefficient GEMMs torch_fast, the mixing uncovered."""
    from onboarding.coverage import build_coverage

    g = parse_model(f"tests/fixtures/hyper_connection_models.py:{cls}", seq=12)
    by = {b.path: b for b in g.blocks}
    assert g.layer_pattern == "AF AF"
    assert not any(b.kind == "unknown" for b in g.blocks)
    _assert_stream_mixes(by, attrs)
    for i in (0, 1):
        assert by[f"layers.{i}.attn"].kind == "attention.full"
        assert by[f"layers.{i}.mlp"].kind == "mlp.dense"
    cov = build_coverage(g)
    gemm = {("projections (GEMM)", "torch_fast")} if attrs["coefficients"] == "dynamic" else set()
    assert {(e.op, e.status) for e in cov.entries if e.path == "layers.0.attn_hc"} == \
        gemm | {("residual stream mixing", "uncovered")}
    if cls == "DynamicHyperLM":  # the layer's own mixing matmul is counted in the mix block
        assert by["layers.0.attn_hc"].op_histogram.get("matmul") == 1
    if cls == "FusedHyperLM":
        assert by["head_mix"].kind == "residual.streams"
        assert by["head_mix"].attrs == {"role": "collapse", "streams": 4, "stream_width": 32,
                                        "coefficients": "dynamic", "projection": "flattened"}
        assert {(e.op, e.status) for e in cov.entries if e.path == "head_mix"} == gemm
    else:
        assert not any(b.kind == "residual.streams" and b.attrs["role"] != "mix"
                       for b in g.blocks)
    # the dispatch capture (`onboard plan`'s) reads the same (the static einsum is a bmm there)
    d = parse_model(f"tests/fixtures/hyper_connection_models.py:{cls}", seq=12, try_export=False)
    assert d.capture == "dispatch" and d.layer_pattern == "AF AF"
    assert {(b.path, b.kind, tuple(sorted(b.attrs.items()))) for b in d.blocks
            if b.kind == "residual.streams"} == \
        {(b.path, b.kind, tuple(sorted(b.attrs.items()))) for b in g.blocks
         if b.kind == "residual.streams"}


@pytest.mark.slow
def test_gemma3n_laurel_and_altup_are_residual_blocks(parse_model):
    """Gemma 3n's LAuReL is `residual.low_rank`, its AltUp `residual.streams` (per layer: mix;
    the model's altup_projections / altup_unembed_projections: expand / collapse): its layers
    read `WF` / `AF`, not `?WFF`. (About 12 s: marked slow.)"""
    g = parse_model("hf:gemma3n_text")
    assert "?" not in g.layer_pattern and set(g.layer_pattern.split()) == {"WF", "AF"}
    kinds = {b.path.split(".")[-1]: b.kind for b in g.blocks if b.layer in (None, 0)}
    assert kinds["laurel"] == "residual.low_rank" and kinds["altup"] == "residual.streams"
    roles = {b.attrs["role"] for b in g.blocks if b.kind == "residual.streams"}
    assert roles == {"mix", "expand", "collapse"}
    assert not any(b.kind == "unknown" for b in g.blocks)
    # the head's width is the token vocabulary, not the larger per-layer embedding table's
    assert [b.path for b in g.blocks if b.kind == "lm_head"] == ["lm_head"]
    assert not any(b.kind == "mlp.dense" and ".layers." not in b.path for b in g.blocks)


def test_layer_pattern_groups_layers_by_the_stack_that_holds_them(parse_model):
    """Several layer stacks (our own fixture: an encoder, a global stack and a decoder whose
    layers each take a cross-attention from a second list of the same module) get one pattern
    segment each, in forward order, named after the stack's module; each block keeps its index
    in its own list (`layer`). Before, the first number of the path was the layer whatever the
    stack, so the stacks' layer 0 merged into one token (`AAAAF...`)."""
    from onboarding.graph.classify import stack_of

    g = parse_model("tests/fixtures/multi_stack_models.py:ThreeStackLM", seq=12)
    assert g.layer_pattern == "encoder: AF AF | global_stack: AF AF AF | decoder: AAF AAF"
    assert len(g.layer_kinds) == 7
    by = {b.path: b for b in g.blocks}
    assert by["global_stack.layers.2.mlp"].layer == 2
    assert stack_of("decoder.cross_layers.1") == stack_of("decoder.layers.1.attn") == "decoder"
    assert stack_of("model.layers.3.mlp") == "model" and stack_of("layers.0.attn") == ""
    assert stack_of("lm_head") is None


def test_layer_pattern_of_one_stack_is_unchanged():
    """One stack (every decoder, whatever its list is called): the tokens alone, as before."""
    from onboarding.graph.opgraph import Block
    from onboarding.graph.parse import layer_pattern

    def blk(path, kind):
        return Block(path=path, kind=kind, layer=int(path.split(".")[2]), class_name="")

    blocks = [blk("model.layers.0.self_attn", "attention.full"), blk("model.layers.0.mlp", "mlp.dense"),
              blk("model.layers.1.mixer", "linear_attention.mamba"),
              blk("model.layers.1.mlp.experts", "moe.experts")]
    assert layer_pattern(blocks) == ("AF mE", [["attention.full", "mlp.dense"],
                                               ["linear_attention.mamba", "moe.experts"]])
    # a second stack (its list owned by another module) runs first
    two = blocks + [Block(path="model.vision.blocks.0.attn", kind="attention.full", layer=0,
                          class_name="")]
    assert layer_pattern(two, {"model.vision.blocks.0.attn": 0, "model.layers.0.self_attn": 5})[0] \
        == "vision: A- | model: AF mE"
    assert layer_pattern(two)[0] == "model: AF mE | vision: A-"  # path order without first ops


def test_a_gated_per_layer_input_is_a_residual_input_gate(parse_model):
    """Each layer handed an input of its own (Gemma 3n's per-layer embedding, written here as our
    own fixture): in the layer's forward, a projection D -> P, gelu, times that input, a
    projection P -> D, back to the residual. Both projections are single linears, so no module
    holds them together: the four ops become one `residual.input_gate` block, split out before
    the layer's rules. Before, the layer itself read as a non-gated gelu `mlp.dense` (`AFF`).
    The per-layer table is larger than the vocabulary: the lm_head is still found."""
    from onboarding.coverage import build_coverage

    g = parse_model("tests/fixtures/per_layer_input_models.py:PerLayerInputLM", seq=12)
    by = {b.path: b for b in g.blocks}
    assert g.layer_pattern == "AF AF"
    for i in (0, 1):
        b = by[f"layers.{i}.input_gate"]
        assert b.kind == "residual.input_gate", (b.kind, b.evidence)
        assert b.attrs == {"hidden": 32, "input_width": 16, "activation": "gelu_tanh",
                           "projection": f"layers.{i}.input_proj"}
        assert b.outputs[0].shape == [1, 12, 32]
        assert f"layers.{i}" not in by
    # the per-layer table (96 rows) is larger than the vocabulary: the head is still found
    assert by["lm_head"].kind == "lm_head"
    cov = build_coverage(g)
    assert {(e.op, e.status) for e in cov.entries if e.path == "layers.0.input_gate"} == \
        {("projections (GEMM)", "torch_fast"), ("gated input (gelu_tanh x input)", "uncovered")}
    # the dispatch capture (`onboard plan`'s) runs the projections as mm on [B*T, D] views
    d = parse_model("tests/fixtures/per_layer_input_models.py:PerLayerInputLM", seq=12,
                    try_export=False)
    assert d.capture == "dispatch" and d.layer_pattern == "AF AF"
    assert {b.path for b in d.blocks if b.kind == "residual.input_gate"} == \
        {"layers.0.input_gate", "layers.1.input_gate"}
    # `onboard plan` keeps the gate's output, its activation and the product: 3P bf16 per token
    from onboarding.plan.memory import block_saved
    from onboarding.plan.shapes import BlockShape

    class Cfg:
        mode, lora_rank = "lora", 0

    class Shape:
        hidden = 32

    gate = BlockShape(pattern="layers.*.input_gate", kind="residual.input_gate", count=2,
                      params=512, linears=[("", 32, 16)], attrs={}, ops=4, nested=False)
    assert block_saved(gate, Shape(), Cfg(), 1) == (3 * 2 * 16, 0.0, 0.0)


def test_gemma4_per_layer_input_gate_is_no_layer_mlp(parse_model):
    """Gemma 4 gates its per-layer input as Gemma 3n does: the gate is `residual.input_gate`;
    before, the decoder layer itself read as a gelu `mlp.dense` (`WFF`, a second F per layer)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if "gemma4_text" not in CONFIG_MAPPING_NAMES:
        pytest.skip("this transformers has no gemma4_text")
    g = parse_model("hf:gemma4_text")
    assert set(g.layer_pattern.split()) <= {"WF", "AF"}, g.layer_pattern
    gates = [b for b in g.blocks if b.path.endswith(".per_layer_input_gate")]
    assert gates and all(b.kind == "residual.input_gate" for b in gates)
    assert not any(b.kind == "mlp.dense" and b.path.split(".")[-1].isdigit() for b in g.blocks)


@pytest.mark.parametrize("cls,seq,expect", [
    ("CompressedKVLM", 12, {"compress_ratio": 4, "window": 4, "overlap": False,
                            "compressed_keys": 3, "topk": None}),
    ("CompressedTopkLM", 16, {"compress_ratio": 4, "window": 8, "overlap": True,
                              "compressed_keys": 4, "topk": 2, "indexer_relu": True}),
])
def test_attention_over_pooled_keys_is_compressed(parse_model, cls, seq, expect):
    """Attention whose keys are the T local keys followed by C = T // r entries pooled from
    windows (softmax-weighted sum over the window dim) is `attention.compressed`, with the
    window stride, width and any top-k over the pooled entries. The indexer's top-k (k < C, its
    scores a product of queries and pooled keys) is taken in, not read as a router; coverage
    has one uncovered core entry that says what it is. Both captures read the same."""
    from onboarding.coverage import build_coverage

    for try_export in (True, False):
        g = parse_model(f"tests/fixtures/compressed_attention_models.py:{cls}", seq=seq,
                        try_export=try_export)
        assert g.layer_pattern == "PF PF", (g.capture, g.layer_pattern)
        assert not [b.path for b in g.blocks if b.kind in ("unknown", "moe.router")]
        for i in (0, 1):
            b = next(b for b in g.blocks if b.path == f"layers.{i}.attn")
            assert b.kind == "attention.compressed", (b.kind, b.evidence)
            want = {**expect, "pooling": "softmax_weighted", "local_keys": True, "sink": True,
                    "core_widths": {"heads": 2, "d_qk": 16, "d_v": 16}}  # one K = V head
            assert {k: b.attrs.get(k) for k in want} == want, b.attrs
            assert "unfused_core" not in b.attrs
        cov = build_coverage(g)
        assert {(e.op, e.status) for e in cov.entries if e.path == "layers.0.attn"} == {
            ("projections (GEMM)", "torch_fast"),
            ("attention over pooled (compressed) key/value windows", "uncovered")}


SWEEP33 = "tests/fixtures/sweep33_models.py"


def test_a_sigmoid_of_the_scores_logsumexp_is_a_sink_not_a_gate(parse_model):
    """Attention whose output is scaled by sigmoid(logsumexp(scores) - s), s a per-head
    parameter (Granite-SWA's sink; our own fixture): one more logit in the softmax's
    denominator, no output gate. Before: `attention.gated` (a sigmoid before the out
    projection). The sigmoid reads the scores' [.., T] log-normaliser, not a projection."""
    g = parse_model(f"{SWEEP33}:SinkScaleLM", seq=12)
    attn = [b for b in g.blocks if b.path.endswith(".attn")]
    assert len(attn) == 2
    for b in attn:
        assert b.kind == "attention.full", (b.kind, b.evidence)
        assert b.attrs.get("sink") is True
        assert b.attrs["unfused_core"]["scores"][-2:] == [12, 12]
    # a real output gate still reads gated (its sigmoid reads a projection of the input)
    gated = parse_model("tests/fixtures/gated_out_models.py:GatedOutLM", seq=12)
    assert not any(b.attrs.get("sink") for b in gated.blocks)


def test_a_router_whose_linear_also_scores_shared_experts_is_a_router(parse_model):
    """One linear writes E + S logits; the top-k reads the E routed experts' slice, the other
    S weight the shared experts (Inkling's router; our own fixture). Before: `unknown` (the
    router rule wanted a linear exactly E wide). n_experts is the routed count, `shared_logits`
    the rest; the experts and the shared expert read as before."""
    g = parse_model(f"{SWEEP33}:SharedLogitsMoELM", seq=12)
    assert g.layer_pattern == "AE AE"
    by = {b.path: b for b in g.blocks}
    for i in (0, 1):
        r = by[f"layers.{i}.ffn.gate"]
        assert r.kind == "moe.router", (r.kind, r.evidence)
        assert (r.attrs["n_experts"], r.attrs["top_k"], r.attrs["shared_logits"],
                r.attrs["scoring"]) == (8, 2, 1, "sigmoid")
        assert by[f"layers.{i}.ffn.experts"].attrs["n_experts"] == 8
        assert by[f"layers.{i}.ffn.shared_expert"].kind == "moe.shared_expert"
    assert not any(b.kind == "unknown" for b in g.blocks)
    # the router kernel's one [E, D] weight and top-k normalisation do not fit: not claimed
    from onboarding.families import family_module

    assert family_module("moe_router").match(by["layers.0.ffn.gate"]) is None


@pytest.mark.parametrize("cls,weight", [("PerExpertNormMoELM", "norm_weight"),
                                        ("ExpertNormModuleMoELM", "post_norm.weight")])
def test_a_norm_whose_scale_is_gathered_per_expert_is_part_of_the_experts(parse_model, cls,
                                                                          weight):
    """Each routed row RMS-normalised and scaled by its own expert's weight, a [E, D] table
    gathered by expert id (Ergo's post-expert norm; our own fixture), inline or in a child
    module called with the ids. It is part of the experts (`post_norm`, `post_norm_weight`), no
    `norm.rms` of the hidden state (before, in a child: a norm.rms block that the rmsnorm kernel
    would replace with one [D] weight) and no down-projection bias (before, inline: `down_bias`
    was the norm's table)."""
    g = parse_model(f"{SWEEP33}:{cls}", seq=12)
    assert g.layer_pattern == "AE AE"
    for i in (0, 1):
        e = next(b for b in g.blocks if b.path == f"layers.{i}.ffn.experts")
        assert e.kind == "moe.experts"
        assert (e.attrs["post_norm"], e.attrs["post_norm_weight"]) == ("rms", weight)
        assert e.attrs.get("down_bias") is None
        assert not any(b.kind.startswith("norm.") and b.path.startswith(f"layers.{i}.ffn")
                       for b in g.blocks)


def test_attention_over_depth_is_residual_depth_attention(parse_model):
    """Block attention residuals (Inkling 2's; our own fixture): a learned query [D] scores the
    stacked earlier layers' outputs and the current state [B, T, k, D] at every position, a
    softmax over those k (not over the sequence), their weighted sum the next sublayer's input.
    Each such module is `residual.depth_attention` (queries, states = k, width, normalised);
    before: `unknown` (`A?F A??F`). Coverage: uncovered, no family."""
    from onboarding.coverage import build_coverage

    g = parse_model(f"{SWEEP33}:DepthAttentionLM", seq=12)
    assert g.layer_pattern == "AF AF"
    by = {b.path: b for b in g.blocks}
    states = {"layers.0.mlp_input": 3, "layers.1.attn_input": 3, "layers.1.mlp_input": 4,
              "final_input": 4}
    for path, k in states.items():
        b = by[path]
        assert b.kind == "residual.depth_attention", (b.kind, b.evidence)
        assert b.attrs == {"queries": 1, "states": k, "width": 32, "normalised": True}
    assert "layers.0.attn_input" not in by
    assert not any(b.kind == "unknown" for b in g.blocks)
    cov = build_coverage(g)
    assert {e.status for e in cov.entries if e.path in states} == {"uncovered"}


def test_an_rms_norm_written_with_square_is_a_norm():
    """x * rsqrt(mean(square(x)) + eps) (Inkling 2's unweighted norm writes the squares with
    `square`): an RMS norm; before, `square` was not counted as the squares, the norm was no
    block and its ops went to the parent."""
    from onboarding.graph.capture import OpRecord
    from onboarding.graph.classify import _is_rms

    def rec(i, op, shapes, scalars=()):
        return OpRecord(index=i, op=op, module="n", in_shapes=shapes, in_dtypes=[None] * len(shapes),
                        out_shapes=shapes[:1], out_dtypes=["float32"], scalars=list(scalars))

    recs = [rec(0, "square", [[1, 4, 8]]), rec(1, "mean", [[1, 4, 8]]),
            rec(2, "add", [[1, 4, 1]], (None, 1e-6)), rec(3, "rsqrt", [[1, 4, 1]]),
            rec(4, "mul", [[1, 4, 8], [1, 4, 1]])]
    assert _is_rms(recs)


@pytest.mark.parametrize("cls,attrs", [
    ("FoldedStaticHyperLM", {"coefficients": "static"}),
    ("FoldedDynamicHyperLM", {"coefficients": "dynamic", "projection": "per_stream"}),
])
def test_hyper_connections_with_streams_folded_into_the_batch(parse_model, cls, attrs):
    """Hyper-connections whose n = 4 streams are folded into the batch dim, [B * n, T, D] (a
    common library layout; our own fixture): each layer maps the folded streams to as many, and
    around each sublayer a module unfolds them, reads the sublayer's input [B, T, D] and mixes
    them. Each such module is `residual.streams` mix, as with [B, T, n, D] streams; before, a
    carrier had to be 4-D and they were no block (the mixing silently dropped)."""
    g = parse_model(f"tests/fixtures/folded_hyper_connection_models.py:{cls}", seq=12)
    by = {b.path: b for b in g.blocks}
    assert g.layer_pattern == "AF AF"
    assert not any(b.kind == "unknown" for b in g.blocks)
    _assert_stream_mixes(by, attrs)
    # the dispatch capture (`onboard plan`'s) reads the same
    d = parse_model(f"tests/fixtures/folded_hyper_connection_models.py:{cls}", seq=12,
                    try_export=False)
    assert d.capture == "dispatch" and d.layer_pattern == "AF AF"
    assert {(b.path, tuple(sorted(b.attrs.items()))) for b in d.blocks
            if b.kind == "residual.streams"} == \
        {(b.path, tuple(sorted(b.attrs.items()))) for b in g.blocks if b.kind == "residual.streams"}


def test_the_eps_of_a_fused_rms_norm_op_is_read():
    """F.rms_norm(x, shape, w, eps) records one `rms_norm` op whose eps is an argument, no add
    (Ergo: eps 1e-12): `eps` is that argument. Before it was None, and the rmsnorm kernel's
    default eps made Ergo's norms miss the block check at T = 32 (rel RMS 1.3e-3)."""
    from onboarding.graph.capture import OpRecord
    from onboarding.graph.classify import _norm_attrs

    r = OpRecord(index=0, op="rms_norm", module="n", in_shapes=[[1, 4, 8], None, [8], None],
                 in_dtypes=["float32", None, "float32", None], out_shapes=[[1, 4, 8]],
                 out_dtypes=["float32"], scalars=[None, [8], None, 1e-12], params={2: "n.weight"})
    assert _norm_attrs([r], None)["eps"] == 1e-12


def test_an_input_gates_second_projection_counts_under_its_kind(parse_model):
    """The full-size parameters per kind (`full_by_kind`) count an input gate's second
    projection (P -> D, a sibling module: attrs `projection`) under `residual.input_gate`, as
    its first; before, only the first projection's module was joined and the second went to
    the layer's leftovers ("other")."""
    from onboarding.graph.parse import by_kind_params
    from onboarding.load.accounting import count_parameters
    from onboarding.load.model import load_model

    ref = "tests/fixtures/per_layer_input_models.py:PerLayerInputLM"
    g = parse_model(ref, seq=12)
    model = load_model(ref).build(None, device="meta", seed=None)
    full = count_parameters(model)
    gates = {n: p.numel() for n, p in model.named_parameters()
             if n.split(".")[-2] in ("input_gate", "input_proj")}
    assert len(gates) == 4  # two layers, a D -> P and a P -> D weight each
    assert by_kind_params(full, g.blocks)["residual.input_gate"] == sum(gates.values())


SWEEP133 = "tests/fixtures/sweep133_models.py"


def test_linear_attention_read_off_its_state_is_linear_attention(parse_model):
    """Linear attention whose decay is fixed per head and made once as buffers (MiniMax's
    lightning attention; our own fixture, in block form): no softmax and no decay cumsum, so
    no rule matched and the mixer was `unknown` ("8 matmuls that no rule explains"). K^T V
    into a [d, d] state per head and the queries' read-out of it make it
    `linear_attention.other` (recurrence "state")."""
    g = parse_model(f"{SWEEP133}:BlockDecayLinearAttentionLM", seq=12)
    assert g.layer_pattern == "LF LF"
    for b in (b for b in g.blocks if b.path.endswith(".attn")):
        assert b.kind == "linear_attention.other", (b.kind, b.evidence)
        assert b.attrs == {"recurrence": "state", "state": [16, 16], "state_decay": True}
    # softmax attention written out, and fused attention, stay attention
    g = parse_model(f"{SWEEP33}:SinkScaleLM", seq=12)
    assert g.layer_pattern == "AF AF"
    # products of activations over something else than positions (4 residual streams mixed
    # by per-token 4 x 4 weights, as DeepSeek-V4's layers do) are no state: the first version
    # of this rule (a938ff4) read those layers as linear attention (`LAF`, DeepSeek-V4 `LME`)
    g = parse_model(f"{SWEEP133}:StreamMixLM", seq=12)
    assert not any(b.kind == "linear_attention.other" for b in g.blocks)


def test_a_norm_gated_by_an_mlp_of_its_output_is_a_gated_norm(parse_model):
    """A pre-norm whose output y is scaled by sigmoid(mlp(y)), mlp a low-rank D -> r -> D MLP
    (AXK2's GatedRMSNorm; our own fixture). Before, that MLP was an `mlp.dense` of the layer:
    AXK2 read `SFF SFEF`, here `AFFF AFFF`. The module is now `norm.rms_gated` (gate "mlp",
    the MLP taken in), its child norm stays `norm.rms`; the rmsnorm family's gated variant
    (which needs z before the norm) does not claim it, and coverage lists the gate product."""
    from onboarding.coverage import build_coverage

    g = parse_model(f"{SWEEP133}:GatedNormLM", seq=12)
    assert g.layer_pattern == "AF AF"
    by = {b.path: b for b in g.blocks}
    for i in (0, 1):
        for n in ("norm1", "norm2"):
            b = by[f"layers.{i}.{n}"]
            assert b.kind == "norm.rms_gated", (b.kind, b.evidence)
            assert (b.attrs["gate"], b.attrs["gate_rank"], b.attrs["gate_activation"]) == (
                "mlp", 8, "sigmoid")
            assert f"layers.{i}.{n}.mlp" not in by
            assert by[f"layers.{i}.{n}.norm"].kind == "norm.rms"
    cov = build_coverage(g)
    gated = [e for e in cov.entries if e.kind == "norm.rms_gated"]
    assert not any(e.status in ("kernel", "template") for e in gated)
    assert any(e.status == "uncovered" and e.op.startswith("gate") for e in gated)
    # a plain pre-norm and a dense MLP beside it stay as they were
    assert parse_model(f"{SWEEP33}:SinkScaleLM", seq=12).layer_pattern == "AF AF"


def test_a_norm_that_sums_the_squares_is_an_l2_norm(parse_model):
    """x * rsqrt(sum(x^2) + eps), no weight (nGPT's norms, Dory's ten a layer; our own
    fixture): before, no rule took it (the RMS rule wanted a mean of squares), so no block, and
    coverage never listed it. Now `norm.rms` with reduction "sum", which the rmsnorm family
    serves as its l2norm variant. A mean of squares still has no `reduction`."""
    from onboarding.families import match_block

    g = parse_model(f"{SWEEP133}:L2NormLM", seq=12)
    by = {b.path: b for b in g.blocks}
    for i in (0, 1):
        for n in ("norm1", "norm2"):
            b = by[f"layers.{i}.{n}"]
            assert b.kind == "norm.rms", (b.kind, b.evidence)
            assert (b.attrs["reduction"], b.attrs["has_weight"], b.attrs["dim"]) == ("sum", False, 32)
            assert [(f, m["variant"]) for f, m in match_block(b)] == [("rmsnorm", "l2norm")]
    assert "reduction" not in by["norm"].attrs  # the final norm: a mean of squares, weighted


LOW_RANK_GATES = "tests/fixtures/low_rank_gate_models.py"


@pytest.mark.parametrize("cls,pattern,kind,gate,linears", [
    ("LowRankForgetGateLM", "LF LF", "linear_attention.other", "attn.forget_gate", ("f_a", "f_b")),
    ("LowRankOutputGateLM", "AF AF", "attention.gated", "attn.gate", ("g_a", "g_b"))])
def test_a_low_rank_gate_projection_in_an_attention_block_is_no_mlp(parse_model, cls, pattern,
                                                                    kind, gate, linears):
    """A module inside an attention block running two linears D -> r -> D chained with nothing
    between them, its nonlinearity after the second (Kimi Delta Attention's forget gate: a
    softplus decay of f_b(f_a(x)); a low-rank sigmoid output gate; our own fixtures): a rank-r
    linear map of the hidden state, the attention's projection, no MLP. Before, the MLP rule
    read it as `mlp.dense` by its D -> r -> D shape (`LFF LFF`, `AFF AFF`; Kimi Linear read
    `KFF KEF ..`); now it is no block and its ops are the attention's. Its linears stay default
    LoRA targets (they are inside the attention block)."""
    from onboarding.load.model import load_model
    from onboarding.train.lora import default_targets

    ref = f"{LOW_RANK_GATES}:{cls}"
    g = parse_model(ref, seq=12)
    by = {b.path: b for b in g.blocks}
    assert g.layer_pattern == pattern
    for i in (0, 1):
        assert by[f"layers.{i}.attn"].kind == kind, by[f"layers.{i}.attn"].evidence
        assert f"layers.{i}.{gate}" not in by
        assert by[f"layers.{i}.ffn"].kind == "mlp.dense"
    targets = default_targets(load_model(ref).build(None, seed=0), g)
    assert {f"layers.{i}.{gate}.{n}" for i in (0, 1) for n in linears} <= set(targets)


def test_a_bottleneck_mlp_with_an_activation_between_its_linears_is_an_mlp(parse_model):
    """The control: D -> r -> D (r < D) with a GELU between the two linears is an MLP however
    narrow, `mlp.dense`; only a chain with nothing nonlinear between its linears is no MLP."""
    g = parse_model(f"{LOW_RANK_GATES}:BottleneckMLPLM", seq=12)
    ffn = {b.path: b for b in g.blocks}["layers.0.ffn"]
    assert g.layer_pattern == "AF AF"
    assert (ffn.kind, ffn.attrs["activation"], ffn.attrs["intermediate"]) == ("mlp.dense", "gelu", 8)

