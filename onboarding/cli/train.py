"""``onboard train`` and ``scale``: LoRA training from options (or a train.toml), weak scaling."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from onboarding.cli.common import command_parser, model_argument
from onboarding.errors import InputError
from onboarding.load.overrides import int_list
from onboarding.train.config import (BALANCE, COMPILE, INIT_DEVICES, PROXIES, RECOMPUTE,
                                     TrainConfig)

# option dest -> TrainConfig field (options left unset take the config defaults)
FIELDS = {"nproc": "nproc", "ep": "ep", "fsdp": "fsdp", "steps": "steps", "seq": "seq_len",
          "micro_batch": "micro_batch", "lr": "lr", "lora_rank": "lora_rank",
          "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout",
          "lora_targets": "lora_targets", "expert_lora": "expert_lora",
          "recompute": "recompute", "compile": "compile", "balance": "balance", "aux_loss_coef": "aux_loss_coef",
          "bias_rate": "bias_rate", "checkpoint_dir": "checkpoint_dir",
          "stall_timeout": "stall_timeout", "alert_webhook": "alert_webhook",
          "checkpoint_interval": "checkpoint_interval", "seed": "seed", "dtype": "dtype",
          "device": "device", "init_device": "init_device", "data": "data", "proxy": "proxy",
          "trust_remote_code": "trust_remote_code", "capacity_factor": "capacity_factor",
          "profile_every": "profile_every", "kernels": "kernels", "baseline": "baseline"}


def add_parser(sub) -> None:
    add_train_parser(sub)
    add_scale_parser(sub)


def add_train_parser(sub) -> argparse.ArgumentParser:
    t = command_parser(sub, "train", help="FSDP2 + expert-parallel LoRA training of the proxy, "
                                          "checked against a single-process reference")
    t.add_argument("--config", metavar="TRAIN_TOML",
                   help="re-run an (edited) train.toml as written; no other options")
    t.add_argument("--dry-run", action="store_true", help="print the plan and commands only")
    t.add_argument("--json", action="store_true",
                   help="print the outcome (run directory, exit code, metrics, loss comparison, "
                        "adapter) as JSON to stdout; with --dry-run the plan and commands; "
                        "with --seq-sweep the sweep's rows")
    t.add_argument("--seq-sweep", type=int_list, default=None, metavar="L[,L...]",
                   help="one short run per sequence length (fresh processes): tokens/s, peak "
                        "memory, loss finite, OOM; seq_sweep.json, .md and .png")
    _train_options(t, layout=True)
    t.set_defaults(func=cmd_train)
    return t


def add_scale_parser(sub) -> argparse.ArgumentParser:
    t = command_parser(sub, "scale", help="weak scaling: one `onboard train` per GPU count x "
                                          "EP degree, tokens per GPU fixed; table and plot")
    t.add_argument("--json", action="store_true",
                   help="print the scaling result (scaling.json's content) to stdout")
    t.add_argument("--gpus", type=int_list, required=True, metavar="N[,N...]",
                   help="GPU (process) counts, e.g. 2,4,8")
    t.add_argument("--ep", type=int_list, required=True, metavar="E[,E...]",
                   help="EP degree per GPU count (or one for all); FSDP takes the rest")
    _train_options(t, layout=False)
    t.set_defaults(func=cmd_scale)
    return t


def _train_options(t: argparse.ArgumentParser, *, layout: bool) -> None:
    """The model and training options `train` and `scale` share (`layout`: --nproc/--ep/--fsdp)."""
    d = TrainConfig(model="")
    model_argument(t, "required unless --config TRAIN_TOML" if layout else "required")
    t.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                   help="override a model config field (JSON value); repeatable")
    t.add_argument("--trust-remote-code", action="store_true", default=None,
                   help="allow running the model's own modeling_*.py (read it first)")
    t.add_argument("--proxy", choices=PROXIES, default=None,
                   help=f"proxy size (default {d.proxy}; none = the full config)")
    t.add_argument("--out", help="run directory (default runs/<model>-<timestamp>)")
    layout_options = (("--nproc", int, d.nproc, "processes (= fsdp * ep)"),
                      ("--ep", int, d.ep, "expert-parallel degree"),
                      ("--fsdp", int, d.fsdp, "FSDP degree")) if layout else ()
    for flag, typ, default, help_ in (
            *layout_options,
            ("--steps", int, d.steps, "optimizer steps"),
            ("--seq", int, d.seq_len, "sequence length"),
            ("--micro-batch", int, d.micro_batch, "sequences per rank per step"),
            ("--lr", float, d.lr, "AdamW learning rate"),
            ("--lora-rank", int, d.lora_rank, "LoRA rank"),
            ("--lora-alpha", float, d.lora_alpha, "LoRA alpha"),
            ("--lora-dropout", float, d.lora_dropout, "LoRA dropout"),
            ("--checkpoint-interval", int, d.checkpoint_interval, "DCP checkpoint every N steps"),
            ("--seed", int, d.seed, "seed"),
            ("--capacity-factor", float, None, "expert capacity factor (default dropless)"),
            ("--profile-every", int, d.profile_every,
             "profile every N-th step: the all-to-all share, and where the step's time went in "
             "train/profile_<role>_step<N>.json (0 = off)")):
        t.add_argument(flag, type=typ, default=None,
                       help=help_ + (f" (default {default})" if default is not None else ""))
    t.add_argument("--lora-targets", type=lambda v: [x.strip() for x in v.split(",")],
                   default=None, metavar="auto|PATTERN[,PATTERN...]",
                   help="modules to adapt: auto (attention projections) or fnmatch patterns")
    t.add_argument("--expert-lora", action="store_true", default=None,
                   help="also train grouped LoRA on the routed experts")
    t.add_argument("--recompute", choices=RECOMPUTE, default=None,
                   help="activation recomputation: none, selective (each layer's MLP/expert "
                        "sub-blocks) or full (every decoder layer); default none")
    t.add_argument("--activation-checkpointing", dest="recompute", action="store_const",
                   const="full", help="the same as --recompute full")
    t.add_argument("--compile", choices=COMPILE, default=None,
                   help="blocks: torch.compile of each decoder layer (regional, inside recompute "
                        "and FSDP2), from the second step on (the first runs eagerly: kernel "
                        "patches calibrate there); a compile failure stops the run; default none")
    t.add_argument("--init-device", choices=INIT_DEVICES, default=None,
                   help="where the seed's base weights are made: cpu (default; the same weights "
                        "on every machine, slow at billions of parameters: one CPU thread fills "
                        "each tensor) or device (on the training device: seconds; the same "
                        "weights on every device of one kind, not the CPU's)")
    t.add_argument("--balance", choices=BALANCE, default=None,
                   help="expert load balancing: auto (the model's own; default), none, aux-loss "
                        "(Switch loss added to the LM loss), bias (aux-loss-free score bias, "
                        "routers with a score-correction bias only)")
    t.add_argument("--aux-loss-coef", type=float, default=None,
                   help="aux-loss coefficient (default the model's router_aux_loss_coef, or 0.01)")
    t.add_argument("--bias-rate", type=float, default=None,
                   help=f"bias balancing: update per step (default {d.bias_rate:g})")
    t.add_argument("--checkpoint-dir", default=None, metavar="PATH|URL",
                   help="checkpoint root, a path or an fsspec URL such as s3://bucket/run "
                        "(default <out>/train/ckpt)")
    t.add_argument("--stall-timeout", type=float, default=None, metavar="SECONDS",
                   help="stop with exit 4 when no step finishes for this long (default off)")
    t.add_argument("--alert-webhook", default=None, metavar="URL",
                   help="POST a JSON alert here on a stall or a NaN/inf loss")
    t.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                   help=f"base weight dtype (default {d.dtype})")
    t.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                   help="auto: CUDA when a GPU is here, else the CPU (gloo) (default auto)")
    t.add_argument("--no-kernels", dest="kernels", action="store_false", default=None,
                   help="use the torch paths even where onboard kernels exist (a baseline)")
    t.add_argument("--baseline", action="store_true", default=None,
                   help="also time the model as it stands with PEFT's LoRA (transformers + "
                        "PEFT; a plain nn.Module: its eager forward + PEFT), no onboard kernels, "
                        "no EP, on one device")
    t.add_argument("--data", default=None,
                   help="JSONL (prompt/response or text), .txt or directory (default: built-in)")


def _explicit(args: argparse.Namespace) -> list[str]:
    names = [k for k in FIELDS if getattr(args, k, None) is not None]
    if args.set:
        names.append("set")
    if args.out:
        names.append("out")
    return names


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    from onboarding.load.overrides import parse_assignments
    from onboarding.load.spec import ModelSpec

    if args.model is None:
        command = getattr(args, "command", "train")
        raise InputError(f"onboard {command}: give a MODEL"
                         + (" or --config train.toml" if command == "train" else ""))
    values = {f: getattr(args, k, None) for k, f in FIELDS.items()
              if getattr(args, k, None) is not None}
    # Fill the one layout degree left out: --ep 2 alone means 2 processes, --nproc 4 --ep 2
    # means fsdp 2. Explicit values that disagree still fail validation with a clear message.
    ep = values.get("ep", 1)
    if "nproc" not in values:
        values["nproc"] = values.get("fsdp", 1) * ep
    elif "fsdp" not in values and values["nproc"] % ep == 0:
        values["fsdp"] = values["nproc"] // ep
    model = args.model
    if not model.startswith("hf:") and Path(model).exists():
        model = str(Path(model).resolve())  # train.toml must work from any directory
    if values.get("checkpoint_dir") and "://" not in values["checkpoint_dir"]:
        values["checkpoint_dir"] = str(Path(values["checkpoint_dir"]).resolve())
    if values.get("data") and "://" not in values["data"] and Path(values["data"]).exists():
        values["data"] = str(Path(values["data"]).resolve())
    spec = ModelSpec(ref=model, overrides=parse_assignments(args.set),
                     trust_remote_code=bool(values.pop("trust_remote_code", False)),
                     proxy=values.pop("proxy", "tiny"))
    return TrainConfig.for_model(spec, **values)


def cmd_train(args: argparse.Namespace, console: Console) -> int:
    from onboarding.rundir import new_run_dir, owned_dir
    from onboarding.stages import save_model_json
    from onboarding.train.launch import check, launch

    source = None
    if args.seq_sweep is not None:
        if args.config:
            raise InputError("--seq-sweep takes the model and options, not --config")
        return cmd_seq_sweep(args, console)
    if args.config:
        extra = _explicit(args) + (["MODEL"] if args.model else [])
        if extra:
            raise InputError(f"--config re-runs {args.config} as written; edit the file "
                             f"instead of passing {', '.join(extra)}")
        source = Path(args.config)
        cfg = TrainConfig.from_toml(source)
        if not cfg.out:
            cfg.out = str(source.resolve().parent)
    else:
        cfg = config_from_args(args)
        if args.out:  # an unusable --out fails before the model is loaded
            new_run_dir("", args.out)
    with console.status("train: checking the setup"):
        checked = check(cfg)  # before any directory exists: bad input leaves nothing
    info = checked[0]
    if source is None:
        cfg.out = str(new_run_dir(info.loaded.name, args.out).resolve())
    out = Path(cfg.out)
    plan = None
    if args.dry_run or cfg.proxy == "none":
        with console.status("train: planning memory (meta)"):
            plan = train_plan(cfg, info)
    if args.dry_run:
        from onboarding.plan.render import print_plan

        print_plan(plan, console)
        rc = launch(cfg, True, console=console, source=source, checked=checked)
        if args.json:
            from onboarding.train.launch import plan as commands

            print(json.dumps({"dry_run": True, "plan": plan.to_dict(), "commands": commands(cfg)},
                             indent=1, default=str))
        return rc
    if plan is not None:
        refuse_unfit(plan, info)  # the full size: before anything is allocated
    # an interrupted run (Ctrl-C, SIGTERM: a preempted job) keeps its folder once its train.toml
    # is written: its checkpoints and logs are the run; before that it is removed
    toml = out / "train.toml"
    with owned_dir(out, created_here=source is None, resumable=toml.is_file):
        if not (out / "model.json").exists():
            save_model_json(info, out, cfg.overrides)
        try:
            rc = launch(cfg, False, console=console, source=source, checked=checked)
        except KeyboardInterrupt:
            if toml.is_file():
                from onboarding.cli.common import err

                how = ("resumes from its newest checkpoint" if cfg.checkpoint_interval > 0
                       else "runs it again from step 1 (no --checkpoint-interval)")
                err.print(f"interrupted: {out} kept; `onboard train --config {toml}` {how}",
                          highlight=False, markup=False, soft_wrap=True)
            raise
    _report(out, cfg, console)
    if args.json:
        print(json.dumps(outcome(out, rc), indent=1, default=str))
    return rc


def outcome(out: Path, rc: int) -> dict:
    """What `onboard train --json` prints: the run, its metrics as the terminal table shows
    them, the loss comparison and the adapter's folder (when written)."""
    from onboarding.report import baseline_runs, train_metrics

    train = out / "train"
    header, rows = train_metrics(out) if train.is_dir() else ([], [])
    cmp_file = train / "compare.json"
    return {"run_dir": str(out), "exit": rc, "config": str(out / "train.toml"),
            "metrics": [dict(zip(header, r)) for r in rows], "baseline": baseline_runs(out),
            "compare": json.loads(cmp_file.read_text()) if cmp_file.is_file() else None,
            "adapter": str(train / "adapter") if (train / "adapter").is_dir() else None,
            "report": str(out / "report.md") if (out / "report.md").is_file() else None}


