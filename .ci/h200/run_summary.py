"""What a device call prints of one `onboard train` run directory: per step row file the kernels'
summary, the step times (and the compile mode and counters where the run compiled), the medians
of tok/s and MFU and the peak memory from step 2 and from step 3 on; per profile the wall, device
busy and host-gap times, the kernel times by phase, category and autograd node, and its top
kernels.

    python3 .ci/h200/run_summary.py RUN_DIR [--kernels-like copy,Cat,...]

``--kernels-like``: list only the top kernels whose name contains one of these (default: the
first 12)."""

import argparse
import glob
import json
import statistics

ap = argparse.ArgumentParser()
ap.add_argument("run")
ap.add_argument("--kernels-like", default="")
args = ap.parse_args()
like = [s for s in args.kernels_like.split(",") if s]

for f in sorted(glob.glob(args.run + "/train/*.jsonl")):
    rows = [json.loads(line) for line in open(f)]
    name = f.rsplit("/", 1)[1]
    print(name, "step s", [round(r["step_time_s"], 3) for r in rows])
    if any(r.get("compile", "none") != "none" for r in rows):
        print(name, "compile per step", [r.get("compile") for r in rows])
    for r in rows:
        if "kernels" in r:
            print("kernels", json.dumps(r["kernels"]), "rejected", json.dumps(r.get("kernels_rejected")))
    if rows and rows[-1].get("compile_stats"):
        print("compile stats (last step)", json.dumps(rows[-1]["compile_stats"]))
    for lo in (2, 3):
        late = [r for r in rows if r.get("step", 0) >= lo]
        if late:
            print(f"{name} median steps {lo}-{rows[-1]['step']}: tok/s %.0f, MFU %.1f%%, peak %.2f GiB" % (
                statistics.median(r["tokens_per_s"] for r in late),
                100 * statistics.median(r["mfu"] for r in late if r.get("mfu") is not None),
                max(r["peak_mem_bytes"] for r in late) / 2**30))
for f in sorted(glob.glob(args.run + "/train/profile_*.json")):
    p = json.load(open(f))
    print(f.rsplit("/", 1)[1], "wall %.1f ms, device busy %s ms, host gaps %s ms, kernels %.1f ms" % (
        p["wall_ms"], p.get("device_busy_ms"), p.get("host_gap_ms"), p["kernel_ms"]),
          "by phase", json.dumps(p["by_phase"]))
    print("  by category", json.dumps(p["by_category"]))
    nodes = sorted(p["by_autograd_node"].items(), key=lambda kv: -kv[1])[:16]
    print("  by autograd node", "; ".join(f"{k} {v:.1f}" for k, v in nodes))
    top = [k for k in p["top_kernels"] if any(s in k["name"] for s in like)] if like else p["top_kernels"][:12]
    for k in top:
        print(f"  {k['calls']:4d} calls {k['ms']:7.3f} ms  {k['name'][:150]}")
