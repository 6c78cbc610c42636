"""Operations of long training runs on the CPU: recompute, load balance, dropped tokens,
TensorBoard events, alerts, checkpoints and data in object storage, the sequence sweep.

One tiny DeepSeek-V3 proxy (a dense first layer, MoE layers with a score-corrected sigmoid router,
MLA attention) is built and parsed once per module (dispatch capture: no export); the worker runs
in this process where a test needs a whole run, with ``os._exit`` turned into an exception so a
simulated kill or an alert ends the run, not pytest.
"""

from __future__ import annotations

import copy
import http.server
import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from fixtures.adapted_proxy import adapted
from onboarding.errors import EXIT_ALERT, InputError
from onboarding.train.config import TrainConfig

REF = "hf:deepseek_v3"


@pytest.fixture(scope="module")
def proxy():
    """(model, graph) of the tiny proxy, fp32 on the CPU, seed 0."""
    from onboarding.graph.parse import load_stage, parse_stage
    from onboarding.load.model import load_model

    info = load_stage(load_model(REF))
    model = info.loaded.build(info.proxy_config, device="cpu", seed=0).float()
    return model, parse_stage(info, seq=64, seed=0, try_export=False)


def _ids(model, n=2, t=17, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (n, t), generator=g)


# ---- recompute -------------------------------------------------------------------------------

def _adapted(proxy, mode: str):
    """The proxy adapted as training adapts it with ``mode`` recompute (`adapted`) -> (model,
    the modules recompute wrapped, the adapters)."""
    model, _, done, params = adapted(proxy, mode)
    return model, done, params


