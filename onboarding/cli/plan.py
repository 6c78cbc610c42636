"""``onboard plan``: memory per GPU, communication and step time of the full-size model, per
FSDP x EP layout, on the CPU in seconds (the model is built on ``meta``: no weight exists)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from onboarding.cli.common import command_parser, model_argument
from onboarding.errors import EXIT_OK, InputError


def add_parser(sub) -> argparse.ArgumentParser:
    from onboarding.plan.config import OFFLOAD, RECOMPUTE

    p = command_parser(sub, "plan", help="memory per GPU, all-to-all bytes and step time of the "
                                         "full-size model for FSDP x EP layouts")
    model_argument(p)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field (JSON value); repeatable")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--impl", choices=("auto", "native", "remote"), default="auto",
                   help="remote code whose model_type transformers also implements")
    p.add_argument("--gpus", type=int, default=None,
                   help="GPUs in the cluster (default: this machine's, or 8 without a GPU)")
    p.add_argument("--gpu-mem", default=None, metavar="GiB",
                   help="memory per GPU (default: this GPU's, or an H200's 141 GiB)")
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence (default 4096)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per step")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--lora", dest="mode", action="store_const", const="lora",
                      help="LoRA on the attention projections (the default)")
    mode.add_argument("--full", dest="mode", action="store_const", const="full",
                      help="full fine-tuning: bf16 grads, fp32 master weights, Adam")
    p.set_defaults(mode="lora")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--expert-lora", action="store_true", help="also LoRA on the routed experts")
    p.add_argument("--no-kernels", dest="kernels", action="store_false",
                   help="plan every block's torch path, as `onboard train --no-kernels` (or a CPU "
                        "run) trains it (default: onboard's kernels where a family matches)")
    p.add_argument("--recompute", choices=RECOMPUTE, default=None,
                   help="activation recomputation (default: search all)")
    p.add_argument("--offload", choices=OFFLOAD, default=None,
                   help="what lives in host memory (default: search all)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel degree (default: search)")
    p.add_argument("--fsdp", type=int, default=None,
                   help="replicas of each expert slice; dense weights shard over every GPU "
                        "(default: --gpus / --ep)")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="expert capacity factor (default: dropless)")
    p.add_argument("--imbalance", type=float, default=1.25,
                   help="expected max/mean tokens on an EP rank (default 1.25, an assumption)")
    p.add_argument("--cluster", metavar="TOML",
                   help="links, memory, slack and kernel rates (onboarding.plan.config)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure GEMM, attention, HBM and launch rates on this GPU first")
    p.add_argument("--out", help="write model.json, opgraph.json, plan.json and plan.png here")
    p.add_argument("--json", action="store_true", help="print plan.json to stdout")
    p.add_argument("--all", action="store_true", help="list every layout searched")
    p.set_defaults(func=cmd_plan)
    return p


def plan_config(args: argparse.Namespace):
    """`PlanConfig` of the options, checked before any model is loaded."""
    from onboarding.plan.config import PlanConfig

    gpus = args.gpus if args.gpus is not None else default_gpus()
    cfg = PlanConfig(gpus=gpus, seq=args.seq, micro_batch=args.micro_batch, mode=args.mode,
                     lora_rank=args.lora_rank, expert_lora=args.expert_lora,
                     recompute=args.recompute, offload=args.offload, ep=args.ep, fsdp=args.fsdp,
                     capacity_factor=args.capacity_factor, imbalance=args.imbalance,
                     kernels=args.kernels)
    if cfg.expert_lora and cfg.mode == "full":
        raise InputError("--expert-lora: only with --lora (full training trains the experts)")
    cfg.validate()
    return cfg


def default_gpus() -> int:
    import torch

    return torch.cuda.device_count() or 8


def cmd_plan(args: argparse.Namespace, console: Console) -> int:
    from onboarding.cli.common import model_spec
    from onboarding.plan.capture import plan_graph
    from onboarding.plan.config import load_cluster, parse_gib
    from onboarding.plan.render import print_plan
    from onboarding.plan.run import run_plan
    from onboarding.rundir import owned_dir
    from onboarding.stages import run_load, save_model_json

    args.proxy = "tiny"
    cfg = plan_config(args)
    cluster = load_cluster(args.cluster, gpu_mem=parse_gib(args.gpu_mem))
    if args.calibrate:
        from onboarding.plan.calibrate import calibrate

        cluster.rates = calibrate(seq=cfg.seq)
    out = Path(args.out) if args.out else None
    if out is not None and out.exists() and any(out.iterdir()):
        raise InputError(f"--out {out}: directory exists and is not empty")
    spec = model_spec(args)
    with console.status("plan: loading (meta)"):
        info = run_load(spec)
        experts = {m.n_experts for m in info.full.moe if m.router_path}
        if cfg.ep and cfg.ep > 1 and len(experts) == 1 and next(iter(experts)) % cfg.ep:
            raise InputError(f"--ep {cfg.ep}: does not divide the model's "
                             f"{next(iter(experts))} routed experts")
        # the block kinds, from the tiny proxy (the dispatch capture: a second or two; again
        # longer where an attention block's modules did not all run: `plan.capture`)
        graph, notes = plan_graph(info)
    if out is None:
        plan = run_plan(info, graph, cfg, cluster, notes=notes)
    else:
        with owned_dir(out, created_here=True):
            save_model_json(info, out, spec.overrides)
            graph.save(out / "opgraph.json")
            plan = run_plan(info, graph, cfg, cluster, out, notes=notes)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1))
        return EXIT_OK
    print_plan(plan, console, all_layouts=args.all)
    if out is not None:
        console.print(f"wrote {out}")
    return EXIT_OK
