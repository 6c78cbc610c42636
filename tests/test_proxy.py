"""Proxy configs keep the architecture and shrink the size."""

from __future__ import annotations

import re

import pytest
import torch

from onboarding.load.accounting import count_parameters
from onboarding.load.model import load_model
from onboarding.graph.parse import load_stage
from onboarding.load.proxy import text_config

DEV = ["hf:qwen3_next", "hf:deepseek_v32", "hf:kimi_linear", "hf:qwen3_moe", "hf:mixtral"]


@pytest.mark.parametrize("ref", DEV)
def test_tiny_proxy_is_a_few_million(ref):
    info = load_stage(load_model(ref), "tiny")
    model = info.loaded.build(info.proxy_config, device="meta", seed=None)
    n = count_parameters(model).total
    assert 0.5e6 < n < 10e6, n


@pytest.mark.parametrize("ref", ["hf:qwen3_next", "hf:deepseek_v32", "hf:kimi_linear",
                                 "hf:mixtral"])
def test_small_proxy_is_0p3_to_1b(ref):
    info = load_stage(load_model(ref), "small")
    model = info.loaded.build(info.proxy_config, device="meta", seed=None)
    n = count_parameters(model).total
    assert 0.3e9 <= n <= 1.0e9, n


def test_proxy_keeps_hybrid_period_and_routing():
    lm = load_model("hf:qwen3_next")
    info = load_stage(lm, "tiny")
    full, tiny = text_config(lm.config), text_config(info.proxy_config)
    assert tiny.layer_types == full.layer_types[:4]  # one full period: 3 linear, 1 full
    assert {"linear_attention", "full_attention"} == set(tiny.layer_types)
    assert tiny.norm_topk_prob == full.norm_topk_prob
    assert tiny.num_experts_per_tok == full.num_experts_per_tok == 10
    assert tiny.linear_num_value_heads // tiny.linear_num_key_heads == \
        full.linear_num_value_heads // full.linear_num_key_heads


# The MoE dev targets, with README's Mixtral example (16 experts, top-4) beside the default.
MOE = [("hf:qwen3_next", {}), ("hf:qwen3_moe", {}), ("hf:deepseek_v3", {}),
       ("hf:deepseek_v32", {}), ("hf:kimi_linear", {}), ("hf:mixtral", {}),
       ("hf:mixtral", {"num_local_experts": 16, "num_experts_per_tok": 4}), ("hf:gpt_oss", {})]


def _routing(c):
    """(experts, {top-k field: k}, groups, topk_group) of a config, by the proxy's field names."""
    from onboarding.load._proxy_cuts import _expert_count, _topk_names
    from onboarding.load.proxy import GROUP_COUNT_NAMES

    groups = next((getattr(c, n) for n in GROUP_COUNT_NAMES if isinstance(getattr(c, n, None), int)), 1)
    return (_expert_count(c), {n: getattr(c, n) for n in _topk_names(c)}, groups,
            getattr(c, "topk_group", None))


@pytest.mark.parametrize("size", ["tiny", "small"])
@pytest.mark.parametrize("ref, overrides", MOE,
                         ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else v)
def test_proxy_keeps_top_k_with_at_least_twice_as_many_experts(ref, overrides, size):
    """Top-k is the full model's, in the config and in the built model's routers; experts shrink
    to no fewer than 2 x top-k, and group-limited routing can still reach top-k (before: top-2 in
    tiny and top-8 in small, whatever the model's)."""
    import warnings

    from onboarding.load.accounting import find_moe
    from onboarding.load.proxy import PROXY_SIZES, ProxyWarning

    _model_type_or_skip(ref)
    lm = load_model(ref, overrides=overrides)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = load_stage(lm, size)
    assert not [w for w in caught if issubclass(w.category, ProxyWarning)
                and re.search(r"top-k \d+ ->", str(w.message))]
    full_exp, full_k, full_groups, full_tg = _routing(text_config(lm.config))
    c = text_config(info.proxy_config)
    n_exp, ks, groups, tg = _routing(c)
    k = max(full_k.values())
    assert ks == full_k, (ks, full_k)
    # the size's expert count, or 2 x top-k where that is more (never more than the full model's)
    assert n_exp == min(full_exp, max(PROXY_SIZES[size].experts, 2 * k)) >= min(full_exp, 2 * k)
    if full_groups > 1:
        assert groups > 1 and n_exp % groups == 0 and n_exp // groups >= 2
        assert tg < groups if full_tg < full_groups else tg == groups
        assert k <= tg * (n_exp // groups), (k, tg, n_exp, groups)
    blocks = find_moe(lm.build(info.proxy_config, device="meta", seed=None), info.proxy_config)
    assert blocks and {(b.n_experts, b.top_k) for b in blocks} == {(n_exp, k)}
    assert not re.search(r"top-k \d+ ->", info.proxy_note)


@pytest.mark.parametrize("overrides", [{}, {"topk_group": 1}], ids=["default", "topk_group=1"])
def test_group_limited_proxy_routes_top_k_in_its_top_groups(overrides):
    """DeepSeek-V3's 8 of 256 experts from the best 4 of 8 groups; with topk_group=1 all 8 come
    from one group, so a 16-expert proxy needs groups of 8: it takes fewer groups, not a lower
    k. The proxy runs (transformers' group routing takes the two best experts of every group)."""
    lm = load_model("hf:deepseek_v3", overrides=overrides)
    info = load_stage(lm, "tiny")
    c = text_config(info.proxy_config)
    assert c.num_experts_per_tok == 8 and c.n_routed_experts == 16
    assert (c.n_group, c.topk_group) == ((8, 4) if not overrides else (2, 1))
    model = lm.build(info.proxy_config, device="cpu", seed=0)
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, c.vocab_size, (1, 8)), use_cache=False)
    assert torch.isfinite(out.logits).all()


