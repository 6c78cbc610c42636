"""The dense GEMM parameters a token passes through, as the plan's step FLOPs
(`plan.shapes.ModelShape.dense_matmul`) and `onboard train`'s MFU count (`train.flops.step_flops`)
take them: a table a token reads by index is no GEMM wherever it sits, the head that multiplies
by a tied table is one (`train.flops.lookup_tables`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

FIXTURE = Path(__file__).parent / "fixtures" / "per_layer_input_models.py"


def _linear_weights(model: nn.Module) -> int:
    """Elements of the distinct ``nn.Linear`` weights: every GEMM weight of these models."""
    return sum(w.numel() for w in {id(m.weight): m.weight for m in model.modules()
                                   if isinstance(m, nn.Linear)}.values())


@pytest.mark.parametrize("name", ["PerLayerInputLM", "TiedPerLayerInputLM",
                                  "IndexedTablePerLayerInputLM"])
def test_lookup_tables_are_no_gemm_and_a_tied_head_is(name):
    """A per-layer input table (L x P values per token, read by token id) and the token table
    count no GEMM in either count; the head does, tied or not. Before: with the head tied and
    ``get_output_embeddings`` (Gemma 3n's layout) the plan took every ``nn.Embedding`` for the
    head, the per-layer table included (hf:gemma3n_text: its 2.35e9-parameter table counted as
    GEMMs); with a plain tie and the per-layer table a bare parameter read with
    ``F.embedding``, both counts took the table for a GEMM and missed the tied head."""
    from onboarding.graph.parse import load_stage, parse_stage
    from onboarding.load.spec import ModelSpec
    from onboarding.plan.run import shape_of
    from onboarding.train.flops import step_flops

    info = load_stage(ModelSpec(ref=f"{FIXTURE}:{name}").load(), "tiny")
    graph = parse_stage(info, seq=12, try_export=False)
    model = info.loaded.build(info.proxy_config, device="meta", seed=None)
    gemm = _linear_weights(model)
    assert gemm == 2 * 11264 + 64 * 32  # two layers' seven linears and the head
    assert shape_of(info, graph).dense_matmul == gemm
    tokens = 24
    parts = step_flops(graph, model, tokens=tokens, seq_len=12, lora_rank=4, expert_lora=False)
    assert parts["base_dense"] == 4 * gemm * tokens


@pytest.mark.parametrize("name", ["TiedPerLayerInputLM", "IndexedTablePerLayerInputLM"])
def test_tied_head_is_a_block_of_the_full_model(name):
    """A head tied to the token table is matched to its op-graph block (whose params the graph
    names once, under the table): no unmatched pattern, its ops counted, and recompute ``full``
    leaves its GEMM out of the re-run forward (it runs once, outside the layers). Before: the
    full-size head module listed the weight, the proxy block none; ``lm_head`` was unmatched,
    and the re-run forward charged the tied head's 64 x 32 GEMM."""
    from onboarding.graph.parse import load_stage, parse_stage
    from onboarding.load.spec import ModelSpec
    from onboarding.plan import PlanConfig
    from onboarding.plan.estimate import FORWARD, rerun_flops
    from onboarding.plan.run import shape_of

    info = load_stage(ModelSpec(ref=f"{FIXTURE}:{name}").load(), "tiny")
    graph = parse_stage(info, seq=12, try_export=False)
    shape = shape_of(info, graph)
    assert shape.unmatched == []
    head = [b for b in shape.blocks if b.pattern == "lm_head"]
    ops = sum(graph.by_kind("lm_head")[0].op_histogram.values())
    assert [(b.kind, b.linears, b.ops) for b in head] == [("lm_head", [("", 32, 64)], ops)]
    cfg = PlanConfig(gpus=1, seq=12, mode="full")
    assert rerun_flops(shape, cfg, "full")[0] == FORWARD * (shape.dense_matmul - 64 * 32)


@pytest.mark.parametrize("name", ["PerLayerInputLM", "TiedPerLayerInputLM"])
def test_tied_head_shows_the_table_once(name):
    """The plan's block summary shows the token table's V x D parameters once: on the embedding,
    a head tied to it holding none and marked ``tied_to`` it, so that the blocks' parameters sum
    to the model's total, tied or not. Before: the tied head showed the table's 64 x 32 too (the
    blocks summed to 29920 against a total of 27872)."""
    from onboarding.graph.parse import load_stage, parse_stage
    from onboarding.load.spec import ModelSpec
    from onboarding.plan.run import shape_of
    from onboarding.plan.search import shape_summary

    info = load_stage(ModelSpec(ref=f"{FIXTURE}:{name}").load(), "tiny")
    summary = shape_summary(shape_of(info, parse_stage(info, seq=12, try_export=False)))
    blocks = {b["pattern"]: b for b in summary["blocks"]}
    assert sum(b["params"] * b["count"] for b in summary["blocks"]) == summary["total_params"]
    tied = name.startswith("Tied")
    assert blocks["embed"]["params"] == 64 * 32 and "tied_to" not in blocks["embed"]
    assert blocks["lm_head"]["params"] == (0 if tied else 64 * 32)
    assert blocks["lm_head"].get("tied_to") == (["embed"] if tied else None)


@pytest.mark.parametrize("export", [False, True])
@pytest.mark.parametrize("name", ["SlicedTableLM", "IndexedTableLM", "CopiedSliceLM"])
def test_sliced_position_table_is_no_gemm(name, export):
    """A learned position table held as a bare parameter, sliced to the sequence
    (`SlicedTableLM`), read by tensor index (`IndexedTableLM`: ``pos[position_ids]``) or sliced
    and copied before it is added (`CopiedSliceLM`), is read, not multiplied: neither count takes
    it for GEMM weights, under either capture. Before: both counted its 80 x 16 values (the
    indexed and the copied tables until the tables were followed through index reads and
    copies)."""
    from onboarding.graph.parse import load_stage, parse_stage
    from onboarding.load.spec import ModelSpec
    from onboarding.plan.run import shape_of
    from onboarding.train.flops import step_flops

    ref = f"{Path(__file__).parent / 'fixtures' / 'position_table_models.py'}:{name}"
    info = load_stage(ModelSpec(ref=ref).load(), "tiny")
    graph = parse_stage(info, seq=12, try_export=export)
    assert graph.sliced_tables == ["pos"]
    model = info.loaded.build(info.proxy_config, device="meta", seed=None)
    gemm = _linear_weights(model)
    assert gemm == 16 * 48 + 16 * 16 + 16 * 256  # qkv, out, head
    assert shape_of(info, graph).dense_matmul == gemm
    parts = step_flops(graph, model, tokens=12, seq_len=12, lora_rank=4, expert_lora=False)
    assert parts["base_dense"] == 4 * gemm * 12


def test_one_d_parameters_are_no_gemm_in_either_count():
    """hf:gpt2's tiny proxy: the plan's dense GEMM parameters and training's are one count, its
    2-D weights less the position table (`flops.dense_gemm_params`); its biases and LayerNorm
    weights, 1-D, are elementwise work in both. Before: the plan counted the biases (its
    parameter categories call them dense), training did not."""
    from onboarding.graph.parse import load_stage, parse_stage
    from onboarding.load.model import load_model
    from onboarding.plan.run import shape_of
    from onboarding.train.flops import step_flops

    info = load_stage(load_model("hf:gpt2"), "tiny")
    graph = parse_stage(info, seq=12, try_export=False)
    model = info.loaded.build(info.proxy_config, device="meta", seed=None)
    two_d = {id(p): p for p in model.parameters() if p.ndim >= 2}
    biases = sum(p.numel() for n, p in model.named_parameters() if n.endswith(".bias"))
    assert biases > 0
    gemm = sum(p.numel() for p in two_d.values()) - model.transformer.wpe.weight.numel()
    assert shape_of(info, graph, config=info.proxy_config).dense_matmul == gemm
    parts = step_flops(graph, model, tokens=12, seq_len=12, lora_rank=4, expert_lora=False)
    assert parts["base_dense"] == 4 * gemm * 12


class _SlicedReads(nn.Module):
    """A position table sliced and added, a packed weight sliced into a linear, an expert
    weight selected into a matmul, a weight sliced into an einsum (which copies the strided
    slice before its bmm), a 1-D scale sliced: only the first is a table."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(32, d))
        self.packed = nn.Parameter(torch.randn(2 * d, d))
        self.experts = nn.Parameter(torch.randn(2, d, d))
        self.heads = nn.Parameter(torch.randn(2, d, 2 * d))
        self.scale = nn.Parameter(torch.ones(2 * d))

    def forward(self, x):
        t, d = x.shape[1], x.shape[2]
        x = x + self.pos[:t]
        x = nn.functional.linear(x, self.packed[:d]) * self.scale[:d]
        y = torch.einsum("btd,hde->bthe", x, self.heads[:, :, :d])
        return x @ self.experts[1] + y.sum(2)


def test_sliced_tables_by_what_reads_the_slice():
    from onboarding.graph.capture import record_eager

    model = _SlicedReads()
    cap = record_eager(model, (torch.randn(1, 5, 8),), {})
    assert cap.sliced_tables == ["pos"]


class _IndexedReads(nn.Module):
    """Tables read by tensor index or copied before they are added (``pos``, ``rows``,
    ``copied``), and their controls, which a matmul reads after the same index or copy: expert
    weights gathered per token into a bmm, a weight sliced and copied into a matmul, a weight
    cast before its linear."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(32, d))
        self.rows = nn.Parameter(torch.randn(32, d))
        self.copied = nn.Parameter(torch.randn(1, 32, d))
        self.experts = nn.Parameter(torch.randn(4, d, d))
        self.packed = nn.Parameter(torch.randn(d, 2 * d))
        self.cast = nn.Parameter(torch.randn(d, d, dtype=torch.float64))

    def forward(self, x):
        b, t, d = x.shape
        ids = torch.arange(t)[None]
        x = x + self.pos[ids] + self.rows.index_select(0, ids[0])
        x = x + self.copied[:, :t].expand(b, -1, -1).contiguous() + self.copied[0, :t].clone()
        w = self.experts[ids % 4]  # [1, t, d, d]: a weight per token
        y = torch.matmul(x.unsqueeze(-2), w).squeeze(-2)
        y = y @ self.packed[:, :d].clone() + nn.functional.linear(y, self.cast.to(y.dtype))
        return y


def test_tables_read_by_index_or_copied_are_tables():
    """A parameter read by tensor index (``pos[ids]``, ``index_select``) or sliced and copied
    before it is added is a table; a weight that reaches a matmul through the same index or copy
    is none. Before: only ``pos[:T]`` read in place counted (an index or a copy hid the reader)."""
    from onboarding.graph.capture import record_eager

    model = _IndexedReads()
    cap = record_eager(model, (torch.randn(2, 5, 8),), {})
    assert cap.sliced_tables == ["copied", "pos", "rows"]


@pytest.mark.slow
def test_gemma3n_gemm_params_are_its_linears():
    """hf:gemma3n_text at full size: the plan's and training's GEMM parameters are its linears'
    (the head tied to the token table among them), not its per-layer input table (262144 rows x
    35 layers x 256), and neither holds a 1-D parameter (a scale on a module with children,
    AltUp's ``correct_output_scale``, which the plan's count held before)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from onboarding.graph.parse import load_stage
    from onboarding.load.model import load_model
    from onboarding.plan.capture import plan_graph
    from onboarding.plan.run import shape_of
    from onboarding.train.flops import step_flops

    if "gemma3n_text" not in CONFIG_MAPPING_NAMES:
        pytest.skip("this transformers has no gemma3n_text")
    info = load_stage(load_model("hf:gemma3n_text"), "tiny")
    graph = plan_graph(info)[0]
    model = info.loaded.build(None, device="meta", seed=None)
    gemm = _linear_weights(model)
    per_layer = model.get_submodule("model.embed_tokens_per_layer").weight
    assert per_layer.numel() == 262144 * 35 * 256
    assert shape_of(info, graph).dense_matmul == gemm
    parts = step_flops(graph, model, tokens=1, seq_len=1, lora_rank=4, expert_lora=False)
    assert parts["base_dense"] == 4 * gemm
