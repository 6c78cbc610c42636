"""The rope family's patch binding (kernel_templates/rope/binding.py): the rotary-application
function the attention blocks hand q/k and the rope block's cos/sin tables to is swapped for the
Triton kernel (run in the interpreter here), checked against the original on its first call.

Tiny models written here, each with its own rotation function; none is named like
transformers' (the binding finds the function by the tables it is handed)."""

from __future__ import annotations

import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from torch import nn

from onboarding.families import families, family_module
from onboarding.generate import templating
from onboarding.graph.opgraph import Block
from onboarding.patching.core import PatchRecord
from fixtures.hub_function import function_module

binding = family_module("rope").binding if hasattr(family_module("rope"), "binding") else None


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """kernel(variant, **params) -> the rendered rope module, loaded."""
    root, cache = tmp_path_factory.mktemp("rope_kernels"), {}

    def load(variant: str, **params):
        key = (variant, tuple(sorted(params.items())))
        if key not in cache:
            name = "_".join([variant, *(f"{k}{v}" for k, v in sorted(params.items()))])
            path = templating.write_module(templating.render("rope", variant, params),
                                           root / "rope" / f"{name}.py")
            cache[key] = templating.load_module(path)
        return cache[key]

    return load


# --- rotation functions, as models write them ---------------------------------------------

def _half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _pairs(x):
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def rotate_qk(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):  # q/k [B, H, T, D]
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _half(q) * sin, k * cos + _half(k) * sin


def rotate_qk_partial(q, k, cos, sin):  # the first cos.shape[-1] dims rotate, the rest pass
    r = cos.shape[-1]
    cos, sin = cos[:, None], sin[:, None]

    def one(x):
        xr, xp = x[..., :r], x[..., r:]
        return torch.cat((xr * cos + _half(xr) * sin, xp), dim=-1)

    return one(q), one(k)


def rotate_qk_pairs(q, k, cos, sin):  # interleaved pairs; tables hold each frequency twice
    cos, sin = cos[:, None], sin[:, None]
    return q * cos + _pairs(q) * sin, k * cos + _pairs(k) * sin


def rotate_qk_made_up(q, k, cos, sin):  # no rotation: a reversal of the head, scaled
    cos, sin = cos[:, None], sin[:, None]
    return q * cos + q.flip(-1) * sin, k * cos + k.flip(-1) * sin


def rotate_one(x, cos, sin):  # one tensor [B, T, H, D] at a time (the built-in example's form)
    return x * cos[:, :, None] + _half(x) * sin[:, :, None]


class Tables(nn.Module):
    """The rope block: cos/sin [B, T, R], each frequency twice (half-split or interleaved)."""

    def __init__(self, rotary: int, interleaved: bool = False, theta: float = 10000.0):
        super().__init__()
        self.rotary, self.interleaved, self.theta = rotary, interleaved, theta

    def forward(self, x, pos):
        inv = 1.0 / self.theta ** (torch.arange(0, self.rotary, 2, dtype=torch.float32) / self.rotary)
        f = pos.float()[..., None] * inv
        e = f.repeat_interleave(2, dim=-1) if self.interleaved else torch.cat((f, f), dim=-1)
        return e.cos().to(x.dtype), e.sin().to(x.dtype)


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int, head_dim: int, rotate, one: bool):
        super().__init__()
        self.h, self.hk, self.d, self.one = heads, kv_heads, head_dim, one
        self.rotate = rotate  # an instance attribute: reachable as the block's own function
        self.q = nn.Linear(width, heads * head_dim, bias=False)
        self.k = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.v = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, width, bias=False)

    def forward(self, x, tables):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.h, self.d)
        k = self.k(x).view(B, T, self.hk, self.d)
        v = self.v(x).view(B, T, self.hk, self.d).transpose(1, 2)
        cos, sin = tables
        if self.one:
            q, k = self.rotate(q, cos, sin).transpose(1, 2), self.rotate(k, cos, sin).transpose(1, 2)
        else:
            q, k = self.rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        g = self.h // self.hk
        o = nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True)
        return self.o(o.transpose(1, 2).reshape(B, T, -1))