def test_top_k_past_the_expert_limit_is_capped_warned_and_recorded(tmp_path, monkeypatch, capsys):
    """Keeping top-20 needs 40 experts, over tiny's 32: top-k becomes 16 of 32, and the CLI
    says so (a ProxyWarning on stderr) and model.json's proxy note records it."""
    import json
    import sys
    import warnings

    from onboarding.cli.main import main
    from onboarding.load.proxy import ProxyWarning

    monkeypatch.chdir(tmp_path)
    over = {"num_experts_per_tok": 20}
    with pytest.warns(ProxyWarning, match=r"tiny proxy: top-k 20 -> 16: keeping it would need 40"):
        info = load_stage(load_model("hf:qwen3_moe", overrides=over), "tiny")
    c = text_config(info.proxy_config)
    assert (c.num_experts, c.num_experts_per_tok) == (32, 16)
    assert "top-k 20 -> 16" in info.proxy_note

    def show(message, category, filename, lineno, file=None, line=None):  # Python's default
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    with warnings.catch_warnings():
        warnings.resetwarnings()  # Python's filters and output, not pytest's record
        warnings.simplefilter("default")
        warnings.showwarning = show
        assert main(["parse", "hf:qwen3_moe", "--set", "num_experts_per_tok=20", "--out", "o"]) == 0
    assert "ProxyWarning: tiny proxy: top-k 20 -> 16" in capsys.readouterr().err
    model = json.loads((tmp_path / "o" / "model.json").read_text())
    assert "top-k 20 -> 16" in model["proxy_note"] and model["proxy_config"]["num_experts_per_tok"] == 16


@pytest.mark.parametrize("size, kept", [("tiny", 16), ("small", 512)])
def test_index_topk_cap_is_warned_and_recorded(size, kept):
    """Sparse attention's K (2048 in DeepSeek-V3.2) is cut below the proxy's sequence lengths,
    where K >= T would keep every key; a K already below the cap is kept, without a note."""
    from onboarding.load.proxy import ProxyWarning

    with pytest.warns(ProxyWarning, match=rf"{size} proxy: index_topk 2048 -> {kept}: "):
        info = load_stage(load_model("hf:deepseek_v32"), size)
    assert text_config(info.proxy_config).index_topk == kept
    assert f"index_topk 2048 -> {kept}" in info.proxy_note
    info = load_stage(load_model("hf:deepseek_v32", overrides={"index_topk": 8}), size)
    assert text_config(info.proxy_config).index_topk == 8 and "index_topk" not in info.proxy_note


def test_rederive_error_is_warned_naming_the_config_and_the_error():
    """A dataclass config's __post_init__ re-runs on the shrunk fields; one that refuses was
    skipped in silence, leaving its derived fields at full size."""
    import dataclasses
    import warnings

    from onboarding.load.proxy import ProxyWarning, shrink_config

    @dataclasses.dataclass
    class OnceConfig:
        hidden_size: int = 4096
        num_hidden_layers: int = 4
        refuse_again: bool = True

        def __post_init__(self):
            if self.refuse_again and hasattr(self, "half_width"):
                raise ValueError("derived twice")
            self.half_width = self.hidden_size // 2

    with pytest.warns(ProxyWarning, match=r"tiny proxy: OnceConfig.__post_init__ raised "
                                          r"ValueError: derived twice .*\(half_width\)"):
        c = shrink_config(OnceConfig(), "tiny")
    assert (c.hidden_size, c.half_width) == (128, 2048)  # the derived field is stale: said so
    notes = []
    shrink_config(OnceConfig(), "tiny", notes=notes)
    assert len(notes) == 1 and notes[0].startswith("OnceConfig.__post_init__ raised ValueError")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProxyWarning)
        c = shrink_config(OnceConfig(refuse_again=False), "tiny")
    assert (c.hidden_size, c.half_width) == (128, 64)


