"""Plan and launch a training run: the single-process reference, then the torchrun parallel run.

`launch` checks everything it can before any process starts (config against the model's expert
count from a meta-device build, the data and tokenizer), writes ``<out>/train.toml``, runs the
commands with their output in ``<out>/train/<role>.log`` and compares the two loss curves.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from onboarding.errors import EXIT_ALERT, EXIT_CHECK_FAILED, EXIT_INTERNAL, EXIT_OK, InputError
from onboarding.families import subprocess_env
from onboarding.optional_kernels import state as hidden_state
from onboarding.train.config import TrainConfig


def config_path(cfg: TrainConfig) -> Path:
    return Path(cfg.out) / "train.toml"


def plan(cfg: TrainConfig) -> list[list[str]]:
    """Commands to run, in order: the reference, then (nproc > 1) the parallel run, then (when
    asked) the PEFT baseline (the model as it stands: `lm.baseline_label`)."""
    if not cfg.out:
        raise InputError("out: the run directory is not set")
    toml = str(config_path(cfg))
    worker = ["-m", "onboarding.train.worker", "--config", toml]
    cmds = [[sys.executable, *worker, "--role", "reference"]]
    if cfg.nproc > 1:
        cmds.append([sys.executable, "-m", "torch.distributed.run", "--standalone",
                     "--nproc-per-node", str(cfg.nproc), *worker, "--role", "parallel"])
    if cfg.baseline:
        cmds.append([sys.executable, *worker, "--role", "baseline"])
    return cmds


def check(cfg: TrainConfig):
    """Validate ``cfg`` against the model (meta build) and the data; returns (`ModelInfo`, routed
    expert count, tokenizer, the op graph a preflight (experts, the PEFT baseline) parsed when
    torch.export captured it, else None)."""
    from onboarding.train.data import PackedData, load_texts, load_tokenizer
    from onboarding.train.lm import (CONFIG_VOCAB, check_logits, lm_facts, position_limit,
                                     vocab_resize)
    from onboarding.train.setup import model_info, resolve_device, routed_experts, tokenizer_dir

    cfg.validate_fields()  # field checks first: cheap, and clear before the model is loaded
    info = model_info(cfg)
    meta = info.loaded.build(info.proxy_config, device="meta", seed=None)  # the model that trains
    n_experts = routed_experts(meta, info.proxy_config)
    cfg.validate(n_experts=n_experts)
    facts = lm_facts(meta)  # what the workers read of its config, or of its structure
    if facts.source != CONFIG_VOCAB:  # a config-less model: its forward's interface, on meta
        check_logits(meta, facts)
    patterns = [t for t in cfg.lora_targets if t != "auto"]
    if patterns:  # a pattern that matches no linear fails here, not in a worker in the run dir
        from onboarding.train.lora import resolve_targets

        resolve_targets(meta, None, patterns)
    if resolve_device(cfg).type == "cuda":  # one GPU per process
        import torch

        n_gpus = torch.cuda.device_count()
        if cfg.nproc > n_gpus:
            raise InputError(f"nproc={cfg.nproc}: one GPU per process, and this machine has "
                             f"{n_gpus}; use fewer processes, or --device cpu (gloo)")
    if facts.max_positions is not None and cfg.seq_len > facts.max_positions:
        raise InputError(f"seq_len={cfg.seq_len}: longer than the model's "
                         f"max_position_embeddings={facts.max_positions}")
    if facts.text_config is None:  # no config to name a limit: a fixed-size table's, on meta
        bound = position_limit(meta, cfg.seq_len)
        if bound is not None and cfg.seq_len > bound.limit:
            raise InputError(f"seq_len={cfg.seq_len}: longer than the {bound.limit} positions "
                             f"the model takes: its {bound.what}; use --seq {bound.limit} or "
                             "less")
    from onboarding.load.weights import check_shipped

    check_shipped(info)  # shipped safetensors that do not fit: before any directory exists
    tok = load_tokenizer(tokenizer_dir(info), facts.vocab_size, vocab_resize(info.loaded, facts))
    data = PackedData(load_texts(cfg.data), tok, cfg.seq_len, cfg.seed)
    if len(data) < cfg.global_batch:
        raise InputError(f"the data packs into {len(data)} rows of seq_len + 1 = "
                         f"{cfg.seq_len + 1} tokens, fewer than one global batch "
                         f"({cfg.global_batch}); add data or shorten seq_len")
    if cfg.checkpoint_dir is not None and cfg.checkpoint_interval > 0:
        from onboarding.train.checkpoint import filesystem

        filesystem(cfg.checkpoint_dir)  # a scheme without its fsspec filesystem: said now
    graph = None
    if n_experts and (cfg.ep > 1 or cfg.expert_lora or cfg.capacity_factor is not None
                      or cfg.balance in ("aux-loss", "bias")):
        graph = _preflight_experts(cfg, info)
    if cfg.baseline:
        graph = _preflight_peft(cfg, info, graph)
    if graph is not None and graph.capture != "export":
        # the dispatch recording ran the fill's routing (data-dependent shapes, counts): the
        # workers capture their own from the seed's weights
        graph = None
    return info, n_experts, tok, graph


def _preflight_peft(cfg: TrainConfig, info, graph):
    """The baseline's PEFT must take the LoRA targets our run trains: resolved on a meta build
    (``auto`` from the op graph, parsed here on `preflight_model` when no preflight did) and
    offered to PEFT's own injection; a refusal fails now, before any directory or run exists.
    Returns the graph (None when no ``auto``)."""
    from onboarding.train.lora import check_peft_accepts, resolve_targets

    if graph is None and "auto" in cfg.lora_targets:
        from onboarding.graph.parse import parse_stage
        from onboarding.train.setup import PARSE_SEQ

        graph = parse_stage(info, seq=PARSE_SEQ, seed=cfg.seed, model=preflight_model(info))

    def build():
        return info.loaded.build(info.proxy_config, device="meta", seed=None)

    targets = resolve_targets(build(), graph, cfg.lora_targets)
    check_peft_accepts(build, targets, rank=cfg.lora_rank, alpha=cfg.lora_alpha)
    return graph


def preflight_model(info):
    """The model a preflight captures (and replaces experts in): on the CPU in fp32 as the
    workers build it, from a fixed fill instead of the seed's initialization (`LoadedModel.build`
    with ``init=False``: 3 s against 9 s for 690 M parameters on a 2-core machine, where the
    seed's ``normal_`` runs on one thread). The refusals read shapes and structure, and an op
    graph torch.export captured never reads values (it is the one the seed's weights give, and
    goes to the workers); a dispatch recording's data-dependent counts follow the fill's routing,
    so `check` hands that one on to no worker."""
    return info.loaded.build(info.proxy_config, device="cpu", seed=None, init=False).float()


def _preflight_experts(cfg: TrainConfig, info):
    """Expert parallelism's refusals (an experts layout it cannot split, expert LoRA on weights
    that are not [E, out, in] halves, ...) before any directory exists: the workers' own
    replacement, run once here on the proxy (one CPU build, `preflight_model`, captured and then
    replaced; rank 0 of the EP group). Returns the op graph it parsed, which `launch` leaves in
    the run directory for the workers."""
    from onboarding.graph.parse import parse_stage
    from onboarding.train.moe_ep import EPGroup, ExpertLoRA, apply_expert_parallel
    from onboarding.train.setup import PARSE_SEQ

    model = preflight_model(info)
    graph = parse_stage(info, seq=PARSE_SEQ, seed=cfg.seed, model=model)
    lora = ExpertLoRA(rank=cfg.lora_rank, alpha=cfg.lora_alpha) if cfg.expert_lora else None
    ep_mods = apply_expert_parallel(model, graph, EPGroup(size=cfg.ep), lora=lora,
                                    capacity_factor=cfg.capacity_factor, seed=cfg.seed)
    if cfg.balance in ("aux-loss", "bias"):
        from onboarding.train.worker import balancing

        balancing(cfg, model, graph, ep_mods)  # bias: routers without a score bias refused
    return graph


def write_config(cfg: TrainConfig, *, source: Path | None = None) -> Path:
    """Write ``<out>/train.toml`` unless it is ``source`` itself (the user's edited file).

    An existing different ``train.toml`` there is never overwritten.
    """
    path = config_path(cfg)
    if source is not None and path.exists() and path.resolve() == source.resolve():
        return path
    if path.exists():
        if TrainConfig.from_toml(path) == cfg:
            return path
        raise InputError(f"{path} exists and differs from this setup; re-run it with "
                         f"`onboard train --config {path}` or choose another --out")
    return cfg.to_toml(path)


def describe(cfg: TrainConfig, n_experts: int | None,
             tokenizer_name: str | None = None) -> list[list[str]]:
    """The setup table (rows of field, value) printed by --dry-run and the report."""
    return [["model", f"{cfg.model} (proxy {cfg.proxy})"],
            ["layout", f"{cfg.nproc} processes = fsdp {cfg.fsdp} x ep {cfg.ep}"],
            ["routed experts", str(n_experts) if n_experts else "none (dense)"],
            ["batch", f"{cfg.micro_batch} seq/rank x {cfg.nproc} = {cfg.global_batch} x "
                      f"{cfg.seq_len} tokens, {cfg.steps} steps"],
            ["LoRA", f"r={cfg.lora_rank} alpha={cfg.lora_alpha:g} dropout={cfg.lora_dropout:g} "
                     f"targets={','.join(cfg.lora_targets)} experts={cfg.expert_lora}"],
            ["optimizer", f"AdamW lr={cfg.lr:g} wd={cfg.weight_decay:g} "
                          f"warmup={cfg.warmup_steps} clip={cfg.grad_clip:g}"],
            ["precision", f"base {cfg.dtype}, adapters + optimizer fp32, device {cfg.device}"],
            ["data", (cfg.data or "built-in stdlib docstring/code pairs") +
             (f" ({tokenizer_name})" if tokenizer_name else "")],
            ["checkpoints", f"every {cfg.checkpoint_interval} steps to {cfg.ckpt_root}"
             if cfg.checkpoint_interval else "none"],
            ["recompute", cfg.recompute_mode],
            ["compile", "blocks: torch.compile of each decoder layer from step 2 (step 1 eager)"
             if cfg.compile == "blocks" else "none (eager)"],
            ["load balance", cfg.balance + (f", aux-loss coef {cfg.aux_loss_coef:g}"
                                            if cfg.aux_loss_coef is not None else "")
             + (f", bias rate {cfg.bias_rate:g}" if cfg.balance in ("auto", "bias") else "")],
            ["alerts", (f"stall after {cfg.stall_timeout:g} s" if cfg.stall_timeout else
                        "no stall watchdog") + ", NaN/inf loss (exit 4)"
             + (f", webhook {cfg.alert_webhook}" if cfg.alert_webhook else "")],
            # installed kernel packages are hidden from the model code of every role
            # (`onboarding.optional_kernels`): the model's torch path plus onboard's patches
            ["model code's kernel packages", "; ".join(hidden_state().values()) or "none installed"]]


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written right now
    return rows


def _run(cmd: list[str], role: str, cfg: TrainConfig, console: Console) -> int:
    train_dir = Path(cfg.out) / "train"
    train_dir.mkdir(parents=True, exist_ok=True)
    log = train_dir / f"{role}.log"
    metrics = train_dir / f"{role}.jsonl"
    # PYTHONSAFEPATH: `python -m` would put the working directory on sys.path, and a repo
    # checkout's kernels/ folder would then shadow the Hugging Face `kernels` package.
    # the workers see the families this process was given (--families DIR) as well
    env = {**subprocess_env(), "PYTHONSAFEPATH": "1"}
    t0 = time.perf_counter()
    from onboarding.train.alerts import ALERT_FILE

    (train_dir / ALERT_FILE).unlink(missing_ok=True)  # an alert of an earlier attempt
    with open(log, "w") as out, console.status(f"train: {role} starting") as status:
        out.write("$ " + shlex.join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            while proc.poll() is None:
                rows = _rows(metrics)
                if rows and isinstance(rows[-1].get("loss"), (int, float)):
                    status.update(f"train: {role} step {rows[-1].get('step')}/{cfg.steps} "
                                  f"loss {rows[-1]['loss']:.4f}")
                time.sleep(0.5)
        finally:
            if proc.poll() is None:  # interrupted: take the run (torchrun: its workers) down
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    rc = proc.returncode
    took = time.perf_counter() - t0
    if rc != 0 and (train_dir / ALERT_FILE).exists():  # torchrun reports its own exit code
        alert = json.loads((train_dir / ALERT_FILE).read_text())
        console.print(f"[red]ALERT[/red] {role} run stopped: " + escape(
            f"[{alert.get('alert')}] {alert.get('message')} (exit {EXIT_ALERT}; "
            f"{train_dir / ALERT_FILE})"), highlight=False)
        return EXIT_ALERT
    if rc != 0:
        tail = log.read_text().splitlines()[-15:]
        console.print(f"[red]{role} run failed[/red] (exit {rc}, {took:.1f} s); last lines of "
                      f"{log}:\n" + "\n".join(tail), highlight=False)
    else:
        console.print(f"[green]done[/green] {role} run ({took:.1f} s)")
    return rc


def launch(cfg: TrainConfig, dry_run: bool = False, *, console: Console | None = None,
           source: Path | None = None, checked: tuple | None = None) -> int:
    """Check, write train.toml, run reference then parallel, compare; returns an exit code.

    ``source``: the train.toml this config was read from (never overwritten). A dry run
    prints the plan and the commands and writes nothing. ``checked``: `check`'s result when
    the caller already ran it.
    """
    console = console or Console()
    _, n_experts, tok, graph = checked or check(cfg)
    cmds = plan(cfg)
    if dry_run:
        from rich.table import Table

        table = Table(title="onboard train (dry run)", show_header=False)
        for k, v in describe(cfg, n_experts, tok.name):
            table.add_row(k, v)
        console.print(table)
        for cmd in cmds:
            console.print(shlex.join(cmd), highlight=False, soft_wrap=True)
        return EXIT_OK
    write_config(cfg, source=source)
    for what in hidden_state().values():  # say which path runs where it could have differed
        console.print(f"model code's kernel packages: {escape(what)} (every role takes the "
                      "model's torch path; onboard's kernels are patched in except in the "
                      "baseline)", highlight=False, soft_wrap=True)
    graph_file = Path(cfg.out) / "opgraph.json"
    if graph is not None and not graph_file.exists():  # the workers load it instead of parsing again
        graph.save(graph_file)
    for cmd in cmds:
        rc = _run(cmd, cmd[-1], cfg, console)  # every command ends with "--role ROLE"
        if rc != 0:
            return rc if rc in (2, 3, EXIT_ALERT) else EXIT_INTERNAL
    from onboarding.train.compare import compare, plot_balance, read_rows

    trained = Path(cfg.out) / "train" / f"{'parallel' if cfg.nproc > 1 else 'reference'}.jsonl"
    if trained.exists():
        plot_balance(read_rows(trained), trained.parent / "balance.png")
    if cfg.nproc == 1:
        return EXIT_OK

    result = compare(Path(cfg.out), dtype=cfg.dtype)
    console.print(result["summary"])
    return EXIT_OK if result["passed"] else EXIT_CHECK_FAILED
