"""A third recorded LLM answer for a real uncovered block: the lightning attention of hf:minimax
(its linear-attention layer: linear attention with a fixed per-head decay over positions,
computed in blocks, between the qkv projection and the normed, gated output projection), written
as a Triton family (tests/fixtures/llm_cassettes/families/lightning_attention: the whole block,
forward and backward), and a variant whose queries' decay from the state is one position short.
Triton runs in the interpreter.

The decay is only visible where the layer's slopes are: MiniMax scales them by
``1 - layer_idx / (num_hidden_layers - 1 + 1e-5) + 1e-5``, about 2e-5 at the last layer
(slopes 5e-6 .. 8e-8), where the off-by-one decay passed the gate. The tiny proxy keeps a
layer after its one linear layer for that reason (`onboarding.load.proxy`: a layer kind whose
constants depend on the layer count is not kept as the last layer alone): full, linear, full,
factor about 0.5 (slopes 0.125 .. 0.002). The fast checks build the module at layer 0."""

from __future__ import annotations

import json
import types

import pytest
import torch

from fixtures.llm_replay import ReplayServer, answer_from_folder
from onboarding.generate.llm import LLMClient, LLMConfig, propose
from onboarding.generate.llm.contract import parse_answer
from onboarding.generate.tasks import KernelTask
from onboarding.load.spec import ModelSpec

LAYERS = ["full_attention", "linear_attention", "full_attention"]
MINIMAX = ModelSpec(ref="hf:minimax")
PATH = "model.layers.1.self_attn"
TASK = KernelTask(path=PATH, kind="linear_attention.other", reason="no family matches this block yet",
                  op="linear-attention recurrence", class_name="MiniMaxLightningAttention", batch=1,
                  seq=64, source_note="not included in this test",
                  attrs={"recurrence": "state", "state": [32, 32], "state_decay": True},
                  params={"norm.weight": [128], "qkv_proj.weight": [384, 128],
                          "out_proj.weight": [128, 128], "output_gate.weight": [128, 128]},
                  op_histogram={"exp": 1, "linear": 3, "matmul": 4, "mul": 6, "sigmoid": 1, "silu": 1})
SIZES = [[1, 64], [1, 64], [1, 37], [3, 37]]
KERNELS = {"lightning_gemm_kernel", "lightning_fwd_kernel", "lightning_bwd_dqdk_kernel",
           "lightning_bwd_dv_kernel", "lightning_norm_gate_fwd_kernel", "lightning_norm_gate_bwd_kernel",
           "lightning_norm_weight_grad_kernel"}
OFF_BY_ONE = [["qd = tl.exp(-lam * (fi + 1.0))", "qd = tl.exp(-lam * fi)"]]


def _family(tmp_path, replace=None):
    from onboarding.generate.llm.folder import rendered_module, write_folder
    from onboarding.generate.templating import load_module

    ans = parse_answer(answer_from_folder("families/lightning_attention", replace))
    folder = write_folder(ans, types.SimpleNamespace(path=PATH, kind=TASK.kind, attrs=TASK.attrs,
                                                     op_histogram=TASK.op_histogram, key="k"), tmp_path)
    path = rendered_module(folder)
    return path, load_module(path)


def test_lightning_answer_passes_the_contract_and_the_static_check(tmp_path):
    from onboarding.generate.llm.static import check_source

    path, _ = _family(tmp_path)
    report = check_source(path.read_text())
    assert report.ok, report.problems
    assert set(report.launched) == KERNELS


def test_cassette_is_chosen_by_the_block_structure():
    """The cassettes match the prompt by the block's kind, its decayed-state attr and its
    parameters (the qkv projection and the output gate), whatever the class is called."""
    from dataclasses import replace

    from fixtures.llm_replay import load_cassette
    from onboarding.generate.llm.prompt import initial_messages

    for name in ("minimax_lightning_correct", "minimax_lightning_decay_off_by_one"):
        match = load_cassette(name)["match"]
        assert all(m in json.dumps(initial_messages(replace(TASK, class_name="Anything"))) for m in match)
        ungated = replace(TASK, params={k: v for k, v in TASK.params.items() if k != "output_gate.weight"})
        assert not all(m in json.dumps(initial_messages(ungated)) for m in match)


def _block(mask: bool):
    """A MiniMax lightning attention module at layer 0 (slopes 0.0625 and 0.0039: the decay over
    21 positions is far from 1), its own block size 8 (blocks 8 + 8 + 5), inputs and a mask."""
    from transformers import MiniMaxConfig
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    torch.manual_seed(0)
    cfg = MiniMaxConfig(hidden_size=32, num_attention_heads=2, head_dim=16, num_hidden_layers=2,
                        block_size=8, layer_types=["linear_attention", "full_attention"])
    m = MiniMaxLightningAttention(cfg, 0)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 21, 32)
    keep = None
    if mask:
        keep = torch.ones(2, 21, dtype=torch.long)
        keep[1, :4] = 0  # left padding
    return m, x, keep