def test_layer_count_is_the_field_that_sizes_the_layer_stack():
    """The layer count shrunk is the field whose value is the length of the full model's layer
    stack, whatever its name: LongCat-Flash's config on transformers 5.17 holds
    num_hidden_layers = 56 (two attention sublayers a layer) beside num_layers = 28, which sizes
    its 28 layers; num_hidden_layers keeps its multiple. A proxy whose model still builds the
    full stack fails clearly."""
    import dataclasses
    from types import SimpleNamespace

    from torch import nn

    from onboarding.errors import InputError
    from onboarding.load.proxy import _check_layer_stack, layer_count_name, shrink_config

    @dataclasses.dataclass
    class TwoCounts:
        hidden_size: int = 4096
        num_hidden_layers: int = 56
        num_layers: int = 28

    def stack(n):
        model = nn.Module()
        model.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(n))
        return model

    full = TwoCounts()
    assert layer_count_name(full, stack(28)) == "num_layers"
    assert layer_count_name(full, None) == "num_hidden_layers"  # no model: the first known name
    c = shrink_config(full, "tiny", layer_count="num_layers", notes=[])
    assert (c.num_layers, c.num_hidden_layers) == (2, 4)
    loaded = SimpleNamespace(ref="hf:two_counts", config=full, build=lambda cfg, **kw: stack(28))
    with pytest.raises(InputError, match=r"hf:two_counts: the tiny proxy sets num_layers=2, but "
                                         r"the model built from it has 28 layers at layers"):
        _check_layer_stack(loaded, c, "tiny", "num_layers", stack(28))
    loaded.build = lambda cfg, **kw: stack(cfg.num_layers)
    _check_layer_stack(loaded, c, "tiny", "num_layers", stack(28))


def test_a_stack_sized_by_another_layer_field_shrinks():
    """HRM-text's num_hidden_layers (128) sizes no ModuleList; num_layers_per_stack (16) sizes
    its two stacks. The proxy shrank num_hidden_layers alone, so onboard run hf:hrm_text kept
    all 32 layers (proxy 6.29M, 99 blocks aligned in 80 s) while its report said '1 layer
    period(s)'. The layer count is now the int field named for layers that sizes a stack."""
    import dataclasses

    from torch import nn

    from onboarding.load.proxy import layer_count_name

    @dataclasses.dataclass
    class Stacks:
        num_hidden_layers: int = 128
        num_layers_per_stack: int = 16
        use_cache: bool = True

    model = nn.Module()
    model.low = nn.ModuleList(nn.Linear(2, 2) for _ in range(16))
    model.high = nn.ModuleList(nn.Linear(2, 2) for _ in range(16))
    assert layer_count_name(Stacks(), model) == "num_layers_per_stack"
    assert layer_count_name(Stacks(), None) == "num_hidden_layers"  # no model: as before
    info = load_stage(load_model("hf:hrm_text"))
    assert text_config(info.proxy_config).num_layers_per_stack < 16


def test_same_seed_same_model():
    info = load_stage(load_model("hf:qwen3_moe"), "tiny")
    a = info.loaded.build(info.proxy_config, seed=3).state_dict()
    b = info.loaded.build(info.proxy_config, seed=3).state_dict()
    c = info.loaded.build(info.proxy_config, seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_small_full_model_is_used_as_is_with_weights():
    info = load_stage(load_model("tiny_dense"), "tiny")
    assert info.proxy_note.startswith("full size")
    assert info.loaded.weights, "tiny_dense ships model.safetensors"


def test_shipped_weights_are_loaded_into_the_parsed_model(monkeypatch):
    from safetensors.torch import load_file

    import onboarding.graph.parse as parse

    seen = {}
    real = parse.load_weights

    def spy(model, files):
        n = real(model, files)
        seen["state"] = {k: v.clone() for k, v in model.state_dict().items()}
        return n

    monkeypatch.setattr(parse, "load_weights", spy)
    info = load_stage(load_model("tiny_dense"), "tiny")
    parse.parse_stage(info, seq=16)
    shipped = load_file(str(info.loaded.weights[0]))
    assert shipped and all(torch.equal(seen["state"][k], v) for k, v in shipped.items())


@pytest.mark.parametrize("ref, heads, dim", [
    ("hf:mamba2", "num_heads", "head_dim"),
    ("hf:bamba", "mamba_n_heads", "mamba_d_head"),
    ("hf:falcon_h1", "mamba_n_heads", "mamba_d_head"),  # inner width from mamba_d_ssm
    ("hf:granitemoehybrid", "mamba_n_heads", "mamba_d_head"),
])
def test_ssm_proxy_keeps_heads_times_head_dim_equal_to_the_inner_width(ref, heads, dim):
    """Mamba-2 style mixers reshape their inner width into heads: a proxy that shrank the
    hidden size and the heads apart failed in its first forward (a reshape error)."""
    from onboarding.load._proxy_cuts import _ssm_inner

    info = load_stage(load_model(ref), "tiny")
    c = text_config(info.proxy_config)
    assert getattr(c, heads) * getattr(c, dim) == _ssm_inner(c)
    groups = next(getattr(c, g) for g in ("mamba_n_groups", "n_groups") if hasattr(c, g))
    assert getattr(c, heads) % groups == 0
    model = info.loaded.build(info.proxy_config, device="cpu", seed=0)
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, c.vocab_size, (1, 16)), use_cache=False)
    assert torch.isfinite(out.logits).all()


def _model_type_or_skip(ref: str) -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if ref.removeprefix("hf:") not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"this transformers has no {ref}")