class TinyLM(nn.Module):
    def __init__(self, rotate, head_dim=8, rotary=8, interleaved=False, one=False, layers=2):
        super().__init__()
        width, self.vocab = 16, 40
        self.embed = nn.Embedding(self.vocab, width)
        self.rotary_emb = Tables(rotary, interleaved)
        self.layers = nn.ModuleList(Attention(width, 4, 2, head_dim, rotate, one) for _ in range(layers))
        self.head = nn.Linear(width, self.vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
        tables = self.rotary_emb(x, pos)
        for layer in self.layers:
            x = x + layer(x, tables)
        return self.head(x)


def _block(path="rotary_emb") -> Block:
    return Block(path=path, kind="rope", layer=None, class_name="Tables", attrs={})


class _Counting:
    """Counts the kernel module's forward (entry) and backward (rope_bwd_op) launches."""

    def __init__(self, mod, monkeypatch):
        self.fwd = self.bwd = 0
        entry, bwd = mod.entry, mod.rope_bwd_op

        def fwd_(*a):
            self.fwd += 1
            return entry(*a)

        def bwd_(*a):
            self.bwd += 1
            return bwd(*a)

        monkeypatch.setattr(mod, "entry", fwd_)
        monkeypatch.setattr(mod, "rope_bwd_op", bwd_)


def _run(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _bound(model, mods):
    record = PatchRecord(path="rotary_emb", kind="rope", family="rope")
    undo = binding.bind(_block(), model.rotary_emb, mods, record, model)
    return record, undo


def _assert_same(a, b, tol=1e-5):
    (oa, ga), (ob, gb) = a, b
    torch.testing.assert_close(oa, ob, atol=tol, rtol=tol)
    assert ga.keys() == gb.keys()
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], atol=tol, rtol=tol, msg=n)


def test_the_family_declares_its_binding():
    assert families()["rope"].binding is not None


@pytest.mark.parametrize("rotate, one", [(rotate_qk, False), (rotate_one, True)],
                         ids=["q_k_BHTD", "one_tensor_BTHD"])
def test_patches_a_llama_like_model(kernel, monkeypatch, rotate, one):
    """The function handed the tables is swapped in every attention block: the record is
    active and names them, the kernel runs forward and backward (per layer one call for q and k
    together, or one each), and the logits and every gradient match the unpatched model's."""
    torch.manual_seed(0)
    model, ids = TinyLM(rotate, one=one), torch.randint(0, 40, (2, 7))
    ref = _run(model, ids)
    mod = kernel("half")
    count = _Counting(mod, monkeypatch)
    record, undo = _bound(model, [mod])
    assert undo is not None and record.status == "pending"
    got = _run(model, ids)
    assert record.status == "active", record
    assert record.sites == ["layers.0", "layers.1"]
    assert "rotate" in record.binding and "half" in record.binding
    # the first call also ran the readings under no_grad: count the serving calls after it
    count.fwd = count.bwd = 0
    got = _run(model, ids)
    calls = 4 if one else 2
    assert count.fwd == calls and count.bwd == calls, (count.fwd, count.bwd)
    _assert_same(got, ref)
    undo()
    count.fwd = 0
    _assert_same(_run(model, ids), ref)
    assert count.fwd == 0  # restored: the model's own function again
    assert "forward" not in vars(model.rotary_emb) and "forward" not in vars(model.layers[0])


def test_partial_rotary_dim(kernel, monkeypatch):
    """Tables over R = 8 of a 16-wide head: the kernel rotates those, the rest passes through."""
    torch.manual_seed(1)
    model, ids = TinyLM(rotate_qk_partial, head_dim=16, rotary=8), torch.randint(0, 40, (2, 6))
    ref = _run(model, ids)
    mod = kernel("half", rotary_dim=8)
    count = _Counting(mod, monkeypatch)
    record, undo = _bound(model, [mod])
    _run(model, ids)
    count.fwd = count.bwd = 0
    got = _run(model, ids)
    assert record.status == "active" and "rotary dim 8" in record.binding, record
    assert count.fwd == 2 and count.bwd == 2
    _assert_same(got, ref)
    undo()


def test_interleaved_pairs_take_the_interleaved_variant(kernel):
    """A model rotating interleaved pairs: the half-split kernel alone is refused (calibration
    says why), with both variants given the interleaved one is kept."""
    torch.manual_seed(2)
    model, ids = TinyLM(rotate_qk_pairs, interleaved=True), torch.randint(0, 40, (1, 5))
    ref = _run(model, ids)
    record, undo = _bound(model, [kernel("half")])
    _assert_same(_run(model, ids), ref, tol=0)
    assert record.status == "rejected" and "calibration" in record.detail, record
    undo()
    record, undo = _bound(model, [kernel("half"), kernel("interleaved")])
    got = _run(model, ids)
    assert record.status == "active" and "interleaved" in record.binding, record
    _assert_same(got, ref)
    undo()


def rotate_qk_once(q, k, cos, sin):  # tables of each frequency once, [.., D/2] (gpt-oss)
    cos, sin = cos[:, None], sin[:, None]

    def one(x):
        a, b = x.chunk(2, dim=-1)
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

    return one(q), one(k)


