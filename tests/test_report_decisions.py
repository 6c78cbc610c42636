"""The report's "Why this kernel" section: a block's alignment verdict says whether a kernel ran."""

from __future__ import annotations

import json

from onboarding.generate.decide import DECISIONS_FILE, Decision, Evidence, save_decisions
from onboarding.report import _decisions_section


def test_an_unpatched_block_s_pass_is_not_a_kernel_s_pass(tmp_path):
    """A block left uncovered runs its own code in the alignment, so its pass checks no kernel:
    the section said "fwd pass, bwd pass" for hf:recurrent_gemma's two RG-LRU blocks (no family,
    Inductor refused the loop over time) as for a served block. It now says the block was not
    patched (alignment.json's patches: none active at its path); a served block's verdict is
    unchanged."""
    loop = "layers.0.mixer"
    served = "layers.1.router"
    ds = [Decision(path=loop, kind="linear_attention.other", op="linear-attention recurrence",
                   key="a", decision="uncovered",
                   evidence=[Evidence(option="inductor", outcome="skipped", reason="a loop")]),
          Decision(path=served, kind="moe.router", op="router scoring + top-k", key="b",
                   decision="inductor",
                   evidence=[Evidence(option="inductor", outcome="accepted", reason="passed")])]
    save_decisions(ds, tmp_path / DECISIONS_FILE)
    ok = {"fwd": {"verdict": "pass"}, "bwd": {"verdict": "pass"}}
    (tmp_path / "alignment.json").write_text(json.dumps({
        "blocks": [{"path": loop, **ok}, {"path": served, **ok}],
        "patches": [{"path": served, "family": "inductor", "status": "active"},
                    {"path": "layers.0.norm", "family": "rmsnorm", "status": "active"}]}))
    rows = {line.split("|")[1].strip(): line for line in _decisions_section(tmp_path).splitlines()
            if line.startswith("| `")}
    assert rows[f"`{loop}`"].rstrip().endswith("| fwd pass, bwd pass (not patched: its own code) |")
    assert rows[f"`{served}`"].rstrip().endswith("| fwd pass, bwd pass |")