@pytest.mark.parametrize("ref", [
    "hf:gemma4_text",  # heterogeneous config: per-layer head_dim overrides (full layers 2x)
    "hf:dots3_note_text",  # per-layer heads and MLA ranks; rotary table 256 x 0.25 = qk_rope 64
    "hf:xlstm",  # v_head_dim a read-only property; embedding_dim and num_blocks name the width, depth again
    "hf:zamba2",  # attention_head_dim, mamba_headdim derived in __post_init__
    "hf:zamba",  # attention_hidden_size = 2 hidden: a field (None by default) __post_init__ fills in
    "hf:falcon",  # head_dim a read-only property (hidden / heads)
])
def test_proxy_of_configs_with_derived_and_per_layer_fields_runs(ref):
    """Each of these failed before the proxy rules knew the config pattern in its comment
    (an internal error, or a shape error in the proxy's first forward)."""
    _model_type_or_skip(ref)
    info = load_stage(load_model(ref), "tiny")
    c = text_config(info.proxy_config)
    model = info.loaded.build(info.proxy_config, device="cpu", seed=0)
    # Gemma 4's per-layer input embeddings (a second table over the vocabulary) made it 400M
    assert count_parameters(model).total <= 20_000_000
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, c.vocab_size, (1, 16)), use_cache=False)
    assert torch.isfinite(out.logits).all()


def test_per_layer_overrides_follow_their_global_field():
    """A per-layer override is scaled as its global field was and renumbered with the kept
    layers: Gemma 4's full-attention layers keep twice the sliding layers' head dim."""
    _model_type_or_skip("hf:gemma4_text")
    from transformers import AutoConfig

    from onboarding.load.proxy import shrink_config

    full = AutoConfig.for_model("gemma4_text")
    c = shrink_config(full, "tiny")
    layers = c.per_layer_config
    kinds = c.layer_types
    assert "full_attention" in kinds
    dims = {kind: {layers[i].head_dim for i, k in enumerate(kinds) if k == kind} for kind in set(kinds)}
    assert dims["full_attention"] == {2 * d for d in dims["sliding_attention"]}, dims
    assert max(dims["full_attention"]) <= 2 * 32