class HalfTables(Tables):
    def forward(self, x, pos):
        cos, sin = super().forward(x, pos)
        return cos[..., : self.rotary // 2], sin[..., : self.rotary // 2]


def test_tables_of_each_frequency_once(kernel):
    """Tables [.., D/2] that rotate the whole head (gpt-oss's form): the kernel takes them
    doubled; a kernel rendered for rotary dim D/2 (the tables' width) is refused, saying why."""
    torch.manual_seed(7)
    model, ids = TinyLM(rotate_qk_once), torch.randint(0, 40, (2, 5))
    model.rotary_emb = HalfTables(8)
    ref = _run(model, ids)
    record, undo = _bound(model, [kernel("half")])
    got = _run(model, ids)
    assert record.status == "active" and "each frequency once" in record.binding, record
    _assert_same(got, ref)
    undo()
    record, undo = _bound(model, [kernel("half", rotary_dim=4)])
    _assert_same(_run(model, ids), ref, tol=0)
    assert record.status == "rejected" and "calibration" in record.detail, record
    assert "rotary dim 8, [B, H, T, D], tables of each frequency once (doubled) (probe)" in \
        record.detail, record.detail
    assert "half kernel (rotary dim 4): ValueError: rope: rendered for rotary_dim=4" in \
        record.detail, record.detail
    undo()


def test_a_made_up_rotation_is_refused_and_left_unpatched(kernel, monkeypatch):
    """A function handed the tables that no reading of the kernel reproduces keeps the
    original: the record is rejected with the reason, the outputs are the model's own (exactly),
    and later calls never reach the kernel."""
    torch.manual_seed(3)
    model, ids = TinyLM(rotate_qk_made_up), torch.randint(0, 40, (2, 5))
    ref = _run(model, ids)
    mod = kernel("half")
    count = _Counting(mod, monkeypatch)
    record, undo = _bound(model, [mod, kernel("interleaved")])
    got = _run(model, ids)
    assert record.status == "rejected", record
    assert "no candidate layout reproduced it (probe)" in record.detail
    assert "layers.0" in record.detail and "rotate" in record.detail and record.sites == []
    _assert_same(got, ref, tol=0)
    count.fwd = count.bwd = 0
    _assert_same(_run(model, ids), ref, tol=0)
    assert count.fwd == 0 and count.bwd == 0
    undo()


def _sum3(a, b, c):  # a three-argument helper that is never handed the tables
    return a + b + c


@pytest.mark.parametrize("helper", [False, True], ids=["nothing_reachable", "never_handed"])
def test_inline_rotation_is_rejected_with_the_reason(kernel, helper):
    """Attention that rotates inline: with no function of three arguments reachable the bind
    is refused at once; with one that is never handed the tables, after the first forward. The
    record says the rotation runs inline; the model's outputs are its own."""

    class Inline(Attention):
        def forward(self, x, tables):
            B, T, _ = x.shape
            q = self.q(x).view(B, T, self.h, self.d)
            cos, sin = tables
            q = q * cos[:, :, None] + _half(q) * sin[:, :, None]
            if self.one:
                q = self.mix(q, q, q)
            return self.o(q.reshape(B, T, -1))

    torch.manual_seed(4)
    model, ids = TinyLM(rotate_qk), torch.randint(0, 40, (1, 4))
    model.layers = nn.ModuleList(Inline(16, 4, 2, 8, None, helper) for _ in range(2))
    for layer in model.layers:
        layer.mix = _sum3 if helper else None
    ref = _run(model, ids)
    record, undo = _bound(model, [kernel("half")])
    assert (undo is not None) == helper
    if helper:
        assert record.status == "pending"
        _assert_same(_run(model, ids), ref, tol=0)
        undo()
    assert record.status == "rejected" and "the rotation runs inline" in record.detail, record


def test_two_rope_blocks_each_serve_their_own_tables(kernel):
    """Two table modules (local / global layers) handing their tables to the same function:
    each patch serves its own tables' calls, with its own kernel (a rotary dim pinned per
    block), and neither takes the other's."""

    class TwoTables(TinyLM):
        def __init__(self):
            super().__init__(rotate_qk, head_dim=8, rotary=8)
            self.rotary_local = Tables(8, theta=100.0)

        def forward(self, ids):
            x = self.embed(ids)
            pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
            glob, local = self.rotary_emb(x, pos), self.rotary_local(x, pos)
            for i, layer in enumerate(self.layers):
                x = x + layer(x, local if i % 2 else glob)
            return self.head(x)

    torch.manual_seed(5)
    model, ids = TwoTables(), torch.randint(0, 40, (2, 5))
    ref = _run(model, ids)
    ra, undo_a = _bound(model, [kernel("half")])
    rb = PatchRecord(path="rotary_local", kind="rope", family="rope")
    undo_b = binding.bind(_block("rotary_local"), model.rotary_local, [kernel("half")], rb, model)
    got = _run(model, ids)
    assert ra.status == rb.status == "active", (ra, rb)
    assert ra.sites == ["layers.0"] and rb.sites == ["layers.1"], (ra.sites, rb.sites)
    _assert_same(got, ref)
    _assert_same(_run(model, ids), ref)
    undo_b()
    undo_a()


rotate_hub = function_module(rotate_qk)  # the module-level name the attention below calls


class HubAttention(Attention):
    def forward(self, x, tables):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.h, self.d).transpose(1, 2)
        k = self.k(x).view(B, T, self.hk, self.d).transpose(1, 2)
        cos, sin = tables
        q, k = rotate_hub(q, k, cos, sin)
        s = q @ k.repeat_interleave(self.h // self.hk, 1).transpose(-1, -2)
        return self.o((s.softmax(-1) @ q).transpose(1, 2).reshape(B, T, -1))


def test_hub_function_and_one_table_module_per_layer_type(kernel):
    """Transformers 5.25's shapes: the rotation is a hub-decorated function (a stateless
    module: each access to its forward is a new bound method), and one table module is called
    once per layer type (Gemma 3's sliding and full tables): every layer is served, with
    either call's tables."""

    class PerType(TinyLM):
        def forward(self, ids):
            x = self.embed(ids)
            pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
            tables = [self.rotary_emb(x, pos), self.rotary_emb(x, pos * 2)]
            for i, layer in enumerate(self.layers):
                x = x + layer(x, tables[i == len(self.layers) - 1])
            return self.head(x)

    torch.manual_seed(6)
    model, ids = PerType(None, layers=3), torch.randint(0, 40, (2, 5))
    model.layers = nn.ModuleList(HubAttention(16, 4, 2, 8, None, False) for _ in range(3))
    ref = _run(model, ids)
    record, undo = _bound(model, [kernel("half")])
    got = _run(model, ids)
    assert record.status == "active", record
    assert record.sites == ["layers.0", "layers.1", "layers.2"], record.sites
    _assert_same(got, ref)
    _assert_same(_run(model, ids), ref)
    undo()


def test_backward_is_judged_where_the_kernel_ran():
    """`verdicts.backward_unchecked`: a patch whose kernel ran in other blocks (`sites`) has
    its backward judged there: checked when a gradient flowed through them, listed when none
    did; the rope block's own no-gradient tables do not decide it."""
    from types import SimpleNamespace as NS

    from onboarding.align.verdicts import backward_unchecked

    def blk(path, bwd):
        return NS(path=path, bwd=NS(verdict=bwd))

    rec = PatchRecord(path="rotary_emb", kind="rope", family="rope", status="active",
                      sites=["layers.0"])
    result = NS(blocks=[blk("rotary_emb", "no_grad"), blk("layers.0", "pass")])
    assert backward_unchecked(result, [rec], {}, {}) == []
    result = NS(blocks=[blk("rotary_emb", "no_grad"), blk("layers.0", "no_grad")])
    out = backward_unchecked(result, [rec], {}, {})
    assert [x["path"] for x in out] == ["rotary_emb"] and "layers.0" in out[0]["reason"]
    # without sites, as before: the rope block's own backward (no gradient) is what is judged
    rec.sites = []
    out = backward_unchecked(NS(blocks=[blk("rotary_emb", "no_grad")]), [rec], {}, {})
    assert out and out[0]["reason"] == "no gradient flows through it"


@pytest.mark.slow  # 37 s on 2 shared cores (the example's parse, generate and alignment)
def test_example_rope_blocks_are_patched_and_checked(tmp_path, monkeypatch):
    """`onboard align --kernels rope` on the built-in example: every rope block's patch is
    active, none of them is listed as not checked (before: model.rotary_emb, "no patch
    binding"), and the alignment passes. The model's tables' kernel ran in the two sparse
    attention blocks, whose backward passes; the indexers' own tables' kernel ran in the
    indexers, through which no gradient flows (their top-k): alignment says so."""
    from onboarding.cli.main import main

    monkeypatch.chdir(tmp_path)
    assert main(["align", "--out", "a", "--seq", "16", "--kernels", "rope"]) == 0
    res = json.loads((tmp_path / "a" / "alignment.json").read_text())
    rope = [p for p in res["patches"] if p["family"] == "rope"]
    assert len(rope) == 3 and all(p["status"] == "active" and p.get("sites") for p in rope), rope
    sites = {p["path"]: p["sites"] for p in rope}
    assert sites["model.rotary_emb"] == ["model.layers.3.self_attn", "model.layers.7.self_attn"]
    assert sites["model.layers.3.self_attn.indexer.rotary"] == ["model.layers.3.self_attn.indexer"]
    # the other families are left out here (--kernels rope): each says so, no rope block does
    assert res["coverable"] == 68
    assert {x["reason"].split(" not selected")[0] for x in res["not_checked"]} <= {
        "conv1d", "gated_delta", "moe_experts", "moe_router", "rmsnorm", "sparse_attention",
        "swiglu"}, res["not_checked"]
    assert len(res["not_checked"]) == 68 - 3
    unchecked_bwd = {x["path"]: x["reason"] for x in res["backward_not_checked"]}
    assert "model.rotary_emb" not in unchecked_bwd
    assert unchecked_bwd.get("model.layers.3.self_attn.indexer.rotary") == "no gradient flows through it"


# --- the layout found by probing the function; coverage predicts what the binding does ---------

def _written_out(rotation: str, columns: str, axis: int, swapped: bool):
    """A rotation function of the given layout, written as models write theirs (not the
    binding's code): q, k [B, T, H, D] (axis 2) or [B, H, T, D] (axis 1), tables [B, T, W]."""
    def fn(q, k, cos, sin):
        if swapped:
            cos, sin = sin, cos
        w = cos.shape[-1]
        if columns == "first pairs":
            cos, sin = cos[..., : w // 2], sin[..., : w // 2]
        if columns != "each":
            if rotation == "interleaved":
                cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
            else:
                cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        r = cos.shape[-1]
        cos, sin = cos.unsqueeze(axis), sin.unsqueeze(axis)

        def one(x):
            xr = x[..., :r]
            if rotation == "deinterleaved":  # DeepSeek-V3's: (2i, 2i + 1) -> (i, i + r/2) first
                xr = torch.cat((xr[..., 0::2], xr[..., 1::2]), dim=-1)
            rot = _pairs(xr) if rotation == "interleaved" else _half(xr)
            return torch.cat((xr * cos + rot * sin, x[..., r:]), dim=-1)

        return one(q), one(k)

    return fn


def test_detect_finds_each_layout_by_probing():
    """Every candidate layout, written out as a model would: probing the function with known
    inputs finds that layout and no other (random tables: no two layouts agree by chance)."""
    B, T, H, Hk, D, W = 2, 5, 3, 1, 16, 8
    for layout in binding._layouts():
        fn = _written_out(layout.rotation, layout.columns, layout.head_axis, layout.swapped)
        shape = (B, T) if layout.head_axis == 2 else (B,)
        q = torch.randn(*shape, H, *(() if layout.head_axis == 2 else (T,)), D)
        k = torch.randn(*shape, Hk, *(() if layout.head_axis == 2 else (T,)), D)
        cos, sin = torch.randn(B, T, W), torch.randn(B, T, W)
        call = binding._Call(fn, (q, k, cos, sin), {}, {binding._storage(cos), binding._storage(sin)})
        found, why = binding.detect(fn, call, (q, k, cos, sin), {})
        assert found == [layout], (layout, found, why)
        assert found[0].rotary_dim(W) == (2 * W if layout.columns == "pairs" else W)


def rotate_qk_glm(q, k, cos, sin):  # GLM's: interleaved pairs, angles from the doubled table's first half
    cos, sin = cos[:, None], sin[:, None]
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    r = cos.shape[-1]

    def one(x):
        xr, xp = x[..., :r], x[..., r:]
        return torch.cat((xr * cos + _pairs(xr) * sin, xp), dim=-1)

    return one(q), one(k)


def test_interleaved_rotation_of_a_doubled_table(kernel, monkeypatch):
    """GLM's form: half-split tables of R = 8 of a 16-wide head, the function reading their
    first half per interleaved pair: the probe finds it, the interleaved kernel (rotary dim 8)
    serves it forward and backward, the half-split kernel given alone is refused saying which
    layout was found."""
    torch.manual_seed(8)
    model, ids = TinyLM(rotate_qk_glm, head_dim=16, rotary=8), torch.randint(0, 40, (2, 6))
    ref = _run(model, ids)
    record, undo = _bound(model, [kernel("half", rotary_dim=8)])
    _assert_same(_run(model, ids), ref, tol=0)
    assert record.status == "rejected" and "interleaved, rotary dim 8" in record.detail, record
    assert "no kernel of its rotation was given (given: half kernel (rotary dim 8))" in record.detail
    undo()
    mod = kernel("interleaved", rotary_dim=8)
    count = _Counting(mod, monkeypatch)
    record, undo = _bound(model, [kernel("half", rotary_dim=8), mod])
    _run(model, ids)
    assert record.status == "active" and "tables read by pair from their first half" in record.binding
    count.fwd = count.bwd = 0
    got = _run(model, ids)
    assert count.fwd == 2 and count.bwd == 2, (count.fwd, count.bwd)
    _assert_same(got, ref)
    undo()


def rotate_qk_deinterleaved(q, k, cos, sin):  # DeepSeek-V3's older form: move the pairs, rotate half
    cos, sin = cos[:, None], sin[:, None]

    def one(x):
        b, h, t, d = x.shape
        x = x.view(b, h, t, d // 2, 2).transpose(4, 3).reshape(b, h, t, d)
        return x * cos + _half(x) * sin

    return one(q), one(k)


def test_deinterleaved_pairs_take_the_half_kernel(kernel, monkeypatch):
    """Pairs (2i, 2i + 1) moved to (i, i + D/2) and rotated half-split, the output left so
    (DeepSeek-V3's `rope_interleave`): the probe finds it, the half-split kernel serves it after
    the same move, forward and backward."""
    torch.manual_seed(9)
    model, ids = TinyLM(rotate_qk_deinterleaved), torch.randint(0, 40, (2, 6))
    ref = _run(model, ids)
    mod = kernel("half")
    count = _Counting(mod, monkeypatch)
    record, undo = _bound(model, [kernel("interleaved"), mod])
    _run(model, ids)
    assert record.status == "active" and "deinterleaved" in record.binding, record
    assert "half kernel" in record.binding, record.binding
    count.fwd = count.bwd = 0
    got = _run(model, ids)
    assert count.fwd == 2 and count.bwd == 2, (count.fwd, count.bwd)
    _assert_same(got, ref)
    undo()


HF_LAYOUTS = {  # transformers' tiny proxies: (variant, rotary dim / the tables' width, columns)
    "hf:llama": ("half", 1, "each"),
    "hf:glm": ("interleaved", 1, "first pairs"),
    "hf:gpt_oss": ("half", 2, "pairs"),
}


@pytest.mark.parametrize("ref", list(HF_LAYOUTS))
def test_coverage_renders_the_layout_the_probe_found(ref, parse_model, kernel):
    """The parse stage's probe records the rotation call and its layout; coverage renders that
    layout's kernel (GLM: interleaved; gpt-oss: rotary dim twice its tables' width, not the
    width), and the binding takes the proxy with it."""
    from onboarding.coverage import build_coverage
    from onboarding.graph.parse import example_inputs, load_stage
    from onboarding.load.model import load_model
    from onboarding.patching.core import patch_model

    pytest.importorskip("transformers")
    variant, times, columns = HF_LAYOUTS[ref]
    g = parse_model(ref)
    block = next(b for b in g.blocks if b.kind == "rope")
    found = block.attrs["core_calls"]["rotary"]
    width = found["calls"][0]["width"]
    assert found["calls"][0]["layouts"][0]["columns"] == columns, found
    entry = next(e for e in build_coverage(g).entries if e.path == block.path and e.family == "rope")
    assert entry.status in ("template", "kernel") and entry.variant == variant, entry
    assert entry.params["rotary_dim"] == times * width, entry
    info = load_stage(load_model(ref))
    model = info.loaded.build(info.proxy_config, seed=0).eval()
    inputs, kwargs = example_inputs(model, info.proxy_config, 1, 8, 0)
    mods = {(block.path, "rope"): kernel(variant, rotary_dim=times * width)}
    with patch_model(model, g, mods, kinds={"rope"}) as patches, torch.no_grad():
        model(*inputs, **kwargs)
        assert [r.status for r in patches.records] == ["active"], patches.records


def rotate_varargs(*args):  # a rotation the binding cannot swap: no three required arguments
    q, k, cos, sin = args[:4]
    return rotate_qk(q, k, cos, sin)


@pytest.mark.parametrize("fn, why", [
    (rotate_qk_made_up, "no candidate layout reproduced it (probe)"),
    (rotate_varargs, "the rotation runs inline"),
], ids=["made_up", "not_swappable"])
def test_coverage_says_the_binding_would_refuse(fn, why, monkeypatch, kernel):
    """A transformers proxy (llama) whose rotation no layout reproduces, or whose function the
    binding cannot swap: coverage no longer counts the rope block covered, its entry says the
    binding's reason; the binding bound anyway rejects it with the same reason."""
    from onboarding.coverage import build_coverage
    from onboarding.graph.parse import example_inputs, load_stage, parse_stage
    from onboarding.load.model import load_model
    from onboarding.patching.core import patch_model

    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    monkeypatch.setattr(llama, "apply_rotary_pos_emb", fn)
    info = load_stage(load_model("hf:llama"))
    g = parse_stage(info, seq=8, try_export=False)
    block = next(b for b in g.blocks if b.kind == "rope")
    assert families()["rope"].match(block) is None
    entries = [e for e in build_coverage(g).entries if e.path == block.path]
    assert not any(e.status in ("template", "kernel") for e in entries), entries
    refused = [e for e in entries if e.status == "uncovered"]
    assert len(refused) == 1 and "its binding would leave this block unpatched" in refused[0].reason
    assert why in refused[0].reason, refused[0].reason
    model = info.loaded.build(info.proxy_config, seed=0).eval()
    inputs, kwargs = example_inputs(model, info.proxy_config, 1, 8, 0)
    with patch_model(model, g, {(block.path, "rope"): kernel("half")}) as patches, torch.no_grad():
        model(*inputs, **kwargs)
        (record,) = patches.records
    assert record.status == "rejected" and why in record.detail, record


@pytest.mark.slow  # 4 s (glm), 10 s (gpt_oss), 11 s (deepseek_v3) on 2 shared cores
@pytest.mark.parametrize("model", ["glm", "gpt_oss", "deepseek_v3"])
def test_transformers_rope_layouts_align(model, tmp_path, monkeypatch):
    """`onboard align hf:<model> --kernels rope`: GLM's interleaved rotation, gpt-oss's tables
    of each frequency once and DeepSeek-V3's deinterleaved pairs are patched (before: refused)
    and the alignment passes."""
    from onboarding.cli.main import main

    pytest.importorskip(f"transformers.models.{model}")
    monkeypatch.chdir(tmp_path)
    assert main(["align", f"hf:{model}", "--out", "a", "--seq", "16", "--kernels", "rope",
                 "--llm", "off", "-q"]) == 0
    res = json.loads((tmp_path / "a" / "alignment.json").read_text())
    rope = [p for p in res["patches"] if p["family"] == "rope"]
    assert [p["status"] for p in rope] == ["active"] and len(rope[0]["sites"]) >= 2, rope
    assert res["passed"], res["culprit"]


# --- a vision tower's rotary: the patches of packed images, 3-D q/k, tables from grid positions ---

def rotate_packed(q, k, cos, sin):  # q/k [T, H, D] (no batch dim), tables [T, D]; fp32 inside
    dq, dk = q.dtype, k.dtype
    q, k = q.float(), k.float()
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    return (q * cos + _half(q) * sin).to(dq), (k * cos + _half(k) * sin).to(dk)


class GridTables(nn.Module):
    """2-D axial tables from each patch's (row, column): a quarter of the head's frequencies per
    axis, [T, D] (rows then columns, doubled as transformers' vision towers make them)."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.register_buffer("inv", 1.0 / 100.0 ** (torch.arange(0, head_dim // 2, 2).float() / (head_dim // 2)),
                             persistent=False)

    def forward(self, x, grid):  # grid [T, 2]
        f = (grid[..., None].float() * self.inv).flatten(-2)  # [T, D/2]: rows' then columns'
        e = torch.cat((f, f), dim=-1)
        return e.cos(), e.sin()


class PackedAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.h = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.o = nn.Linear(width, width)

    def forward(self, x, tables):  # x [T, width]: the patches of every image, packed
        T = x.shape[0]
        q, k, v = self.qkv(x).reshape(T, 3, self.h, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = rotate_packed(q, k, *tables)
        o = nn.functional.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)))
        return self.o(o[0].transpose(0, 1).reshape(T, -1))


class TinyTower(nn.Module):
    def __init__(self, width=16, heads=2, layers=2, side=3):
        super().__init__()
        self.side = side
        self.patch = nn.Linear(12, width)
        self.rotary = GridTables(width // heads)
        self.blocks = nn.ModuleList(PackedAttention(width, heads) for _ in range(layers))

    def forward(self, pixels):  # [T, 12] patches of one side x side image
        grid = torch.stack(torch.meshgrid(torch.arange(self.side), torch.arange(self.side),
                                          indexing="ij"), dim=-1).reshape(-1, 2)
        x = self.patch(pixels)
        tables = self.rotary(x, grid)
        for blk in self.blocks:
            x = x + blk(x, tables)
        return x


def test_a_vision_towers_packed_rotation_is_patched(kernel, monkeypatch):
    """A vision tower rotates the patches of its packed images: q/k [T, H, D] with no batch dim
    (views of one qkv projection), tables [T, D] made from grid positions, the rotation in fp32.
    The rotated tensors are one batch entry: the half kernel serves both layers forward and
    backward, and the outputs and every gradient match (before: rejected, "not 4-D")."""
    torch.manual_seed(2)
    model, pixels = TinyTower(), torch.randn(9, 12)
    ref = _run(model, pixels)
    mod = kernel("half")
    count = _Counting(mod, monkeypatch)
    record = PatchRecord(path="rotary", kind="rope", family="rope")
    undo = binding.bind(_block("rotary"), model.rotary, [mod], record, model)
    _run(model, pixels)
    assert record.status == "active", record
    assert record.sites == ["blocks.0", "blocks.1"] and "[T, H, D]" in record.binding, record
    count.fwd = count.bwd = 0
    got = _run(model, pixels)
    assert count.fwd == 2 and count.bwd == 2, (count.fwd, count.bwd)
    _assert_same(got, ref)
    undo()


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl"])
def test_vision_tower_rotary_is_covered_and_bound(kernel, model_type):
    """transformers' Qwen2-VL and Qwen2.5-VL vision towers (`--part vision`, tiny proxies): the
    rotation function is handed q/k [T, H, D] (and in Qwen2.5-VL tables whose rows were gathered
    into window order); the probe finds the half-split layout, coverage serves the rope block
    (before: uncovered, "not 4-D" / "no function ... was handed this block's cos/sin tables") and
    the binding takes the tower with it in every block."""
    from onboarding.coverage import build_coverage
    from onboarding.graph.parse import example_inputs, load_stage, parse_stage
    from onboarding.load.model import load_model
    from onboarding.patching.core import patch_model

    pytest.importorskip(f"transformers.models.{model_type}")
    info = load_stage(load_model(f"hf:{model_type}", part="vision"))
    g = parse_stage(info, seq=16, try_export=False)
    block = next(b for b in g.blocks if b.kind == "rope")
    entries = [e for e in build_coverage(g).entries if e.path == block.path]
    served = [e for e in entries if e.family == "rope"]
    assert [(e.status in ("template", "kernel"), e.variant) for e in served] == [(True, "half")], entries
    assert not [e for e in entries if e.status == "uncovered"], entries
    model = info.loaded.build(info.proxy_config, seed=0).eval()
    inputs, kwargs = example_inputs(model, info.proxy_config, 1, 16, 0)
    mod = kernel("half", rotary_dim=served[0].params["rotary_dim"])
    with patch_model(model, g, {(block.path, "rope"): mod}, kinds={"rope"}) as patches, torch.no_grad():
        model(*inputs, **kwargs)
        (record,) = patches.records
        assert record.status == "active" and len(record.sites) >= 2, record
    assert "[T, H, D]" in record.binding, record


class WindowTower(TinyTower):
    """Qwen2.5-VL's order: the patches and the tables' rows gathered into attention windows'
    order (new storage) before the blocks get them; and an absolute position term added to the
    patches from the tables (a tensor mixing a table with the hidden states is no table)."""

    def forward(self, pixels):
        grid = torch.stack(torch.meshgrid(torch.arange(self.side), torch.arange(self.side),
                                          indexing="ij"), dim=-1).reshape(-1, 2)
        order = torch.arange(grid.shape[0]).flip(0)
        x = self.patch(pixels)[order]
        cos, sin = self.rotary(x, grid)
        tables = tuple(t.reshape(-1, 1, t.shape[-1])[order, :, :].reshape(-1, t.shape[-1]) for t in (cos, sin))
        x = x + 0.1 * tables[0].repeat(1, x.shape[-1] // tables[0].shape[-1])
        for blk in self.blocks:
            x = x + blk(x, tables)
        return x


def test_tables_gathered_before_the_blocks_are_recognised(kernel, monkeypatch):
    """Tables whose rows were gathered (window order) after the rope block are tables computed
    from its outputs alone: the rotation call is found and served in both blocks; the patches,
    mixed with a table, stay the rotated inputs. Outputs and gradients match (before: rejected,
    no function was handed the block's tables)."""
    torch.manual_seed(3)
    model, pixels = WindowTower(), torch.randn(9, 12)
    ref = _run(model, pixels)
    mod = kernel("half")
    count = _Counting(mod, monkeypatch)
    record = PatchRecord(path="rotary", kind="rope", family="rope")
    undo = binding.bind(_block("rotary"), model.rotary, [mod], record, model)
    _run(model, pixels)
    assert record.status == "active", record
    assert record.sites == ["blocks.0", "blocks.1"], record
    count.fwd = count.bwd = 0
    got = _run(model, pixels)
    assert count.fwd == 2 and count.bwd == 2, (count.fwd, count.bwd)
    _assert_same(got, ref)
    undo()


def test_tables_no_op_reads_are_no_rotation_to_serve():
    """hf:bamba's default config: every layer a Mamba mixer, so the rotary module's tables reach
    no op. The probe said "no function ... was handed this block's cos/sin tables: the rotation
    runs inline", coverage listed the block's "rope" op uncovered and the generate stage compiled
    the table module with Inductor (15.8 s in onboard run hf:bamba). The probe now records that
    nothing read the tables (``read`` False): no family match, no refusal, no uncovered entry, no
    task; the table stays a fast torch path. A model whose attention reads them keeps its match."""
    from onboarding.coverage import build_coverage
    from onboarding.generate.tasks import task_blocks
    from onboarding.graph.parse import load_stage, parse_stage
    from onboarding.load.model import load_model

    rope = families()["rope"]
    g = parse_stage(load_stage(load_model("hf:bamba")), seq=8, try_export=False)
    (block,) = [b for b in g.blocks if b.kind == "rope"]
    assert block.attrs["core_calls"]["rotary"]["read"] is False
    assert rope.match(block) is None and rope.refusal(block) is None
    cov = build_coverage(g)
    assert [(e.op, e.status) for e in cov.entries if e.path == block.path] == [
        ("cos/sin table", "torch_fast")]
    assert block.path not in [b.path for b, *_ in task_blocks(g, cov)]
    # the same tables read by an attention layer: probed, matched as before
    g = parse_stage(load_stage(load_model("hf:bamba", overrides={"attn_layer_indices": [1]})),
                    seq=8, try_export=False)
    (block,) = [b for b in g.blocks if b.kind == "rope"]
    assert block.attrs["core_calls"]["rotary"]["read"] is True
    assert rope.match(block) is not None