def train_plan(cfg: TrainConfig, info):
    """The plan of the model as it will train (the proxy, or the full size with proxy none) in
    this run's layout: built on meta from its config, block kinds from the tiny proxy captured
    as `onboard plan` captures it (`onboarding.plan.capture.plan_graph`)."""
    from onboarding.plan import PlanConfig, load_cluster, run_plan
    from onboarding.plan.capture import plan_graph
    from onboarding.train.setup import resolve_device

    graph, notes = plan_graph(info)
    cuda = resolve_device(cfg).type == "cuda"
    pc = PlanConfig(gpus=cfg.nproc, ep=cfg.ep, seq=cfg.seq_len, micro_batch=cfg.micro_batch,
                    lora_rank=cfg.lora_rank, expert_lora=cfg.expert_lora,
                    recompute=cfg.recompute_mode,
                    offload="none", capacity_factor=cfg.capacity_factor, dtype=cfg.dtype,
                    kernels=cfg.kernels and cuda)  # the worker patches kernels on CUDA alone
    cluster = load_cluster()
    if not cuda:  # gloo on the CPU: the host's memory per process
        cluster.gpu_mem_gib, cluster.gpu_mem_source = _host_gib() / cfg.nproc, "host memory"
    return run_plan(info, graph, pc, cluster, config=info.proxy_config, notes=notes)