def test_per_layer_width_lists_shrink_as_their_largest_value():
    """A width field held as a per-layer list (Gemma 3n's intermediate_size, one value a layer,
    which its __post_init__ makes a list) shrinks as the int field would, each layer keeping its
    share of the largest: the proxy kept 16384 before (the width rule took ints only)."""
    _model_type_or_skip("hf:gemma3n_text")
    from transformers import AutoConfig

    from onboarding.load.proxy import PROXY_SIZES, shrink_config

    ffn = PROXY_SIZES["tiny"].ffn
    full = AutoConfig.for_model("gemma3n_text")
    assert isinstance(full.intermediate_size, list) and max(full.intermediate_size) > ffn
    c = shrink_config(full, "tiny", notes=[])
    assert c.intermediate_size == [ffn] * c.num_hidden_layers
    # widths that differ by layer keep their ratios (the largest becomes the proxy's width)
    n = full.num_hidden_layers
    mixed = AutoConfig.for_model("gemma3n_text", intermediate_size=[8192 if i % 2 else 16384
                                                                     for i in range(n)])
    c = shrink_config(mixed, "tiny", notes=[])
    assert c.intermediate_size == [ffn // 2 if i % 2 else ffn for i in range(c.num_hidden_layers)]


def test_a_proxy_that_shrinks_nothing_is_refused_before_its_build():
    """A proxy config that keeps the full model's sizes (BLT's config before its nested
    sub-configs were shrunk: 4.6B parameters, whose build ran 180 s at 5.6 GiB with no result,
    then the OOM killer) is an input error (exit 2) within seconds, naming the sub-configs and
    the largest parameters; counted on meta, nothing is allocated. BLT's own proxy now shrinks
    (`test_nested_sub_configs_of_the_text_config_shrink_by_one_width_factor`), so the check is
    handed the full config as the proxy."""
    _model_type_or_skip("hf:blt")
    from onboarding.errors import InputError
    from onboarding.load.accounting import count_parameters
    from onboarding.load.proxy import _check_shrunk

    loaded = load_model("hf:blt")
    full = count_parameters(loaded.build(device="meta", seed=None)).total
    with pytest.raises(InputError, match=r"tiny proxy keeps [\d,]+ of the full model's [\d,]+ "
                       r"parameters.*sub-configs .*global_config.*encoder_hash_tok_embedding"):
        _check_shrunk(loaded, loaded.config, "tiny", full)


def test_nested_sub_configs_of_the_text_config_shrink_by_one_width_factor():
    """BLT keeps its sizes in sub-configs nested in its text config (local encoder and decoder
    1024 wide, global transformer 2048, entropy patcher 768) and a hash-embedding vocabulary
    (500,002): the text rules never reached them, and the tiny proxy was the full 4.6B model
    (refused since helper-67). They shrink now by one width factor (2048 -> 128), so widths
    tied across sub-configs stay tied (the encoder's hidden_size_global is the global width;
    encoder width x cross_attn_k = global width); the hash vocabulary is capped. The proxy fits
    the tiny budget, builds and runs."""
    _model_type_or_skip("hf:blt")
    from onboarding.load.accounting import count_parameters
    from onboarding.load.proxy import PROXY_SIZES

    s = PROXY_SIZES["tiny"]
    info = load_stage(load_model("hf:blt"), "tiny")
    c = info.proxy_config
    enc, dec, glob, pat = c.encoder_config, c.decoder_config, c.global_config, c.patcher_config
    assert glob.hidden_size == s.hidden and enc.hidden_size == dec.hidden_size == s.hidden // 2
    assert enc.hidden_size_global == dec.hidden_size_global == glob.hidden_size
    assert enc.hidden_size * c.cross_attn_k == glob.hidden_size
    assert pat.hidden_size == 768 * s.hidden // 2048
    assert max(x.num_hidden_layers for x in (enc, dec, glob, pat)) <= 2
    assert c.encoder_hash_byte_group_vocab == s.vocab
    model = info.loaded.build(c, device="cpu", seed=0).eval()
    assert count_parameters(model).total <= s.max_params
    with torch.no_grad():
        out = model(torch.arange(16)[None] % c.vocab_size, use_cache=False)
    assert out.logits.shape == (1, 16, c.vocab_size)


def test_runs_of_periods_tile_a_stack_with_no_short_prefix():
    """`_runs`: from each start, the period that repeats furthest (two periods at least); a
    layer that starts no repetition is a run of its own."""
    from onboarding.load.proxy import _runs

    a, b, c, d = "abcd"
    assert _runs([a, a, a, a, b] * 4 + [c, c, c, c, d] * 3) == [(0, 20, 5), (20, 35, 5)]
    assert _runs([a, b, c]) == [(0, 1, 1), (1, 2, 1), (2, 3, 1)]
    assert _runs([a, b, a, b, c]) == [(0, 4, 2), (4, 5, 1)]


def test_a_stack_of_period_runs_keeps_one_period_of_each_and_its_tail_count():
    """Gemma 3n's 35 layers are a period of 5 layer types run twice over 20 layers, then 15 layers
    that reuse other layers' KV (no k/v projections; num_kv_shared_layers = 15 counts them from
    the end): no period after a short prefix, so the proxy kept all 35 (its parse 28-30 s). It
    keeps one period of each run (10 layers), num_kv_shared_layers counting the kept shared ones,
    and every distinct layer structure of the full stack; the proxy builds and runs."""
    _model_type_or_skip("hf:gemma3n_text")
    from onboarding.load.proxy import layer_signatures

    info = load_stage(load_model("hf:gemma3n_text"), "tiny")
    full_c = text_config(info.loaded.config)
    c = text_config(info.proxy_config)
    assert (full_c.num_hidden_layers, full_c.num_kv_shared_layers) == (35, 15)
    assert (c.num_hidden_layers, c.num_kv_shared_layers) == (10, 5)
    assert c.layer_types == full_c.layer_types[:5] * 2
    assert c.kv_sharing_modes[5:] == ["reuse"] * 5 and "reuse" not in c.kv_sharing_modes[:5]
    full_sigs = layer_signatures(info.loaded.build(device="meta", seed=None), 35)
    model = info.loaded.build(info.proxy_config, device="cpu", seed=0)
    assert set(layer_signatures(model, 10)) == set(full_sigs)
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, c.vocab_size, (1, 16)), use_cache=False)
    assert torch.isfinite(out.logits).all()


