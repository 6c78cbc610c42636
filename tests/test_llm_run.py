"""End to end: `onboard run hf:xlstm --llm URL` on the CPU against recorded answers (malformed
JSON, then the correct Triton family after the error went back). The mLSTM cell, uncovered by
every built-in family, is served by the LLM-written family (the gate: the block check in its
subprocess, the runtime record, the sm_90 compile), aligned forward and backward in the model,
and listed as a kernel-PR candidate; the family folder loads like any plug-in family. The cell is
the weightless core of the mLSTM layer's block (`core_module`): the task, the LLM's record and the
family's forward are the cell's, the decision, coverage and alignment the layer's, whose
projections' GEMMs stay on the torch path."""

from __future__ import annotations

import json

import pytest

from fixtures.llm_replay import ReplayServer
from onboarding.cli.main import main

TINY = ["--set", "num_heads=2", "--set", "hidden_size=32", "--set", "embedding_dim=32",
        "--set", "num_blocks=1", "--set", "num_hidden_layers=1", "--set", "chunk_size=4",
        "--set", "vocab_size=64", "--seq", "8"]
BLOCK = "backbone.blocks.0.mlstm_layer"
CORE = f"{BLOCK}.mlstm_backend"


# the run registers its generated families in this process: conftest's `families` leaves the
# registry as found
pytestmark = pytest.mark.usefixtures("families")


@pytest.mark.slow
def test_run_serves_the_mlstm_cell_with_the_generated_family(tmp_path):
    with ReplayServer(["fix_after_feedback"]) as server:
        code = main(["run", "hf:xlstm", *TINY, "--llm", server.url, "--out", str(tmp_path / "r")])
    assert code == 0
    run = tmp_path / "r"
    decision = next(d for d in json.loads((run / "decisions.json").read_text()) if d["path"] == BLOCK)
    assert decision["decision"] == "generated" and decision["family"] == "mlstm_recurrent"
    assert decision["core"] == CORE
    cov = [e for e in json.loads((run / "coverage.json").read_text())["entries"] if e["path"] == BLOCK]
    core = [e for e in cov if e["op"] != "projections (GEMM)"]
    assert core and all((e["status"], e["family"]) == ("generated", "mlstm_recurrent") for e in core)
    assert [(e["status"], e["family"]) for e in cov if e not in core] == [("torch_fast", None)]
    align = json.loads((run / "alignment.json").read_text())
    patch = next(p for p in align["patches"] if p["path"] == BLOCK)
    assert patch["family"] == "mlstm_recurrent" and patch["status"] == "active"
    row = next(b for b in align["blocks"] if b["path"] == BLOCK)
    assert row["fwd"]["verdict"] == "pass" and row["bwd"]["verdict"] == "pass"
    cands = json.loads((run / "generated" / "pr_candidates.json").read_text())["pr_candidates"]
    assert [c["family"] for c in cands] == ["mlstm_recurrent"] and cands[0]["status"] == "candidate"
    assert "LLM-written kernel families" in (run / "report.md").read_text()
    summary = json.loads((run / "generated" / "llm" / CORE / "summary.json").read_text())
    assert [a["verdict"] for a in summary["attempts"]] == ["rejected", "accepted"]
    assert summary["attempts"][0]["reason"].startswith("malformed JSON")
    folder = run / "generated" / "families" / "mlstm_recurrent"
    assert {p.name for p in folder.iterdir()} >= {"family.py", "binding.py", "spec.json", "reference.py",
                                                   "mlstm_recurrent.py.j2", "gate.json"}
    gate = json.loads((folder / "gate.json").read_text())
    check = gate["details"]["check"]
    assert check["passed"] and [(s["batch"], s["seq"]) for s in check["sizes"]][2:] == [(1, 9), (3, 9)]
    record = check["artifacts"]["fp32"]
    assert record["launches"] >= 8 and not record["forbidden"] and not record["state_changes"]
    assert set(record["kernels"]) == {"mlstm_fwd_kernel", "mlstm_bwd_kernel"}
    assert record["reference"]["checked"] and not record["reference"]["reason"]
    assert all(r["ok"] for r in gate["details"]["aot"])
    # the folder matches blocks of the task's structure, whatever their class
    from onboarding.families import get_family
    from onboarding.graph.opgraph import Block

    spec = get_family("mlstm_recurrent")  # registered by the run (generated/families)
    block = next(b for b in json.loads((run / "opgraph.json").read_text())["blocks"] if b["path"] == BLOCK)
    other = Block(path="x", kind=block["kind"], layer=0, class_name="Anything",
                  op_histogram=block["op_histogram"], attrs=block["attrs"])
    assert spec.match(other) == {"variant": "plain", "params": {"chunk": 16}}
    assert spec.match(Block(path="x", kind="norm.rms", layer=0, class_name="", attrs={})) is None