def _host_gib() -> float:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30


def refuse_unfit(plan, info) -> None:
    """Bad input (exit 2) when the model as it trains cannot fit: its fp32 CPU build (every
    process builds the whole model before sharding), or the plan's bytes per device (``plan``
    None: the host check only)."""
    host = 4 * info.full.total / 2 ** 30
    if host > _host_gib():
        raise InputError(f"proxy none: every process builds the whole model in fp32 on the "
                         f"CPU first, {host:,.0f} GiB > this machine's {_host_gib():,.0f} GiB; "
                         "`onboard plan` says what the full size needs (train a proxy here)")
    c = plan.chosen if plan is not None else None
    if c is not None and not c.fits:
        raise InputError(f"proxy none: {c.reason} (`onboard train --dry-run` shows the plan)")


def cmd_seq_sweep(args: argparse.Namespace, console: Console) -> int:
    """`onboard train ... --seq-sweep L,...`: every length checked first (bad input writes
    nothing), then one run per length in its own processes; a failed length is a row."""
    import dataclasses
    import shutil

    from rich.table import Table

    from onboarding.report import build_report
    from onboarding.rundir import new_run_dir, owned_dir
    from onboarding.stages import save_model_json
    from onboarding.train import seqsweep
    from onboarding.train.launch import _run, check, plan, write_config

    seqs = seqsweep.lengths(args.seq_sweep)
    if args.baseline:
        raise InputError("--seq-sweep times the run that trains; drop --baseline")
    if args.dry_run:
        raise InputError("--seq-sweep runs; --dry-run one length with --seq instead")
    base = config_from_args(args)
    if args.out:
        new_run_dir("", args.out)
    with console.status("seq sweep: checking every length"):
        checked = [check(dataclasses.replace(base, seq_len=s)) for s in seqs]
    info = checked[0][0]
    if base.proxy == "none":  # the host must hold the fp32 build; the device's limit is measured
        refuse_unfit(None, info)
    out = new_run_dir(info.loaded.name + "-seq", args.out).resolve()
    base.out = str(out)

    def run_one(cfg: TrainConfig) -> int:
        run_dir = Path(cfg.out)
        run_dir.mkdir(parents=True, exist_ok=True)
        save_model_json(info, run_dir, cfg.overrides)
        graph = out / "opgraph.json"  # parsed once (at a fixed length), shared by every run
        if graph.exists():
            shutil.copy(graph, run_dir / "opgraph.json")
        write_config(cfg)
        console.rule(f"seq {cfg.seq_len}")
        cmd = plan(cfg)[0 if cfg.nproc == 1 else 1]
        rc = _run(cmd, seqsweep.role(cfg), cfg, console)
        if not graph.exists() and (run_dir / "opgraph.json").exists():
            shutil.copy(run_dir / "opgraph.json", graph)
        return rc

    with owned_dir(out, created_here=True):
        save_model_json(info, out, base.overrides)
        result = seqsweep.run_sweep(
            base, seqs, out, run_one, on_row=lambda r: console.print(
                "  ".join(f"{h} {v}" for h, v in zip(seqsweep.TABLE_HEAD, r, strict=True))))
    t = Table(title=f"sequence sweep (recompute {result['recompute']})", box=None,
              padding=(0, 1), pad_edge=False)
    for h in seqsweep.TABLE_HEAD:
        t.add_column(h, justify="left" if h == "outcome" else "right")
    for r in seqsweep.table_rows(result):
        t.add_row(*r)
    console.print(t)
    console.print(f"report: {build_report(out, title=f'seq sweep {base.model}')}")
    console.print(f"run directory: {out}")
    if args.json:  # seq_sweep.json's content
        print(json.dumps({"run_dir": str(out), **result}, indent=1, default=str))
    return 0