@pytest.mark.parametrize("moe_width", [768, [768, 512] * 3])
def test_per_layer_expert_width_lists_size_the_experts_not_the_dense_width(moe_width):
    """An expert width field held as a per-layer list (as the width rule takes lists since
    Gemma 3n) sizes the experts as its int form does: intermediate_size is then the dense
    layers' width and shrinks to the dense proxy width (256 at tiny), the expert widths to the
    expert width (64), each layer keeping its share. Before, only an int counted: with a list,
    intermediate_size went to the experts' width (64)."""
    from transformers import PretrainedConfig

    from onboarding.load.proxy import PROXY_SIZES, shrink_config

    s = PROXY_SIZES["tiny"]
    full = PretrainedConfig(hidden_size=1024, num_attention_heads=8, num_hidden_layers=6,
                            intermediate_size=4096, num_experts=16, num_experts_per_tok=2,
                            moe_intermediate_size=moe_width, vocab_size=5000)
    c = shrink_config(full, "tiny", notes=[])
    assert c.intermediate_size == s.ffn
    if isinstance(moe_width, int):
        assert c.moe_intermediate_size == s.expert_ffn
    else:  # the kept layers' entries, the largest at the expert width
        assert c.moe_intermediate_size == [s.expert_ffn, s.expert_ffn * 512 // 768] * (
            len(c.moe_intermediate_size) // 2)


@pytest.mark.parametrize("ref,expect", [
    ("hf:ergo", {"first_dense_intermediate_size": 256, "shared_intermediate_size": 128,
                 "moe_intermediate_size": 64}),
    ("hf:llama4_text", {"intermediate_size_mlp": 256, "intermediate_size": 64}),
    ("hf:falcon", {"ffn_hidden_size": 256}),
])
def test_ffn_widths_named_otherwise_shrink_by_their_name(ref, expect):
    """FFN widths under names of their own (Ergo's first dense layers' and shared expert's,
    Llama 4's dense MLP, Falcon's ffn_hidden_size) shrink as the named ones do: a shared
    expert's to 2 x the expert width, a dense one's to the dense width. Before, the tiny proxy
    kept them at full size (Ergo's dense MLP 128 -> 32768 -> 128)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if ref[3:] not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"this transformers has no {ref[3:]}")
    c = text_config(load_stage(load_model(ref), "tiny").proxy_config)
    assert {k: getattr(c, k) for k in expect} == expect


def test_a_default_config_that_fails_its_own_validation_is_bad_input():
    """A model type whose own default config does not build in the installed transformers
    (gemma4_assistant in 5.25: its validator rejects its default hidden_size_per_layer_input)
    is the user's input: an InputError naming the type and the config's message (exit 2), not
    an internal error (before: the exception escaped, exit 1)."""
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from onboarding.errors import InputError

    class BrokenDefaultConfig(PretrainedConfig):
        model_type = "h81_broken_default"

        def __init__(self, width=3, **kwargs):
            if width % 2:
                raise TypeError(f"width must be even, got {width}")
            super().__init__(**kwargs)

    AutoConfig.register("h81_broken_default", BrokenDefaultConfig)
    try:
        with pytest.raises(InputError, match=r"default config of model_type 'h81_broken_default'"
                                             r" does not build .*width must be even"):
            load_model("hf:h81_broken_default")
    finally:
        CONFIG_MAPPING._extra_content.pop("h81_broken_default", None)
    with pytest.raises(InputError, match="unknown model_type 'h81_broken_default'"):
        load_model("hf:h81_broken_default")


def test_a_shared_layer_count_that_is_every_layer_stays_every_layer():
    """Gemma 4's unified assistant shares every layer's KV with its target model
    (num_kv_shared_layers = num_hidden_layers = 30). The proxy keeps that (every kept layer
    shared); before, 30 stayed while the layers shrank and the build failed ("The set of layer
    types producing a cache is different than the set of layer types using them"). Its forward
    needs the target's KV (shared_kv_states): it is no standalone decoder, only the build is
    checked."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if "gemma4_unified_assistant" not in CONFIG_MAPPING_NAMES:
        pytest.skip("this transformers has no gemma4_unified_assistant")
    info = load_stage(load_model("hf:gemma4_unified_assistant"), "tiny")
    c = text_config(info.proxy_config)
    assert c.num_kv_shared_layers == c.num_hidden_layers < 30
    info.loaded.build(info.proxy_config, device="meta", seed=None)


def test_sparse_selection_budgets_fit_under_the_proxy_lengths():
    """Kolibri 1.1's indexed attention keeps index_num_local_tokens (128) and
    index_num_sink_tokens (8) besides its index_topk, and selects from a pool of
    index_pool_size (16384): a query selects only when it sees more keys than that budget. The
    tiny proxy caps them all below its 32-64 tokens, so the selection runs (the layers read
    sparse_attention.topk); before, only index_topk was capped, the budget stayed 152 and the
    layers read attention.full."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if "kolibri1_1" not in CONFIG_MAPPING_NAMES:
        pytest.skip("this transformers has no kolibri1_1")
    c = text_config(load_stage(load_model("hf:kolibri1_1"), "tiny").proxy_config)
    assert c.index_topk + c.index_num_local_tokens + c.index_num_sink_tokens < 32
    assert c.index_pool_size < 64


def test_layer_counts_that_split_the_stack_split_the_kept_layers():
    """Dory runs n_input_layers once, loops n_recurrent_layers, then runs n_output_layers once;
    the three sum to num_hidden_layers (8 + 20 + 8 = 36). The tiny proxy keeps 4 layers and
    splits them the same way (1 + 2 + 1); before, 8 and 8 stayed, the derived recurrent count
    became -12 and the looped section never ran."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if "dory" not in CONFIG_MAPPING_NAMES:
        pytest.skip("this transformers has no dory")
    info = load_stage(load_model("hf:dory"), "tiny")
    c = text_config(info.proxy_config)
    parts = (c.n_input_layers, c.n_recurrent_layers, c.n_output_layers)
    assert min(parts) >= 1 and sum(parts) == c.num_hidden_layers < 36, parts
    info.loaded.build(info.proxy_config, device="meta", seed=None)


def test_a_period_that_fits_once_is_no_period():
    """Flint's 49 layers: 2 dense full-attention layers, then (sliding x 3, full) repeated, but
    the stack ends sliding, sliding, full. Prefix 3 and "period" 43 matched that (43 layers
    apart agree), and the tiny proxy kept 46 of the 49 layers. A period must repeat at least
    twice; without one, the stack is runs, and the proxy keeps one period of each run."""
    _model_type_or_skip("hf:flint")
    from transformers import AutoConfig

    from onboarding.load.proxy import _period, shrink_config

    assert _period(list("AABBBABBBABBBABBA")) == (0, 17)
    assert _period(list("AABBBABBBABBBABBBA")) == (1, 4)
    full = AutoConfig.for_model("flint")
    c = shrink_config(full, "tiny")
    assert c.num_hidden_layers <= 8, c.num_hidden_layers
    assert set(c.layer_types) == set(full.layer_types)
    assert c.mlp_only_layers and c.num_hidden_layers > max(c.mlp_only_layers) + 1


def test_a_per_layer_head_count_list_follows_the_head_count():
    """Laguna sizes each layer's attention by num_attention_heads_per_layer (48 a layer). The
    tiny proxy cut num_attention_heads to 4 and left the list at 48: q_proj 48 x 32 = 1536 wide
    at hidden 128, GQA 48:1. The list now follows the global count (4), and the proxy runs."""
    _model_type_or_skip("hf:laguna")
    info = load_stage(load_model("hf:laguna"), "tiny")
    c = text_config(info.proxy_config)
    assert max(c.num_attention_heads_per_layer) == c.num_attention_heads <= 4
    assert all(h % c.num_key_value_heads == 0 for h in c.num_attention_heads_per_layer)
    model = info.loaded.build(info.proxy_config, device="cpu", seed=0)
    q = model.get_submodule("model.layers.0.self_attn.q_proj").weight
    assert q.shape[0] == c.num_attention_heads * c.head_dim
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, c.vocab_size, (1, 16)), use_cache=False)
    assert torch.isfinite(out.logits).all()


