"""`compile = "blocks"` (regional torch.compile of each decoder layer) on the CPU tiny proxies.

The fast tests trace with dynamo's ``eager`` backend (the graph capture, its guards and graph
breaks, without AOTAutograd or inductor: seconds, not minutes); the slow ones compile with
inductor (Qwen3-MoE) or AOTAutograd with inductor's decompositions and partitioner
(``aot_eager_decomp_partition``: Qwen3-Next, whose inductor build takes minutes on 2 cores) and
compare every adapter gradient with the eager model.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from fixtures.adapted_proxy import adapted
from onboarding.errors import InputError
from onboarding.train.config import TrainConfig

MOE, NEXT = "hf:qwen3_moe", "hf:qwen3_next"
REL_TOL = 1e-5  # fp32 on the CPU: the compiled graph sums in another order than eager


@pytest.fixture(scope="module")
def proxies():
    """ref -> (model, graph) of the tiny proxy, fp32 on the CPU, seed 0 (built on first use)."""
    from onboarding.graph.parse import load_stage, parse_stage
    from onboarding.load.model import load_model

    cache = {}

    def get(ref):
        if ref not in cache:
            info = load_stage(load_model(ref))
            model = info.loaded.build(info.proxy_config, device="cpu", seed=0).float()
            cache[ref] = model, parse_stage(info, seq=64, seed=0, try_export=False)
        return cache[ref]
    return get


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and its counters (cumulative per process otherwise) start empty."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


# ---- the option ------------------------------------------------------------------------------

def test_compile_option_round_trip_cli_and_refusal(tmp_path):
    from onboarding.cli.main import build_parser
    from onboarding.cli.train import config_from_args

    cfg = TrainConfig(model="x", compile="blocks", recompute="full")
    assert TrainConfig.from_toml(cfg.to_toml(tmp_path / "t.toml")) == cfg
    assert "compile" in (tmp_path / "t.toml").read_text().split("\n\n")[0]  # the header says
    assert TrainConfig(model="x").compile == "none"
    with pytest.raises(InputError, match="compile='full': expected one of none, blocks"):
        TrainConfig(model="x", compile="full").validate_fields()
    (tmp_path / "b.toml").write_text('model = "x"\ncompile = true\n')
    with pytest.raises(InputError, match="compile=True: expected str"):
        TrainConfig.from_toml(tmp_path / "b.toml")
    args = build_parser().parse_args(["train", "hf:qwen3_moe", "--compile", "blocks"])
    assert config_from_args(args).compile == "blocks"
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["train", "hf:qwen3_moe", "--compile", "full"])
    assert exc.value.code == 2


def test_grouped_mm_loop_op_matches_the_loop():
    """The experts' per-expert loop as one custom op (what `_gmm` runs while compiling): the
    same numbers and gradients as the plain loop, with an empty expert; `opcheck` passes."""
    from onboarding.train._grouped_mm import grouped_mm_loop
    from onboarding.train._moe_ep_ops import _gmm

    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1])
    x = torch.randn(9, 12, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 7, 12, generator=g, dtype=torch.float64, requires_grad=True)
    ref = _gmm(x, w.transpose(1, 2), counts)
    out = grouped_mm_loop(x, w.transpose(1, 2), counts)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    dy = torch.randn(out.shape, generator=g, dtype=torch.float64)
    torch.testing.assert_close(torch.autograd.grad(out, [x, w], dy),
                               torch.autograd.grad(ref, [x, w], dy))
    # the checks that concern a custom op's registration (its aot_dispatch ones compile: slow)
    torch.library.opcheck(grouped_mm_loop, (x, w.transpose(1, 2), counts),
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor"))


# ---- through the worker ----------------------------------------------------------------------

def _run_worker(cfg: TrainConfig, graph, monkeypatch, backend: str) -> list[dict]:
    """One reference run in this process, on one thread (as the launched workers); returns
    its step rows."""
    from onboarding.train import compile as C
    from onboarding.train.worker import run

    monkeypatch.setattr(C, "BACKEND", backend)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    graph.save(out / "opgraph.json")  # the fixture's parse: the worker does not parse again
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run(copy.deepcopy(cfg), "reference")
    finally:
        torch.set_num_threads(threads)
    return [json.loads(x) for x in (out / "train" / "reference.jsonl").read_text().splitlines()]


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= REL_TOL * abs(b)


def test_worker_compiles_blocks_after_the_eager_first_step(proxies, tmp_path, monkeypatch,
                                                           capsys, fresh_dynamo):
    """Qwen3-MoE, full recompute, aux loss on (the model's own coefficient: router taps inside
    the compiled, checkpointed layers), step 3 profiled: the same loss and gradient norm as the
    eager run at every step; step 1 eager, steps 2-3 compiled, no graph break, nothing
    compiled after step 2 (the profiler's block hooks do not recompile); the log says so."""
    from onboarding.train.parallel import decoder_blocks

    model, graph = proxies(MOE)
    base = dict(model=MOE, steps=3, seq_len=16, micro_batch=2, lr=1e-2, lora_rank=4,
                recompute="full", profile_every=3, export=False)
    eager = _run_worker(TrainConfig(**base, out=str(tmp_path / "e")), graph, monkeypatch, "eager")
    capsys.readouterr()
    rows = _run_worker(TrainConfig(**base, compile="blocks", out=str(tmp_path / "c")), graph,
                       monkeypatch, "eager")
    log = capsys.readouterr().out
    n = len(decoder_blocks(model, graph))
    assert f"compile: blocks (torch.compile of each of the {n} decoder layers" in log
    assert f"compile: blocks: torch.compile of {n} decoder layers from step 2 on" in log
    assert [r["compile"] for r in rows] == ["eager warm-up", "blocks", "blocks"]
    assert [r["compile"] for r in eager] == ["none"] * 3
    for a, b in zip(rows, eager):
        assert a["aux"] is not None and b["aux"] is not None
        for key in ("loss", "ce", "aux", "grad_norm"):
            assert _close(a[key], b[key]), (key, a["step"], a[key], b[key])
    s2, s3 = rows[1]["compile_stats"], rows[2]["compile_stats"]
    assert s2["graph_breaks"] == 0 and 1 <= s2["graphs"] <= 2, s2  # layer 0, then the others
    assert s3["graphs"] == s2["graphs"] and s3["frames"] == s2["frames"], (s2, s3)


def test_compile_failure_stops_the_run_with_its_cause(proxies, tmp_path, monkeypatch,
                                                      fresh_dynamo):
    """A backend that fails: `CompileFailed` names the step and the cause; no row for it."""
    from onboarding.train.compile import CompileFailed

    def broken(gm, example_inputs):
        raise RuntimeError("planted backend failure")

    model, graph = proxies(MOE)
    cfg = TrainConfig(model=MOE, steps=2, seq_len=16, micro_batch=2, lora_rank=4,
                      compile="blocks", export=False, out=str(tmp_path))
    with pytest.raises(CompileFailed, match=r"failed at step 2 \(.*planted backend failure"):
        _run_worker(cfg, graph, monkeypatch, broken)
    rows = (tmp_path / "train" / "reference.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1]


# ---- gradients, compiled for real (slow) ---------------------------------------------------------

def _adapted(proxy, recompute: str):
    """The proxy adapted as training adapts it (`adapted`) -> (model, its decoder layers, the
    adapter parameters)."""
    model, blocks, _, params = adapted(proxy, recompute)
    return model, blocks, [p for _, p in params]


def _steps(model, blocks, params, backend: str | None, n: int = 3):
    """(loss, gradients) of ``n`` AdamW steps; ``backend``: compile the blocks after step 1."""
    from onboarding.train.compile import compile_blocks
    from onboarding.train.worker import lm_loss

    opt = torch.optim.AdamW(params, lr=1e-2, foreach=False)
    out = []
    for step in range(n):
        ids = torch.randint(0, model.config.vocab_size, (2, 17),
                            generator=torch.Generator().manual_seed(step))
        loss = lm_loss(model, ids, chunked=True)
        loss.backward()
        out.append((loss.item(), [p.grad.clone() for p in params]))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if backend is not None and step == 0:
            compile_blocks(blocks, backend=backend)
    return out


@pytest.mark.slow  # 2-3 min (Qwen3-MoE, inductor's C++ builds) / ~1 min (Qwen3-Next) per case
@pytest.mark.parametrize("ref,backend", [(MOE, "inductor"),
                                         (NEXT, "aot_eager_decomp_partition")], ids=["moe", "next"])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_compiled_blocks_same_loss_and_adapter_grads(proxies, ref, backend, recompute,
                                                     fresh_dynamo):
    from torch._dynamo.utils import counters

    proxy = proxies(ref)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        eager = _steps(*_adapted(proxy, recompute), None)
        compiled = _steps(*_adapted(proxy, recompute), backend)
    finally:
        torch.set_num_threads(threads)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    # one graph per structure of layer: the first (its input needs no gradient), the other
    # layers of each attention kind
    assert 1 <= counters["stats"]["unique_graphs"] <= 3, dict(counters["stats"])
    for step, ((la, ga), (lb, gb)) in enumerate(zip(compiled, eager)):
        assert _close(la, lb), (step, la, lb)
        for a, b in zip(ga, gb):
            err = float((a - b).norm() / b.norm())
            assert err < REL_TOL, (step, err)


@pytest.mark.slow  # ~30 s each
@pytest.mark.parametrize("ref", [MOE, NEXT])
def test_no_graph_break_in_a_decoder_layer(proxies, ref, fresh_dynamo):
    """`torch._dynamo.explain` of one decoder layer as ours trains it: one graph."""
    model, blocks, _ = _adapted(proxies(ref), "none")
    seen = {}

    def grab(module, args, kwargs):
        seen["args"], seen["kwargs"] = args, kwargs

    from onboarding.train.worker import lm_loss

    handle = blocks[1][1].register_forward_pre_hook(grab, with_kwargs=True)
    lm_loss(model, torch.randint(0, model.config.vocab_size, (2, 17)), chunked=True)
    handle.remove()
    ex = torch._dynamo.explain(blocks[1][1])(*seen["args"], **seen["kwargs"])
    assert ex.graph_break_count == 0, [r.reason for r in ex.break_reasons]
    assert ex.graph_count == 1