def cmd_scale(args: argparse.Namespace, console: Console) -> int:
    """`onboard scale`: every layout checked first (bad input writes nothing), then run in turn."""
    from onboarding.report import build_report
    from onboarding.rundir import new_run_dir, owned_dir
    from onboarding.stages import save_model_json
    from onboarding.train import scaling
    from onboarding.train.launch import check, launch

    lays = scaling.layouts(args.gpus, args.ep)
    args.ep = None  # the layouts set nproc/ep/fsdp per run
    base = config_from_args(args)
    out = new_run_dir(Path(base.model).name.removeprefix("hf:") + "-scale", args.out).resolve()
    with console.status("scale: checking every layout"):
        checked = {lay.name: check(cfg) for lay, cfg in zip(lays, scaling.configs(base, lays, out))}
    info = next(iter(checked.values()))[0]
    codes = []

    def run(cfg: TrainConfig) -> int:
        run_dir = Path(cfg.out)
        run_dir.mkdir(parents=True, exist_ok=True)
        save_model_json(info, run_dir, cfg.overrides)
        console.rule(f"{run_dir.name}: {cfg.nproc} processes, EP {cfg.ep} x FSDP {cfg.fsdp}")
        codes.append(launch(cfg, console=console, checked=checked[run_dir.name]))
        return codes[-1]

    with owned_dir(out, created_here=True):
        save_model_json(info, out, base.overrides)
        result = scaling.run_scaling(base, lays, out, run)
    console.print(scaling.markdown(result), highlight=False)
    console.print(f"report: {build_report(out, title=f'scale {base.model}')}")
    if args.json:
        print(json.dumps(result, indent=1, default=str))
    return next((c for c in codes if c), 0)