def test_a_vocabulary_over_part_of_the_vocabulary_is_cut_to_the_proxy_vocabulary():
    """Gemma 3n's per-layer input embeddings cover the first vocab_size_per_layer_input tokens
    (262,144 of 262,400). Only a field equal to vocab_size followed it, so the tiny proxy kept a
    262,144 x 2,560 table, 674M parameters: `onboard align hf:gemma3n_text` was killed for memory.
    The field is now cut to the proxy's vocabulary, and the proxy is a few million again."""
    _model_type_or_skip("hf:gemma3n_text")
    info = load_stage(load_model("hf:gemma3n_text"), "tiny")
    c = text_config(info.proxy_config)
    assert c.vocab_size_per_layer_input == c.vocab_size <= 2048
    model = info.loaded.build(info.proxy_config, device="meta", seed=None)
    assert count_parameters(model).total < 10e6


class _DepthStack(torch.nn.Module):
    """A stack of full- and linear-attention layers; each linear layer holds a decay buffer, scaled by
    its depth as MiniMax scales its slopes (``depth``), constant, random or left uninitialised."""

    def __init__(self, cfg, decay: str):
        super().__init__()
        n = cfg.num_hidden_layers
        self.layers = torch.nn.ModuleList()
        for i, kind in enumerate(cfg.layer_types):
            layer = torch.nn.Module()
            layer.proj = torch.nn.Linear(cfg.hidden_size, cfg.hidden_size)
            if kind == "linear_attention":
                layer.gate = torch.nn.Linear(cfg.hidden_size, 2)
                f = 1 - i / (n - 1 + 1e-5) + 1e-5 if decay == "depth" else 1.0
                layer.register_buffer("slope", torch.empty(2) if decay == "uninitialised"
                                      else torch.rand(2) if decay == "random"
                                      else torch.tensor([0.5 * f, 0.25 * f]))
            self.layers.append(layer)


@pytest.mark.parametrize("decay, kept", [
    ("depth", ["full_attention", "linear_attention", "full_attention"]),
    ("constant", ["full_attention", "linear_attention"]),
    ("random", ["full_attention", "linear_attention"]),
    ("uninitialised", ["full_attention", "linear_attention"]),
])
def test_a_kind_whose_constants_depend_on_the_depth_is_not_only_the_last_layer(decay, kept):
    """MiniMax scales its linear layers' decay slopes by 1 - layer_idx / (L - 1 + 1e-5) + 1e-5.
    Its tiny proxy kept one period, full then linear: the one linear layer was the last, its
    slopes about 2e-5 of the model's, and a lightning-attention kernel with a wrong decay passed
    the gate there. A kind kept only as the proxy's last layer whose buffers change with the
    layer count gets the next layer after it; constant, random or uninitialised buffers change
    nothing, and the caller's random numbers are as they were."""
    from types import SimpleNamespace

    from transformers import PretrainedConfig

    from onboarding.load.proxy import proxy_config

    full = PretrainedConfig(hidden_size=1024, num_attention_heads=8, num_hidden_layers=8,
                            layer_types=["full_attention", "linear_attention"] * 4, vocab_size=5000)

    def build(cfg=None, *, device="cpu", seed=None):  # as LoadedModel.build
        if seed is not None:
            torch.manual_seed(seed)
        with torch.device(device):
            return _DepthStack(cfg or full, decay)

    loaded = SimpleNamespace(ref=f"test:depth_stack_{decay}", part="language", config=full,
                             is_hf=True, probe_proxy=None, build=build)
    meta = build(device="meta")
    torch.manual_seed(3)
    want = torch.rand(2)
    torch.manual_seed(3)
    cfg, _ = proxy_config(loaded, "tiny", meta)
    assert torch.equal(torch.rand(2), want)
    assert cfg.layer_types == kept and cfg.num_hidden_layers == len(kept)
    if decay == "depth":  # the linear layer's slopes are the model's, halved
        slope = build(cfg).layers[1].slope
        assert torch.allclose(slope, torch.tensor([0.25, 0.125]), rtol=1e-4)


