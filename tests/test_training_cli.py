"""`onboard train`: dry run, bad configurations (exit 2, nothing left behind), --config re-runs,
the loss comparison and report section, and one real 2-process launch on the CPU (gloo)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from onboarding.cli.main import main
from onboarding.errors import InputError
from onboarding.train.compare import BF16_REL_TOL, FP32_REL_TOL, compare
from onboarding.train.config import TrainConfig
from onboarding.train.launch import plan, write_config

WORKER = Path(__file__).resolve().parent.parent / "onboarding" / "train" / "worker.py"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
# a plain nn.Module class (no transformers config): embedding 64 x 32 unless --set vocab=...
CONFIG_LESS = f"{FIXTURES / 'compressed_attention_models.py'}:CompressedTopkMaskLM"


@pytest.fixture
def small_data(tmp_path):
    f = tmp_path / "data.jsonl"
    rows = [{"prompt": f"Return the sum of item {i} and its square.",
             "response": f"def f{i}(x):\n    return x + x * x + {i}\n"} for i in range(200)]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def test_dry_run_prints_plan_and_starts_nothing(tmp_path, monkeypatch, capsys, small_data):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    rc = main(["train", "hf:qwen3_moe", "--nproc", "4", "--ep", "2",  # fsdp 2 inferred
               "--steps", "5", "--out", str(out), "--data", str(small_data), "--dry-run"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "--nproc-per-node 4 -m onboarding.train.worker" in text
    assert "--role reference" in text and "--role parallel" in text
    assert "fsdp 2 x ep 2" in text and "5 steps" in text
    assert not out.exists() and not (tmp_path / "runs").exists()
    assert not any(p.suffix == ".toml" for p in tmp_path.rglob("*"))


@pytest.mark.parametrize("argv,fragment", [
    (["hf:qwen3_moe", "--nproc", "3", "--ep", "3"],
     "ep=3: does not divide the model's {experts} routed experts"),
    (["hf:qwen3_moe", "--nproc", "2", "--ep", "1", "--fsdp", "1"],
     "nproc=2: world size must equal fsdp * ep"),
    (["hf:qwen3_moe", "--nproc", "3", "--ep", "2"], "nproc=3: world size must equal"),
    (["hf:qwen3", "--nproc", "2", "--ep", "2"], "ep=2: the model has no routed experts"),
    (["hf:qwen3", "--expert-lora"], "expert_lora=true: the model has no routed experts"),
    # found by expert parallelism itself (the workers' replacement, run once before any directory)
    (["hf:gpt_oss", "--expert-lora"], "expert_lora=true, but the expert weights"),
    (["hf:qwen3_moe", "--lora-dropout", "1.5"], "lora_dropout=1.5"),
    (["hf:qwen3_moe", "--data", "no/such/file.jsonl"], "--data no/such/file.jsonl: no such"),
    (["hf:qwen3_moe", "--seq", "0"], "seq_len=0: must be positive"),
    (["hf:qwen3_moe", "--seq", "10000000"], "longer than the model's max_position_embeddings"),
    (["hf:no_such_arch"], "unknown model_type 'no_such_arch'"),
    # a config-less model: what the workers read of a config, found by structure, or said here
    ([CONFIG_LESS], "vocab_size=64: the byte-level tokenizer needs at least 256 ids; give the "
     "model a tokenizer.json or a larger vocabulary (its 64 are the rows of its token embedding "
     "`embed` (64 x 32): --set the argument of CompressedTopkMaskLM that sizes it; it takes "
     "vocab, d, n_layers)"),
    ([f"{FIXTURES / 'sweep3_models.py'}:LeftPadConvMixer", "--set", "d=8"],
     "LeftPadConvMixer: no vocabulary to train on"),
    # a config-less model's context limit, by structure: a position table's rows, a table
    # sliced to the sequence (before: an index or shape error inside the workers' run)
    ([f"{FIXTURES / 'position_table_models.py'}:LearnedPositionLM", "--seq", "128"],
     "seq_len=128: longer than the 96 positions the model takes: its position table "
     "`pos.weight` (96 rows, looked up with positions); use --seq 96 or less"),
    ([f"{FIXTURES / 'position_table_models.py'}:SlicedTableLM", "--seq", "128"],
     "seq_len=128: longer than the 80 positions the model takes: its `pos` [1, 80, 16], sliced"),
    ([], "give a MODEL or --config"),
], ids=lambda v: v if isinstance(v, str) else " ".join(v)[:40])
def test_bad_configurations_exit_2_and_leave_nothing(tmp_path, monkeypatch, capsys, argv,
                                                     fragment):
    monkeypatch.chdir(tmp_path)
    if "{experts}" in fragment:  # the proxy's routed experts, from its config
        from onboarding.train.setup import model_info

        experts = model_info(TrainConfig(model=argv[0])).proxy_config.num_experts
        fragment = fragment.format(experts=experts)
    out = tmp_path / "run"
    rc = main(["train", *argv, "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert fragment in err and err.startswith("error:")
    assert len(err.splitlines()) <= 2  # one clear message (rich may wrap it once)
    assert not out.exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("written", [True, False], ids=["after-train-toml", "before"])
def test_interrupted_training_keeps_its_run_once_resumable(tmp_path, monkeypatch, capsys,
                                                            small_data, written):
    """Ctrl-C or SIGTERM (a preempted job) while the workers run: the run directory, with its
    train.toml (and checkpoints, logs), stays, and the message says how to continue; interrupted
    before train.toml exists, what the command created is removed (nothing to resume)."""
    from onboarding.train import launch as L

    def interrupted(cfg, dry, **kw):
        if written:
            write_config(cfg)
            (Path(cfg.out) / "train").mkdir()
            (Path(cfg.out) / "train" / "reference.jsonl").write_text('{"step": 1}\n')
        raise KeyboardInterrupt

    monkeypatch.setattr(L, "launch", interrupted)
    out = tmp_path / "run"
    rc = main(["train", "hf:qwen3_moe", "--steps", "3", "--checkpoint-interval", "1",
               "--out", str(out), "--data", str(small_data)])
    err = capsys.readouterr().err
    assert rc == 130
    if written:
        assert (out / "train.toml").is_file() and (out / "train" / "reference.jsonl").is_file()
        assert f"onboard train --config {out / 'train.toml'}" in err
        assert "resumes from its newest checkpoint" in err
    else:
        assert not out.exists() and "--config" not in err


def test_expert_preflight_graph_reaches_the_workers(tmp_path, small_data, monkeypatch):
    """With expert LoRA, `check` replaces the experts once on the proxy (the preflight) and hands
    its op graph on; `launch` leaves it as <out>/opgraph.json, which the workers load instead of
    parsing again. With nothing for expert parallelism to refuse, no preflight runs."""
    from onboarding.graph.opgraph import OpGraph
    from onboarding.train import launch as L

    out = tmp_path / "run"
    cfg = TrainConfig(model="hf:qwen3_moe", data=str(small_data), expert_lora=True, out=str(out))
    checked = L.check(cfg)
    assert checked[1] and checked[3] is not None and checked[3].by_kind("moe.experts")
    assert L.check(TrainConfig(model="hf:qwen3_moe", data=str(small_data)))[3] is None
    monkeypatch.setattr(L, "_run", lambda *a: 0)  # no worker processes
    out.mkdir()
    assert L.launch(cfg, checked=checked) == 0
    assert OpGraph.load(out / "opgraph.json").to_dict() == checked[3].to_dict()


@pytest.mark.parametrize("model, extra", [("hf:qwen3_moe", {"expert_lora": True}),
                                          ("hf:qwen3_moe", {"baseline": True}),
                                          ("hf:longcat_flash", {"baseline": True})])
def test_preflights_build_no_seeded_weights(tmp_path, small_data, monkeypatch, model, extra):
    """The preflights (experts, the PEFT baseline) capture a model whose weights are a fixed fill
    (`LoadedModel.build` with init=False; the seed's CPU initialization is the slow part of a
    build at billions of parameters): every build `check` makes is on meta or skips the
    initialization. The op graph it hands the workers is the one the seed's weights give: a
    torch.export capture (values never enter it); a dispatch recording (LongCat-Flash's routed
    loops: its counts follow the routing) is handed to no worker."""
    from onboarding.graph.parse import parse_stage
    from onboarding.load.model import LoadedModel
    from onboarding.train import launch as L
    from onboarding.train.setup import PARSE_SEQ

    if model == "hf:longcat_flash":
        pytest.importorskip("transformers.models.longcat_flash")
    builds = []
    build = LoadedModel.build

    def spy(self, config=None, *, device="cpu", init=True, **kw):
        built = build(self, config, device=device, init=init, **kw)
        builds.append((next(built.parameters()).device.type, init))
        return built

    monkeypatch.setattr(LoadedModel, "build", spy)
    cfg = TrainConfig(model=model, data=str(small_data), out=str(tmp_path / "run"), **extra)
    info, _, _, graph = L.check(cfg)
    assert ("cpu", False) in builds
    assert all(device == "meta" or not init for device, init in builds), builds
    monkeypatch.undo()
    seeded = parse_stage(info, seq=PARSE_SEQ, seed=cfg.seed)
    if seeded.capture == "export":
        assert graph is not None and graph.to_dict() == seeded.to_dict()
    else:
        assert graph is None


def test_more_processes_than_gpus_exit_2_and_leave_nothing(tmp_path, monkeypatch, capsys):
    """On a GPU machine each process takes a GPU: asking for more fails before anything runs."""
    import torch

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    rc = main(["train", "hf:qwen3_moe", "--nproc", "4", "--ep", "2", "--out", "run"])
    err = capsys.readouterr().err
    assert rc == 2 and "nproc=4: one GPU per process, and this machine has 2" in err
    assert not (tmp_path / "run").exists()


def test_config_rerun_uses_the_edited_file(tmp_path, capsys):
    out = tmp_path / "run"
    toml = TrainConfig(model="hf:qwen3_moe", out=str(out), nproc=2, ep=2,
                       steps=11).to_toml(out / "train.toml")
    text = toml.read_text().replace("steps = 11", "steps = 13")
    toml.write_text(text)
    assert main(["train", "--config", str(toml), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "13 steps" in printed and str(toml) in printed
    assert toml.read_text() == text  # the user's file is never rewritten
    assert main(["train", "--config", str(toml), "--steps", "3"]) == 2
    assert "--config re-runs" in capsys.readouterr().err
    assert main(["train", "--config", str(tmp_path / "missing.toml")]) == 2


def test_train_toml_never_overwritten(tmp_path):
    cfg = TrainConfig(model="hf:qwen3_moe", out=str(tmp_path), steps=4)
    write_config(cfg)
    write_config(cfg)  # same content: fine
    cfg.steps = 5
    with pytest.raises(InputError, match="exists and differs"):
        write_config(cfg)
    assert TrainConfig.from_toml(tmp_path / "train.toml").steps == 4


def test_plan_commands():
    one = plan(TrainConfig(model="m", out="/r"))
    assert len(one) == 1 and one[0][-2:] == ["--role", "reference"]
    two = plan(TrainConfig(model="m", out="/r", nproc=2, ep=2))
    assert two[1][1:7] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           "2", "-m"]
    assert two[1][-4:] == ["--config", "/r/train.toml", "--role", "parallel"]


def _rows(path: Path, losses: list[float], **extra) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"step": i + 1, "loss": v, "tokens_per_s": 100.0 * (i + 1),
                                        "peak_mem_bytes": 2 ** 30, **extra}) + "\n"
                            for i, v in enumerate(losses)))


def test_compare_verdicts_plots_and_report(tmp_path):
    from onboarding.report import build_report

    train = tmp_path / "train"
    ref = [7.5, 7.25, 7.0, 6.5]
    _rows(train / "reference.jsonl", ref)
    _rows(train / "parallel.jsonl", [v * (1 + 3e-6) for v in ref],
          expert_load=[{"layer": "l0", "tokens": [3, 1], "max_over_mean": 1.5}])
    res = compare(tmp_path)
    assert res["passed"] and res["max_rel_diff"] == pytest.approx(3e-6, rel=1e-3)
    assert res["metrics"]["parallel"]["expert_max_imbalance"] == 1.5
    assert res["metrics"]["parallel"]["tokens_per_s"] == 300.0  # median without step 1
    assert (train / "loss.png").stat().st_size > 0 and (train / "metrics.png").exists()
    assert json.loads((train / "compare.json").read_text())["passed"]
    # 1e-4 apart: fails in fp32, passes the bf16 band
    _rows(train / "parallel.jsonl", [v * (1 + 1e-4) for v in ref])
    assert not compare(tmp_path, plot=False)["passed"]
    assert compare(tmp_path, dtype="bf16", plot=False)["passed"]
    assert FP32_REL_TOL < 1e-4 < BF16_REL_TOL
    # a missing step fails, and says so
    _rows(train / "parallel.jsonl", ref[:3])
    res = compare(tmp_path)
    assert not res["passed"] and "step 4 missing in the parallel run" in res["summary"]
    TrainConfig(model="hf:qwen3_moe", out=str(tmp_path), nproc=2, ep=2).to_toml(
        tmp_path / "train.toml")
    rows = [json.loads(line) for line in (train / "reference.jsonl").read_text().splitlines()]
    rows[0].update(kernels={"norm.rms": 3, "rejected:linear_attention.gated_delta": 1},
                   kernels_rejected={"model.layers.4.linear_attn": "output: FAIL rel_rms=1.70e-02"})
    (train / "reference.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = build_report(tmp_path, title="t").read_text()
    assert "## Training" in report and "FAIL" in report and "train/loss.png" in report
    assert "fsdp 1 x ep 2" in report
    # the first step's patches, and why one fell back to the torch path
    assert "Kernels patched in the reference run: norm.rms 3." in report
    assert "- `model.layers.4.linear_attn`: output: FAIL rel_rms=1.70e-02" in report


def test_the_report_says_what_the_baseline_ran(tmp_path):
    """The report (and the terminal table's caption, `--json`'s ``baseline``) says what the
    baseline ran, as its rows say: transformers + PEFT, or the eager model + PEFT for a plain
    nn.Module; rows that say nothing (an older run) give no line. Before: the CLI called every
    baseline transformers + PEFT and the report said nothing."""
    from onboarding.cli.train import outcome
    from onboarding.report import _train_section, baseline_runs

    train = tmp_path / "train"
    _rows(train / "reference.jsonl", [7.5, 7.25])
    _rows(train / "baseline.jsonl", [7.5, 7.3], runs="eager model + PEFT")
    assert baseline_runs(tmp_path) == "eager model + PEFT"
    assert "The baseline ran the eager model + PEFT: the model's own forward" in \
        _train_section(tmp_path)
    assert outcome(tmp_path, 0)["baseline"] == "eager model + PEFT"
    assert [m["run"] for m in outcome(tmp_path, 0)["metrics"]] == ["reference", "baseline"]
    _rows(train / "baseline.jsonl", [7.5, 7.3])
    assert baseline_runs(tmp_path) is None and "baseline ran" not in _train_section(tmp_path)


@pytest.mark.slow  # two launches of fresh processes: ~40-70 s on 2 busy cores
@pytest.mark.skipif(not WORKER.exists(), reason="the distributed worker is not built yet")
def test_end_to_end_two_ranks_match_reference(tmp_path, small_data, capsys):
    out = tmp_path / "run"
    rc = main(["train", "hf:qwen3_moe", "--nproc", "2", "--ep", "2", "--steps", "3",
               "--seq", "32", "--micro-batch", "1", "--data", str(small_data),
               "--out", str(out)])
    printed = capsys.readouterr()
    assert rc == 0, printed.out[-3000:] + printed.err[-3000:]
    res = json.loads((out / "train" / "compare.json").read_text())
    assert res["passed"] and len(res["steps"]) == 3 and res["max_rel_diff"] <= FP32_REL_TOL
    assert (out / "train" / "adapter" / "adapter_model.safetensors").exists()
    assert TrainConfig.from_toml(out / "train.toml").data == str(small_data.resolve())
    assert "## Training" in (out / "report.md").read_text()
    # the terminal shows the metrics table: a row per run, tokens/s a number
    table = printed.out[printed.out.index("training (medians"):]
    for role in ("reference", "parallel"):
        row = next(line for line in table.splitlines() if role in line)
        assert re.search(r"\d", row.split(role, 1)[1]), row


@pytest.mark.slow  # two launches of fresh processes: about 30 s on 2 busy cores
def test_config_less_model_trains_with_its_baseline(tmp_path, monkeypatch, capsys):
    """MODEL as file.py:Name, a plain nn.Module with no transformers config: ours and the PEFT
    baseline train on it (vocabulary from its embedding, logits from its tensor output), and the
    adapters export with a note on how to rebuild the base (no save_pretrained)."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    rc = main(["train", CONFIG_LESS, "--set", "vocab=256", "--nproc", "1", "--steps", "2",
               "--seq", "16", "--lora-rank", "4", "--device", "cpu", "--baseline",
               "--out", str(out)])
    printed = capsys.readouterr()
    assert rc == 0, printed.out[-3000:] + printed.err[-3000:]
    for role in ("reference", "baseline"):
        rows = [json.loads(x) for x in (out / "train" / f"{role}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] > 0 for r in rows), rows
    # what the baseline ran: no transformers code here, its own eager forward with PEFT
    assert all(r["runs"] == "eager model + PEFT" for r in rows), rows
    assert "baseline: eager model + PEFT" in printed.out  # the table's caption
    note = json.loads((out / "train" / "adapter" / "onboard_adapter.json").read_text())
    assert note["target_modules"] > 0 and note["base"]["saved"] is False
    assert "rebuild" in note["base"]


@pytest.mark.slow
def test_agent_run_trains_after_tuning(tmp_path):
    """`onboard run --train-steps` adds the train node: EP=2 on two gloo ranks, its reference,
    the loss comparison in the state and the report."""
    run_dir = tmp_path / "r"
    proc = subprocess.run(
        [sys.executable, "-m", "onboarding.cli.main", "run", "hf:qwen3_moe", "--seq", "16",
         "--kernels", "none", "--train-steps", "2", "--train-nproc", "2", "--out", str(run_dir)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    cmp = json.loads((run_dir / "train" / "compare.json").read_text())
    assert cmp["passed"] and len(cmp["steps"]) == 2
    assert "ep = 2" in (run_dir / "train.toml").read_text()
    report = (run_dir / "report.md").read_text()
    assert "## Training" in report and "PASS" in report