def _report(out: Path, cfg: TrainConfig, console: Console) -> None:
    from rich.table import Table

    from onboarding.report import baseline_runs, build_report, train_metrics

    if (out / "train").is_dir():
        _, rows = train_metrics(out)
        if rows:  # the report's columns, headed short enough for an 80-column terminal
            runs = baseline_runs(out)
            t = Table(title="training (medians over the steps after the first)",
                      caption=f"baseline: {runs}" if runs else None,
                      box=None, padding=(0, 1), pad_edge=False)
            t.add_column("run", no_wrap=True)
            for h in ("tok/s", "step ms", "MFU", "a2a", "a2a exp", "peak GiB", "imbalance",
                      "steps"):
                t.add_column(h, justify="right", no_wrap=True, min_width=len(h))
            for r in rows:
                t.add_row(*(str(v) for v in r))
            console.print(t)
        from onboarding.train.compare import read_rows, summarize

        trained = out / "train" / ("parallel.jsonl" if cfg.nproc > 1 else "reference.jsonl")
        m = summarize(read_rows(trained)) if trained.exists() else {}
        if m.get("dropped_tokens") is not None:
            console.print(f"capacity factor {cfg.capacity_factor:g}: {m['dropped_tokens']:,} "
                          f"(token, expert) pairs dropped over {m['steps']} steps "
                          f"({100 * (m['dropped_share'] or 0):.1f}% of the routed pairs)")
        path = build_report(out, title=f"train {cfg.model}")
        console.print(f"report: {path}")
    console.print(f"run directory: {out}")