def test_the_experts_own_model_width_shrinks_as_the_hidden_does():
    """An MoE block that projects the hidden state into a width of the experts' own and back
    (MuseSpark's moe_hidden_size, 4096) kept that width in the tiny proxy (55.3M parameters,
    experts 4096 wide around a hidden of 128): it is a model width, capped as hidden_size is;
    the experts' FFN width and the dense FFN keep their own caps."""
    from transformers import PretrainedConfig

    from onboarding.load.proxy import PROXY_SIZES, shrink_config

    s = PROXY_SIZES["tiny"]
    full = PretrainedConfig(hidden_size=1024, num_attention_heads=8, num_hidden_layers=4,
                            intermediate_size=4096, num_local_experts=16, num_experts_per_tok=2,
                            moe_intermediate_size=512, moe_hidden_size=512, vocab_size=5000)
    c = shrink_config(full, "tiny", notes=[])
    assert c.moe_hidden_size == s.hidden
    assert c.moe_intermediate_size == s.expert_ffn
    assert c.intermediate_size == s.ffn
    small = PretrainedConfig(hidden_size=1024, num_attention_heads=8, num_hidden_layers=4,
                             num_local_experts=16, moe_hidden_size=64, vocab_size=5000)
    assert shrink_config(small, "tiny", notes=[]).moe_hidden_size == 64  # below the cap: kept


def test_each_proxy_warning_is_shown_once_per_process():
    """Load, parse and generate each rebuild the proxy: its warnings printed three times a run
    (Python's "default" action forgets what it showed whenever a filter changes, as loading's
    `catch_warnings` do). Each distinct one is shown once; a new one still shows."""
    import uuid
    import warnings

    from onboarding.load.proxy import ProxyWarning, _warn

    note = f"a cap said once ({uuid.uuid4().hex})"
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()  # Python's own filters, not pytest's
        for _ in range(3):
            _warn("tiny", [note])
            with warnings.catch_warnings():  # what loading does between the stages
                warnings.simplefilter("ignore")
        _warn("tiny", [note + " and another"])
    shown = [str(w.message) for w in caught if issubclass(w.category, ProxyWarning)]
    assert shown == [f"tiny proxy: {note}", f"tiny proxy: {note} and another"]


def test_head_fit_retry_probes_each_distinct_config_once():
    """A proxy that does not run is retried with the head dims the model's code may fix (the
    full one, 128, 64), each as a head_dim field and with the heads refitted to it. Where a try
    shrinks to a config already probed (the full head dim 32 is what the first shrink kept, and
    4 heads of 32 already fill the width 128), it was built and run again for nothing: 7 probes
    for 5 distinct configs. Each distinct config is probed once, and the retry still takes the
    first that runs."""
    from types import SimpleNamespace

    from transformers import PretrainedConfig

    from onboarding.load.proxy import proxy_config

    full = PretrainedConfig(hidden_size=1024, num_attention_heads=32, num_key_value_heads=8,
                            head_dim=32, num_hidden_layers=4, vocab_size=5000)
    probed: list[str] = []

    def fails(cfg):
        probed.append(cfg.to_json_string())
        return False

    loaded = SimpleNamespace(ref="test:head_fit", part="language", config=full, is_hf=True,
                             probe_proxy=fails, build=None)
    cfg, note = proxy_config(loaded, "tiny")
    assert len(probed) == len(set(probed)) == 5
    assert "head dim" not in note  # nothing ran: the first shrink is kept

    def runs_64(cfg):  # only a head of 64 runs (two of them fill the width)
        probed.append(cfg.to_json_string())
        return cfg.head_dim == 64 and cfg.num_attention_heads == 2
    probed.clear()
    loaded.probe_proxy = runs_64
    cfg, note = proxy_config(loaded, "tiny")
    assert (cfg.head_dim, cfg.num_attention_heads) == (64, 2)
    assert "head dim 64, 2 head(s) of the width 128" in note
    assert len(probed) == len(set(probed)) == 5


def test_proxy_warnings_state_is_bounded():
    """The warn-once state is kept per warning filter list, holding each list (so that its id
    is not reused): every `catch_warnings` block that warned (one per test under pytest, each
    stage of a run) added an entry that was never dropped. It keeps the most recently used
    lists only, and the list in force still shows each note once."""
    import warnings

    from onboarding.load import proxy

    for i in range(3 * proxy.SHOWN_LISTS):
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("default")
            proxy._warn("tiny", [f"note {i}"])
    assert len(proxy._SHOWN) <= proxy.SHOWN_LISTS
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(2):
            proxy._warn("tiny", ["kept once"])
            for i in range(proxy.SHOWN_LISTS - 1):  # other lists, fewer than the limit
                with warnings.catch_warnings(record=True):
                    proxy._warn("tiny", [f"inner {i}"])
    assert [str(w.message) for w in caught] == ["tiny proxy: kept once"]
