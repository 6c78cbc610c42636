"""`onboard scale`: layouts, the per-layout row, the table, plot and report (the runs themselves
are `onboard train`'s, tested in test_training_*; a real sweep is in docs/LOG.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from onboarding.errors import InputError
from onboarding.report import build_report
from onboarding.train import scaling
from onboarding.train.config import TrainConfig


def test_layouts_pair_gpus_with_ep_degrees():
    assert [(x.gpus, x.ep, x.fsdp) for x in scaling.layouts([2, 4, 8], [2])] == \
        [(2, 2, 1), (4, 2, 2), (8, 2, 4)]
    assert [x.name for x in scaling.layouts([2, 4, 8], [2, 4, 8])] == \
        ["gpus2-ep2", "gpus4-ep4", "gpus8-ep8"]
    for gpus, eps, msg in (([4], [3], "must divide"), ([2, 4], [2, 4, 8], "one per GPU count"),
                           ([2, 2], [2], "listed twice")):
        with pytest.raises(InputError, match=msg):
            scaling.layouts(gpus, eps)


def _fake_run(cfg: TrainConfig) -> int:
    """What a finished `onboard train` leaves: train/compare.json with the parallel medians."""
    train = Path(cfg.out) / "train"
    train.mkdir(parents=True)
    if cfg.nproc == 8:
        return 1  # a crashed layout: no compare.json
    par = {"tokens_per_s": 1000.0 * cfg.nproc * (1.0 if cfg.nproc == 2 else 0.9), "mfu": 0.3,
           "a2a_share": 0.05 * cfg.ep, "a2a_exposed_share": 0.02 * cfg.ep,
           "expert_max_imbalance": 1.4, "peak_mem_bytes": 3 * 2**30}
    (train / "compare.json").write_text(json.dumps({
        "passed": True, "max_rel_diff": 1e-3, "tolerance": 2e-2,
        "metrics": {"parallel": par, "reference": None, "baseline": None}}))
    return 0


def test_sweep_table_plot_and_report(tmp_path):
    base = TrainConfig(model="hf:qwen3_next", seq_len=2048, micro_batch=4, dtype="bf16", steps=10)
    lays = scaling.layouts([2, 4, 8], [2, 4, 8])
    result = scaling.run_scaling(base, lays, tmp_path, _fake_run)
    rows = result["rows"]
    assert [r["tokens_per_s_per_gpu"] for r in rows[:2]] == [1000.0, 900.0]
    assert rows[1]["efficiency"] == pytest.approx(0.9) and rows[1]["a2a_share"] == 0.2
    assert rows[2]["rc"] == 1 and "no compare.json" in rows[2]["error"]
    assert json.loads((tmp_path / scaling.RESULTS_FILE).read_text())["rows"] == rows
    table = (tmp_path / scaling.TABLE_FILE).read_text()
    assert "| 4 | 4 x 1 | 900 | 0.90 | 30.0% | 20.0% | 8.0% | 1.40 | 3.0 |" in table
    assert (tmp_path / scaling.PLOT_FILE).stat().st_size > 0
    report = build_report(tmp_path, title="scale").read_text()
    assert "## Weak scaling" in report and "scaling.png" in report


def test_bad_layout_fails_before_anything_is_written(tmp_path, capsys):
    from onboarding.cli.main import main

    out = tmp_path / "s"
    assert main(["scale", "hf:qwen3_moe", "--gpus", "4", "--ep", "3", "--out", str(out)]) == 2
    assert "must divide" in capsys.readouterr().err and not out.exists()