def _run(m, fn, x, keep, s0):
    """Outputs and every gradient of ``fn(m, x, ...)``; with ``s0`` through a MiniMaxCache holding
    it (the module's step path: the state is read from and written back to the cache)."""
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    xl = x.clone().requires_grad_(True)
    for p in m.parameters():
        p.grad = None
    cache, s0l = None, None
    if s0 is not None:
        cache, s0l = MiniMaxCache(), s0.clone().requires_grad_(True)
        cache.set_linear_cache(0, s0l)
    out, state = fn(m, xl, (None, None), keep, cache=cache)
    if cache is not None:
        assert cache.get_linear_cache(0) is state
    gen = torch.Generator().manual_seed(1)
    torch.autograd.backward([out, state], [torch.randn(out.shape, generator=gen),
                                           torch.randn(state.shape, generator=gen)])
    grads = [xl.grad] + [p.grad for p in m.parameters()] + ([s0l.grad] if s0 is not None else [])
    return [out.detach(), state.detach()] + [g.clone() for g in grads]


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("mask, initial_state", [(False, False), (True, True)])
def test_lightning_kernel_matches_the_block(tmp_path, mask, initial_state):
    """Output, last state and every gradient (the input, the four weights, the cached initial
    state) against MiniMaxLightningAttention itself, fp32, chunks of 16 (21 positions: a full and
    a partial chunk); with a padding mask and a cached state the module takes its step path."""
    _, kmod = _family(tmp_path)
    kmod.set_config({"BLOCK_C": 16})
    m, x, keep = _block(mask)
    s0 = torch.randn(2, 2, 16, 16) * 0.3 if initial_state else None
    got = _run(m, kmod.block_forward, x, keep, s0)
    want = _run(m, lambda mod, *a, **k: type(mod).forward(mod, *a, **k), x, keep, s0)
    assert len(got) == len(want) == 7 + initial_state
    for i, (a, b) in enumerate(zip(got, want)):
        assert _rel(a, b) < 1e-5, (i, _rel(a, b))


def test_decay_one_position_short_is_visible_at_a_real_slope(tmp_path):
    """The planted bug of the second cassette changes the block's output at layer 0's slopes
    (what the proxy's layer after the linear one gives the slow gate test)."""
    _, kmod = _family(tmp_path, OFF_BY_ONE)
    kmod.set_config({"BLOCK_C": 16})
    m, x, _ = _block(False)
    with torch.no_grad():
        got = kmod.block_forward(m, x, (None, None), None)[0]
        want = m(x, (None, None), None)[0]
    assert _rel(got, want) > 1e-3


@pytest.mark.slow
def test_run_serves_the_lightning_attention_with_the_generated_family(tmp_path, families):
    """`onboard run hf:minimax --llm URL` on the default proxy (full, linear, full: visible
    decay): the cassette is chosen by the real prompt, the family passes the gate (the block
    check in its subprocess at every size, the runtime record, the sm_90 compile), serves the
    whole block (its core and the projections' GEMMs), aligns forward and backward in the model
    and is a kernel-PR candidate."""
    from onboarding.cli.main import main

    with ReplayServer(["minimax_lightning_correct"]) as server:
        code = main(["run", "hf:minimax", "--llm", server.url, "--out", str(tmp_path / "r")])
    assert code == 0
    run = tmp_path / "r"
    model = json.loads((run / "model.json").read_text())
    assert model["proxy_config"]["layer_types"] == LAYERS
    decision = next(d for d in json.loads((run / "decisions.json").read_text()) if d["path"] == PATH)
    assert decision["decision"] == "generated" and decision["family"] == "lightning_attention"
    cov = [e for e in json.loads((run / "coverage.json").read_text())["entries"] if e["path"] == PATH]
    assert {e["op"] for e in cov} == {"linear-attention recurrence", "projections (GEMM)"}
    assert all((e["status"], e["family"]) == ("generated", "lightning_attention") for e in cov)
    align = json.loads((run / "alignment.json").read_text())
    patch = next(p for p in align["patches"] if p["path"] == PATH)
    assert patch["family"] == "lightning_attention" and patch["status"] == "active"
    row = next(b for b in align["blocks"] if b["path"] == PATH)
    assert row["fwd"]["verdict"] == "pass" and row["bwd"]["verdict"] == "pass"
    cands = json.loads((run / "generated" / "pr_candidates.json").read_text())["pr_candidates"]
    assert [c["family"] for c in cands] == ["lightning_attention"] and cands[0]["status"] == "candidate"
    gate = json.loads((run / "generated" / "families" / "lightning_attention" / "gate.json").read_text())
    check = gate["details"]["check"]
    assert check["passed"] and [(s["batch"], s["seq"]) for s in check["sizes"]][:4] == \
        [(1, 64), (1, 64), (1, 37), (3, 37)]
    assert {e["name"] for e in check["sizes"][0]["errors"]} == {
        "out0", "out1", "grad of hidden_states", "grad of param norm.weight",
        "grad of param qkv_proj.weight", "grad of param out_proj.weight", "grad of param output_gate.weight"}
    record = check["artifacts"]["fp32"]
    assert set(record["kernels"]) == KERNELS and not record["forbidden"] and not record["state_changes"]
    assert record["reference"]["checked"] and not record["reference"]["reason"]
    assert all(r["ok"] for r in gate["details"]["aot"])


@pytest.mark.slow
def test_decay_one_position_short_rejected_by_numerics(tmp_path):
    """The gate (block check in this process) on the default proxy's lightning layer (a layer
    after it: visible decay). Before the proxy kept that layer, the variant passed."""
    with ReplayServer(["minimax_lightning_decay_off_by_one"]) as server:
        client = LLMClient(LLMConfig(url=server.url, model="replay-coder", timeout_s=30))
        out = propose(TASK, client, attempts=1, run_dir=tmp_path, spec=MINIMAX, sizes=SIZES,
                      gate_timeout_s=600, check_in_process=True)
    assert not out.accepted and out.attempts[0].stage == "numerics", out.reason
    assert out.attempts[0].reason.startswith("out0: rel_rms")
    assert not (tmp_path / "generated" / "families").exists()