def _step_saved_bytes(model, ids) -> tuple[torch.Tensor, int]:
    """(loss, bytes of the distinct storages autograd saved for the backward, parameters left
    out): activation memory without the allocator or RSS. Tensors saved inside a checkpointed
    region never reach this hook (the checkpoint keeps what it re-runs from)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=ids[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), sum(saved.values())


def test_recompute_same_loss_and_grads_fewer_saved_bytes(proxy):
    ids = _ids(proxy[0])
    runs = {}
    for mode in ("none", "selective", "full"):
        model, done, params = _adapted(proxy, mode)
        loss, saved = _step_saved_bytes(model, ids)
        runs[mode] = (loss, saved, {n: p.grad.clone() for n, p in params}, done)
    kinds = {b.path: b.kind for b in proxy[1].blocks}
    sel = runs["selective"][3]
    assert {kinds[p] for p in sel} == {"mlp.dense", "moe.shared_expert", "moe.experts"}
    assert runs["full"][3] and all(p.startswith("model.layers.") for p in runs["full"][3])
    ref_loss, _, ref_grads, _ = runs["none"]
    assert all(g.abs().sum() > 0 for g in ref_grads.values())
    for mode in ("selective", "full"):
        loss, _, grads, _ = runs[mode]
        assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0), mode
        for n, g in grads.items():  # fp32 noise: the recomputed ops sum in another order
            err = float((g - ref_grads[n]).norm() / ref_grads[n].norm())
            assert err < 1e-5, (mode, n, err)
    none, selective, full = (runs[m][1] for m in ("none", "selective", "full"))
    assert full < selective < none, (none, selective, full)


def test_selective_recompute_re_runs_a_low_rank_residual_branch(parse_model):
    """`residual.low_rank` (Gemma 3n's LAuReL, our own fixture) is among selective recompute's
    kinds, as it was while it read as `mlp.dense`: its two rank-r GEMMs re-run in the backward
    (same loss and gradients), and `onboard plan` counts its rank-r product as what selective
    recompute frees."""
    import importlib.util

    from onboarding.plan.memory import block_saved
    from onboarding.plan.shapes import BlockShape
    from onboarding.train.parallel import SELECTIVE_KINDS, apply_recompute

    assert "residual.low_rank" in SELECTIVE_KINDS
    path = Path(__file__).parent / "fixtures" / "residual_stream_models.py"
    spec = importlib.util.spec_from_file_location("_low_rank_fixture", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    graph = parse_model("tests/fixtures/residual_stream_models.py:LowRankResidualLM", seq=12)
    torch.manual_seed(0)
    ref = mod.LowRankResidualLM()
    model = copy.deepcopy(ref)
    done = apply_recompute(model, graph, [], "selective")
    assert {p for p in done if "low_rank" in p} == {"layers.0.low_rank", "layers.1.low_rank"}
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    for m in (ref, model):
        m(ids).square().mean().backward()
    for (n, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), n
    b = BlockShape(pattern="layers.*.low_rank", kind="residual.low_rank", count=2, params=512,
                   linears=[("down", 32, 8), ("up", 8, 32)], attrs={}, ops=3, nested=False)

    class Cfg:
        mode, lora_rank = "lora", 0

    class Shape:
        hidden = 32

    kept, selective, _ = block_saved(b, Shape(), Cfg(), 1)
    assert kept == selective == 2 * 8  # bf16 rank-r product per token


def test_recompute_option_and_old_flag(tmp_path):
    assert TrainConfig(model="x", activation_checkpointing=True).recompute_mode == "full"
    assert TrainConfig(model="x", recompute="selective").recompute_mode == "selective"
    with pytest.raises(InputError, match="recompute='fast'"):
        TrainConfig(model="x", recompute="fast").validate_fields()
    with pytest.raises(InputError, match="contradicts"):
        TrainConfig(model="x", recompute="selective",
                    activation_checkpointing=True).validate_fields()
    cfg = TrainConfig(model="x", recompute="selective", balance="bias", checkpoint_dir="s3://b/c",
                      stall_timeout=5.0, alert_webhook="http://127.0.0.1:1/x", aux_loss_coef=0.1)
    assert TrainConfig.from_toml(cfg.to_toml(tmp_path / "t.toml")) == cfg
    for bad, frag in ((dict(balance="loss"), "balance"), (dict(stall_timeout=-1.0), "stall"),
                      (dict(alert_webhook="ftp://x"), "http"), (dict(bias_rate=math.inf), "bias"),
                      (dict(checkpoint_dir="rel/ckpt"), "must be absolute")):
        with pytest.raises(InputError, match=frag):
            TrainConfig(model="x", **bad).validate_fields()


# ---- load balance ----------------------------------------------------------------------------

def test_dropped_pairs_match_a_hand_count(proxy):
    """Capacity per expert and dispatch group = ceil(cf * tokens * k / E); pairs past it (in
    token order) are dropped and contribute nothing."""
    from onboarding.train.moe_ep import EPGroup, _ep_module

    model, graph = proxy
    block = graph.by_kind("moe.experts")[0]
    src = dict(model.named_modules())[block.path]
    d = block.inputs[0].shape[-1]
    # 8 tokens, k=2, E=16, cf=4: two groups of 4 tokens -> capacity ceil(4*4*2/16) = 2
    idx = torch.tensor([[0, 1], [0, 2], [0, 3], [0, 1],      # expert 0: 4 pairs -> 2 dropped
                        [5, 6], [5, 6], [5, 6], [5, 6]])     # experts 5, 6: 4 each -> 2 + 2
    x, w = torch.randn(8, d), torch.ones(8, 2)
    grouped = _ep_module(block, src, EPGroup(), capacity_factor=4.0, dispatch_groups=2)
    y = grouped(x, idx, w)
    assert grouped.last_dropped == 6
    one = _ep_module(block, src, EPGroup(), capacity_factor=4.0)  # capacity ceil(4*8*2/16) = 4
    one(x, idx, w)
    assert one.last_dropped == 0
    dropless = _ep_module(block, src, EPGroup())
    y_all = dropless(x, idx[:, :1], w[:, :1])  # expert 0 / 5 alone for each token
    y_second = dropless(x, idx[:, 1:], w[:, 1:])
    # tokens 2, 3 lost their expert-0 pair, tokens 6, 7 both pairs; the rest kept both
    torch.testing.assert_close(y[[0, 1, 4, 5]], (y_all + y_second)[[0, 1, 4, 5]])
    torch.testing.assert_close(y[[2, 3]], y_second[[2, 3]])
    assert torch.count_nonzero(y[[6, 7]]) == 0


def _imbalance(ep_mods) -> float:
    c = torch.stack([m.last_counts for m in ep_mods]).float()
    return float((c.max(1).values / c.mean(1)).max())


def test_bias_balancing_moves_a_skewed_router_toward_uniform(proxy):
    from onboarding.train.moe_ep import (EPGroup, apply_expert_parallel, check_bias_balancing,
                                         global_counts, score_bias_tensors, update_score_bias)

    model, graph = copy.deepcopy(proxy[0]), proxy[1]
    ep_mods = apply_expert_parallel(model, graph, EPGroup(), capacity_factor=None)
    e = ep_mods[0].n_experts
    check_bias_balancing(model, graph, e)  # DeepSeek-V3's router has a score-correction bias
    biases = score_bias_tensors(model, graph, e)
    assert len(biases) == len(graph.by_kind("moe.router")) == len(ep_mods)
    mods = dict(model.named_modules())
    with torch.no_grad():
        for path, b in biases.items():
            mods[path].weight.mul_(30)  # scores that differ between tokens (init: all ~0.5)
            b.zero_()
            b[:4] = 0.3  # the skew: experts 0-3 win nearly every token's top-k
    ids = _ids(model, n=2, t=33, seed=2)
    trace = []
    with torch.no_grad():
        for step in range(12):
            model(input_ids=ids, use_cache=False)
            trace.append(_imbalance(ep_mods))
            counts = global_counts(ep_mods, None)
            before = {p: b.clone() for p, b in biases.items()}
            assert update_score_bias(model, graph, counts, 0.02) == len(biases)
            for i, (p, b) in enumerate(biases.items()):  # bias += rate * sign(mean - load)
                load = counts[i].float()
                torch.testing.assert_close(b - before[p], 0.02 * torch.sign(load.mean() - load))
    assert trace[-1] < 0.8 * trace[0], trace
    # a router without a score bias is refused by structure, naming it
    plain = copy.deepcopy(graph)
    for b in plain.by_kind("moe.router"):
        b.attrs["score_bias"] = False
    with pytest.raises(InputError, match="no score-correction bias.*aux-loss"):
        check_bias_balancing(model, plain, e)


def test_balance_modes_choose_the_loss_and_the_bias_update(proxy):
    from onboarding.train.moe_ep import EPGroup, apply_expert_parallel
    from onboarding.train.worker import DEFAULT_AUX_COEF, balancing

    model, graph = copy.deepcopy(proxy[0]), proxy[1]
    ep_mods = apply_expert_parallel(model, graph, EPGroup(), capacity_factor=1.0)
    own = float(getattr(model.config, "router_aux_loss_coef", 0) or 0)

    def mode(**kw):
        return balancing(TrainConfig(model=REF, **kw), model, graph, ep_mods)
    assert mode(balance="none") == (0.0, 0.0)
    assert mode(balance="auto") == (own, 1e-3)  # the router has a score bias: it is updated
    assert mode(balance="aux-loss") == (own or DEFAULT_AUX_COEF, 0.0)
    assert mode(balance="aux-loss", aux_loss_coef=0.5) == (0.5, 0.0)
    assert mode(balance="bias", bias_rate=0.01) == (0.0, 0.01)
    with pytest.raises(InputError, match="per-expert load is not counted"):
        balancing(TrainConfig(model=REF, balance="bias"), model, graph, [])


# ---- TensorBoard -----------------------------------------------------------------------------

def test_tensorboard_events_read_back(tmp_path):
    from onboarding.train.metrics import TensorBoard
    from onboarding.train.tensorboard import crc32c, read_scalars, records

    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    tb = TensorBoard(tmp_path)
    for s, loss in ((1, 2.5), (2, 2.25), (3, float("nan"))):
        tb.write({"step": s, "loss": loss, "lr": 1e-3, "mfu": None, "peak_mem_bytes": 2 ** 31,
                  "expert_load": [{"layer": "model.layers.1.mlp.experts",
                                   "max_over_mean": 1.5 + s}]})
    got = read_scalars(tmp_path)
    assert got["loss"] == [(1, 2.5), (2, 2.25)]  # NaN and None are left out
    assert [s for s, _ in got["lr"]] == [1, 2, 3] and got["peak_mem_gib"][0] == (1, 2.0)
    assert got["expert_imbalance/model.layers.1.mlp.experts"] == [(1, 2.5), (2, 3.5), (3, 4.5)]
    assert "mfu" not in got
    path = next(tmp_path.glob("events.out.tfevents.*"))
    assert b"brain.Event:2" in next(records(path))
    data = bytearray(path.read_bytes())
    data[-6] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="CRC"):
        read_scalars(tmp_path)


# ---- alerts ----------------------------------------------------------------------------------

@pytest.fixture
def webhook():
    """A local HTTP server on 127.0.0.1 collecting the JSON bodies POSTed to it."""
    got: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/hook", got
    srv.shutdown()


def test_stall_watchdog_alerts_once(tmp_path, webhook, capsys):
    import time

    from onboarding.train.alerts import ALERT_FILE, Alerts

    url, got = webhook
    codes: list[int] = []
    a = Alerts(tmp_path, stall_timeout=0.3, webhook=url, run="r", exit_fn=codes.append).start()
    for s in (1, 2, 3):  # steps that finish in time: no alert
        time.sleep(0.1)
        a.progress(s)
    assert not codes
    time.sleep(1.0)
    a.stop()
    assert codes == [EXIT_ALERT]
    assert len(got) == 1 and got[0]["alert"] == "stall" and got[0]["step"] == 4
    assert json.loads((tmp_path / ALERT_FILE).read_text())["alert"] == "stall"
    err = capsys.readouterr().err
    assert "ALERT [stall] rank 0: no step finished" in err and "delivered" in err


class _Exit(Exception):
    pass


def _no_exit(monkeypatch) -> list[int]:
    codes: list[int] = []

    def fake(code):
        codes.append(code)
        raise _Exit(code)
    monkeypatch.setattr(os, "_exit", fake)
    return codes


def _run_worker(cfg: TrainConfig, graph, role: str = "reference") -> None:
    """One worker run in this process, on one thread as the launched workers of the distributed
    tests (CPU backward kernels that scatter-add over threads sum in a varying order)."""
    from onboarding.train.worker import run

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "opgraph.json").exists():
        graph.save(out / "opgraph.json")  # the fixture's parse: the worker does not parse again
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run(copy.deepcopy(cfg), role)
    finally:
        torch.set_num_threads(threads)


def test_nan_loss_alerts_with_exit_4_and_webhook(proxy, tmp_path, webhook, monkeypatch, capsys):
    url, got = webhook
    codes = _no_exit(monkeypatch)
    cfg = TrainConfig(model=REF, out=str(tmp_path), steps=4, seq_len=16, micro_batch=2,
                      lr=1e35, lora_rank=4, checkpoint_interval=1, alert_webhook=url)
    with pytest.raises(_Exit):
        _run_worker(cfg, proxy[1])
    assert codes == [EXIT_ALERT]
    rows = [json.loads(x) for x in (tmp_path / "train" / "reference.jsonl").read_text()
            .splitlines()]
    bad = rows[-1]["step"]
    assert not math.isfinite(rows[-1]["loss"]) and all(math.isfinite(r["loss"]) for r in rows[:-1])
    assert got and got[0]["alert"] == "nonfinite_loss" and got[0]["step"] == bad
    assert f"ALERT [nonfinite_loss] rank 0: step {bad}" in capsys.readouterr().err
    ckpts = sorted(p.name for p in (tmp_path / "train" / "ckpt" / "reference").glob("step_*"))
    assert ckpts and ckpts[-1] == f"step_{bad - 1:06d}"  # the non-finite step is not saved


def test_stalled_step_in_a_run_alerts(proxy, tmp_path, webhook, monkeypatch):
    """The worker's watchdog: step 2 hangs (test hook) past --stall-timeout; the alert names it.
    (The watchdog thread's exit is an exception here, so the run itself then finishes.)"""
    from onboarding.train.alerts import ALERT_FILE

    url, got = webhook
    codes = _no_exit(monkeypatch)
    monkeypatch.setenv("ONBOARD_TEST_STALL", "2:5")
    cfg = TrainConfig(model=REF, out=str(tmp_path), steps=2, seq_len=16, micro_batch=2,
                      lora_rank=4, stall_timeout=3.0, alert_webhook=url)
    _run_worker(cfg, proxy[1])
    assert codes == [EXIT_ALERT]
    alert = json.loads((tmp_path / "train" / ALERT_FILE).read_text())
    assert alert["alert"] == "stall" and alert["step"] == 2 and got == [alert]


def test_each_row_reports_its_own_steps_peak(proxy, tmp_path, monkeypatch):
    """A step row's ``peak_mem_bytes`` is that step's own peak (the counter reset as the step
    starts; on the CPU the peak resident set) and ``run_peak_mem_bytes`` the run's so far: 256 MiB
    touched in step 1 only shows in step 1's row and in every row's run peak. Before, no step
    reset the counter, so every row read the run's peak so far (qwen3_next's four rows on the
    H100 one and the same number, step 1's)."""
    import contextlib

    from onboarding.train import worker

    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("the CPU's peak is reset through /proc/self/clear_refs (Linux)")
    big = 256 * 2**20

    @contextlib.contextmanager
    def step_context(step):
        if step == 1:
            assert float(torch.ones(big // 4).sum()) == big // 4  # written, so resident
        yield
    monkeypatch.setattr(worker, "step_context", step_context)
    cfg = TrainConfig(model=REF, out=str(tmp_path), steps=3, seq_len=16, micro_batch=2,
                      lora_rank=4)
    _run_worker(cfg, proxy[1])
    rows = [json.loads(x) for x in (tmp_path / "train" / "reference.jsonl").read_text()
            .splitlines()]
    peaks = [r["peak_mem_bytes"] for r in rows]
    assert peaks[0] >= max(peaks[1:]) + big * 3 // 4, peaks
    runs = [r["run_peak_mem_bytes"] for r in rows]
    assert runs == sorted(runs), runs
    assert all(r["run_peak_mem_bytes"] >= max(peaks[:i + 1]) for i, r in enumerate(rows))
    from onboarding.train.compare import summarize

    assert summarize({r["step"]: r for r in rows})["peak_mem_bytes"] == \
        rows[-1]["run_peak_mem_bytes"]


def test_step_peaks_reset_the_cuda_counter_each_step(monkeypatch):
    """On CUDA, `StepPeaks` reads `torch.cuda.max_memory_allocated` and resets it with
    `reset_peak_memory_stats` as each step starts (a fake allocator here): a step's peak is its
    own, the run's keeps the set-up's and every step's; without /proc the CPU says it cannot
    reset."""
    from onboarding.train import metrics as M

    dev = torch.device("cuda", 0)
    state = {"peak": 0, "now": 0}

    def alloc(n):
        state["now"] += n
        state["peak"] = max(state["peak"], state["now"])

    def reset(device):
        assert device == dev
        state["peak"] = state["now"]
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: state["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    peaks = M.StepPeaks(dev)
    alloc(1000), alloc(-600)  # set-up: 1000 at its peak, 400 kept
    got = []
    for transient in (500, 50, 50):
        peaks.start()
        alloc(transient), alloc(-transient)
        got.append(peaks.step())
    assert got == [(900, 1000), (450, 1000), (450, 1000)]
    alloc(2000), alloc(-2000)  # between steps (an export, a checkpoint): the run's, not a step's
    peaks.start()
    assert peaks.step() == (400, 2400)
    monkeypatch.setattr(M, "_CLEAR_REFS", "/nonexistent/clear_refs")
    assert M.reset_peak_memory(torch.device("cpu")) is False


def test_launcher_reports_an_alert_as_exit_4(tmp_path, capsys):
    """A worker (or torchrun, whose own exit code is 1) that stopped on an alert: exit 4."""
    from rich.console import Console

    from onboarding.train.launch import _run

    cfg = TrainConfig(model="x", out=str(tmp_path))
    note = json.dumps({"alert": "stall", "message": "no step finished for 9.0 s"})
    code = (f"import pathlib, sys; pathlib.Path({str(tmp_path / 'train' / 'alert.json')!r})"
            f".write_text({note!r}); sys.exit(1)")
    assert _run([sys.executable, "-c", code], "parallel", cfg, Console()) == EXIT_ALERT
    assert "ALERT parallel run stopped: [stall] no step finished" in capsys.readouterr().out
    assert _run([sys.executable, "-c", "import sys; sys.exit(1)"], "parallel", cfg,
                Console()) == 1  # the old alert file is gone before a new attempt


# ---- object storage --------------------------------------------------------------------------

@pytest.fixture
def s3(monkeypatch):
    """An S3-compatible server (moto) on 127.0.0.1 with bucket ``onboard``; s3:// URLs of this
    process reach it through fsspec's configuration."""
    pytest.importorskip("s3fs", reason="s3fs is not installed (pip install -e '.[dev]')")
    server_mod = pytest.importorskip("moto.server",
                                     reason="moto[server] is not installed (pip install -e '.[dev]')")
    import fsspec

    srv = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    host, port = srv.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    for k, v in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                 ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(k, v)
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": endpoint})
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir("onboard")
    yield fs
    srv.stop()


def test_s3_checkpoints_and_data_resume_continues_exactly(proxy, tmp_path, s3, monkeypatch,
                                                         capsys):
    """Data and DCP checkpoints at s3:// URLs: a run killed after step 3 (checkpoint of step 2)
    resumes from the bucket and its loss curve equals an uninterrupted run's, step by step. Its
    dropped pairs equal a hand count from the logged per-expert load."""
    rows = [{"prompt": f"def f{i}(x):", "response": f"    return x * {i} + {i % 7}\n"}
            for i in range(120)]
    s3.pipe_file("onboard/data/train.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    base = dict(model=REF, steps=5, seq_len=16, micro_batch=2, lr=1e-2, lora_rank=4,
                capacity_factor=1.0, data="s3://onboard/data/train.jsonl")
    codes = _no_exit(monkeypatch)
    monkeypatch.setenv("ONBOARD_TEST_KILL", "0:3")
    killed = TrainConfig(**base, out=str(tmp_path / "a"), checkpoint_interval=2,
                         checkpoint_dir="s3://onboard/runs/a")
    with pytest.raises(_Exit):
        _run_worker(killed, proxy[1])
    assert codes == [1]
    assert sorted(p.rpartition("/")[2] for p in s3.ls("onboard/runs/a/reference")) == \
        ["step_000002"]
    before = [json.loads(x) for x in (tmp_path / "a/train/reference.jsonl").read_text()
              .splitlines()]
    monkeypatch.delenv("ONBOARD_TEST_KILL")
    _run_worker(killed, proxy[1])
    assert "resumed from s3://onboard/runs/a/reference/step_000002 (step 2)" in \
        capsys.readouterr().out
    after = [json.loads(x) for x in (tmp_path / "a/train/reference.jsonl").read_text()
             .splitlines()]
    _run_worker(TrainConfig(**base, out=str(tmp_path / "b")), proxy[1])
    straight = [json.loads(x) for x in (tmp_path / "b/train/reference.jsonl").read_text()
                .splitlines()]
    loss = [r["loss"] for r in straight]
    assert [r["loss"] for r in before] == loss[:3]
    assert [r["loss"] for r in after] == loss  # step 3 recomputed from the bucket: the same
    assert [r["grad_norm"] for r in after] == [r["grad_norm"] for r in straight]
    assert s3.isfile("onboard/runs/a/reference/step_000004/COMPLETE")
    k = proxy[0].config.num_experts_per_tok
    for r in straight:
        tokens = r["tokens"]
        for layer, dropped in zip(r["expert_load"], r["dropped_by_layer"]):
            cap = math.ceil(1.0 * tokens * k / len(layer["tokens"]))
            assert dropped == sum(max(0, c - cap) for c in layer["tokens"])
        assert r["dropped_tokens"] == sum(r["dropped_by_layer"]) > 0


@pytest.mark.parametrize("kw", [{}, {"fused": True}, {"foreach": True}])  # capturable: GPU only
def test_resume_optimizer_state_is_what_adamw_makes(kw):
    """A resume loads into the state `init_optimizer_state` makes before any step; it must be
    AdamW's own (the fused kernel refuses a step tensor on another device than the parameters':
    the H200's resume failed so)."""
    from onboarding.train.checkpoint import Checkpointer

    def opt_with(p):
        return torch.optim.AdamW([p], lr=1e-3, **kw)

    p = torch.nn.Parameter(torch.randn(4, 3))
    stepped = opt_with(p)
    p.grad = torch.zeros_like(p)
    stepped.step()
    mine = opt_with(torch.nn.Parameter(torch.randn(4, 3)))
    Checkpointer.init_optimizer_state(mine)
    a, b = stepped.state[p], next(iter(mine.state.values()))
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k].dtype, a[k].device, a[k].shape) == (b[k].dtype, b[k].device, b[k].shape), k
    assert float(b["step"]) == 0.0


def test_unknown_url_scheme_is_bad_input():
    from onboarding.train.checkpoint import filesystem
    from onboarding.train.data import load_texts

    with pytest.raises(InputError, match="nosuch://b/x: cannot open this URL"):
        filesystem("nosuch://b/x")
    with pytest.raises(InputError, match="nosuch://"):
        load_texts("nosuch://b/x.jsonl")


# ---- the sequence sweep ----------------------------------------------------------------------

def test_seq_sweep_rows_say_oom_and_errors(tmp_path):
    """A length that ran out of memory or failed is a row that says so; the sweep goes on."""
    from onboarding.train import seqsweep

    base = TrainConfig(model="tiny_dense", out=str(tmp_path), steps=2, seq_len=8)
    logs = {16: None, 32: "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate",
            64: "ValueError: something else"}

    def run_one(cfg):
        train = Path(cfg.out) / "train"
        train.mkdir(parents=True)
        if logs[cfg.seq_len] is None:
            (train / "reference.jsonl").write_text("".join(json.dumps(
                {"step": s, "loss": 3.0 - s, "tokens_per_s": 100.0 * s,
                 "peak_mem_bytes": 2 ** 30}) + "\n" for s in (1, 2, 3)))
            return 0
        (train / "reference.log").write_text("step 1\n" + logs[cfg.seq_len] + "\n")
        return 1

    shown = []
    result = seqsweep.run_sweep(base, seqsweep.lengths([16, 32, 64]), tmp_path, run_one,
                                on_row=shown.append)
    assert shown == seqsweep.table_rows(result)  # each row shown as its length ended
    rows = {r["seq"]: r for r in result["rows"]}
    assert rows[16]["outcome"] == "ok" and rows[16]["tokens_per_s"] == 250.0
    assert rows[16]["loss_finite"] is True and rows[16]["peak_mem_gib"] == 1.0
    assert rows[32]["outcome"] == "OOM" and rows[32]["tokens_per_s"] is None
    assert rows[64]["outcome"].startswith("error (exit 1): ValueError")
    assert json.loads((tmp_path / "seq_sweep.json").read_text())["rows"][1]["outcome"] == "OOM"
    assert (tmp_path / "seq_sweep.png").stat().st_size > 0
    assert "| 32 | — | — | — | OOM |" in (tmp_path / "seq_sweep.md").read_text()
    with pytest.raises(InputError, match="listed twice"):
        seqsweep.lengths([16, 16])


@pytest.mark.slow
def test_seq_sweep_cli_runs_each_length_in_its_own_process(tmp_path):
    out = tmp_path / "sweep"
    p = subprocess.run([sys.executable, "-m", "onboarding.cli.main", "train", "tiny_dense",
                        "--seq-sweep", "16,32", "--steps", "2", "--lora-rank", "4",
                        "--recompute", "full", "--out", str(out)],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    result = json.loads((out / "seq_sweep.json").read_text())
    assert result["recompute"] == "full"
    assert [(r["seq"], r["outcome"], r["loss_finite"], r["steps"]) for r in result["rows"]] == \
        [(16, "ok", True, 2), (32, "ok", True, 2)]
    logs = [(out / f"seq{s}" / "train" / "reference.log").read_text() for s in (16, 32)]
    assert all("--role reference" in log for log in logs)
    assert "sequence sweep (recompute full)" in p.stdout
    assert "seq 16  tokens/s" in p.stdout  # the row printed when its length ended
    assert "![sequence sweep](seq_sweep.png)" in (out / "report.md").read_text()
