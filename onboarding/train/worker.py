"""One training process: ``python -m onboarding.train.worker --config PATH --role ROLE``.

``--role parallel`` runs under torchrun (gloo on the CPU, nccl on CUDA) with the FSDP2 x EP
layout of the config; ``--role reference`` is the same model, data and seed in one process
without sharding (experts computed by the same module with every expert local). ``--role
baseline`` is what users get today, for speed comparisons on one device: the model as it stands
(its own experts, no onboard kernels: transformers' code, or a plain module's own eager forward,
`lm.baseline_label`) with PEFT LoRA on the same targets, fed one rank's share of each batch.
Each writes ``<out>/train/<role>.jsonl``; the parallel role (the
reference when it is the only process) exports the adapters to ``<out>/train/adapter/`` and the
base they trained on to ``<out>/train/base/`` (`onboarding.train.peft_export.export_run`). On
CUDA with ``kernels = true`` the reference and parallel roles patch the onboard kernels that
pass their checks on the device (`onboarding.train.kernels`).

Test hooks: ``ONBOARD_TEST_KILL=RANK:STEP`` makes that rank exit(1) right after that step (after
its checkpoint, if one is due) to test crash recovery; ``ONBOARD_TEST_STALL=STEP:SECONDS`` sleeps
inside that step (before its backward) to test the stall watchdog (`onboarding.train.alerts`).
They only ever end a run early.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from onboarding.graph.torch_paths import torch_reference_paths
from onboarding.errors import EXIT_BAD_INPUT, InputError
from onboarding.optional_kernels import hide as hide_kernel_packages
from onboarding.train import metrics as M
from onboarding.train.alerts import Alerts
from onboarding.train.checkpoint import Checkpointer
from onboarding.train.compile import (CompileFailed, compile_blocks, compile_stats,
                                      failures_named)
from onboarding.train.config import TrainConfig
from onboarding.train.lm import lm_logits
from onboarding.train.moe_ep import (
    ExpertLoRA, RouterTaps, aux_loss, apply_expert_parallel, check_bias_balancing, global_counts,
    score_bias_tensors, update_score_bias)
from onboarding.train.parallel import (
    Layout, apply_recompute, clip_grads, decoder_blocks, finish_expert_grads, make_layout, shard,
    single_layout)

KILL_ENV = "ONBOARD_TEST_KILL"
STALL_ENV = "ONBOARD_TEST_STALL"  # STEP:SECONDS: sleep inside that step (tests the watchdog)
DEFAULT_AUX_COEF = 0.01  # Switch Transformer's; used when the model's config has none
# Measurement hook (tests/fixtures/step_host_cost.py): ``step -> context manager`` entered around
# that step's timed work (forward, backward, optimizer); None in a normal run.
step_context = None


def _init(role: str, cfg: TrainConfig) -> tuple[Layout, torch.device]:
    from onboarding.train.setup import resolve_device

    device = resolve_device(cfg)
    if role in ("reference", "baseline"):
        return single_layout(), device
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != cfg.nproc:
        raise InputError(f"nproc={cfg.nproc} but the launcher started {world} processes")
    if world == 1:
        return single_layout(), device
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return make_layout(cfg.fsdp, cfg.ep, device.type), device


def _lr(cfg: TrainConfig, step: int) -> float:
    if cfg.warmup_steps <= 0:
        return cfg.lr
    return cfg.lr * min(1.0, step / cfg.warmup_steps)


def _world_mean(x: torch.Tensor, layout: Layout) -> float:
    x = x.detach().double().clone()
    if layout.distributed:
        dist.all_reduce(x)
        x /= layout.world
    return float(x)


def _maybe_kill(layout: Layout, step: int) -> None:
    spec = os.environ.get(KILL_ENV, "")
    if spec:
        rank, _, at = spec.partition(":")
        if int(rank) == layout.rank and int(at) == step:
            print(f"[{KILL_ENV}] rank {layout.rank} exits after step {step}", flush=True)
            os._exit(1)


def _maybe_stall(step: int) -> None:
    spec = os.environ.get(STALL_ENV, "")
    if spec and int(spec.partition(":")[0]) == step:
        time.sleep(float(spec.partition(":")[2]))


def balancing(cfg: TrainConfig, model, graph, ep_mods) -> tuple[float, float]:
    """(aux-loss coefficient, score-bias rate) of ``cfg.balance``; 0 = off.

    auto: the model's own setup (its config's ``router_aux_loss_coef``; the bias update where a
    router has a score-correction bias); aux-loss: the Switch loss with ``aux_loss_coef`` (else
    the model's coefficient, else 0.01); bias: DeepSeek-V3's auxiliary-loss-free update, only
    for routers that select on scores plus a per-expert bias (checked by structure); none: off.
    """
    if cfg.balance == "none" or not ep_mods:
        if cfg.balance in ("aux-loss", "bias") and not ep_mods:
            raise InputError(f"balance={cfg.balance!r}: the experts kept the model's own module "
                             "(see the warning above), so the per-expert load is not counted")
        return 0.0, 0.0
    from onboarding.train.lm import lm_facts

    own = lm_facts(model).router_aux_loss_coef
    e = ep_mods[0].n_experts
    if cfg.balance == "auto":
        return (cfg.aux_loss_coef if cfg.aux_loss_coef is not None else own), \
            (cfg.bias_rate if score_bias_tensors(model, graph, e) else 0.0)
    if cfg.balance == "aux-loss":
        return (cfg.aux_loss_coef if cfg.aux_loss_coef is not None else own or DEFAULT_AUX_COEF), 0.0
    check_bias_balancing(model, graph, e)
    return 0.0, cfg.bias_rate


def prepare(cfg: TrainConfig, role: str, built, layout: Layout, device: torch.device):
    """``built.model`` (in place) as ``role`` trains it, before recompute and sharding:
    the baseline gets PEFT's LoRA on the model as it stands; ours gets the expert-parallel
    experts, our LoRA and, on CUDA with ``kernels``, the onboard kernels that pass their checks.
    Returns (expert-parallel modules, the kernels' `PatchSet` or None, the counts of the kernels
    training attaches itself: experts, weighted SwiGLU, pair sums, LoRA, the loss)."""
    from onboarding.train.lora import inject_lora

    model, graph = built.model, built.graph
    if role == "baseline":
        _peft(model, graph, cfg)
        return [], None, {}
    ep_mods = []
    if built.n_experts:
        ep_mods = apply_expert_parallel(
            model, graph, layout.ep_group,
            lora=ExpertLoRA(rank=cfg.lora_rank, alpha=cfg.lora_alpha) if cfg.expert_lora
            else None, capacity_factor=cfg.capacity_factor,
            dispatch_groups=cfg.fsdp if role == "reference" and cfg.capacity_factor else 1,
            seed=cfg.seed)
    inject_lora(model, graph, targets=cfg.lora_targets, rank=cfg.lora_rank,
                alpha=cfg.lora_alpha, dropout=cfg.lora_dropout, seed=cfg.seed)
    patches, attached = None, {}
    if cfg.kernels and device.type == "cuda":
        from onboarding.train.kernels import attach_training_kernels

        patches, attached = attach_training_kernels(
            model, graph, ep_mods, Path(cfg.out) / "train" / "kernels", rank=layout.rank,
            distributed=layout.distributed, torch_loss=chunked_cross_entropy,
            ignore_index=IGNORE_INDEX)
    return ep_mods, patches, attached


def _adamw(params: list, cfg: TrainConfig, *, fused: bool) -> torch.optim.AdamW:
    """AdamW over the adapters: one fused kernel for all of them on one GPU (the per-tensor
    loop launched about a dozen kernels per adapter tensor); per tensor where the adapters are
    DTensor shards beside plain expert tensors (a fused or foreach step takes one kind)."""
    kw = {"fused": True} if fused else {"foreach": False}
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **kw)


def lm_loss(model: nn.Module, ids: torch.Tensor, *, chunked: bool = False) -> torch.Tensor:
    """Next-token cross-entropy of ``ids`` [B, T + 1], in fp32 over the full-vocabulary logits
    (the model called as `lm.lm_logits` calls it: a config-less ``nn.Module`` too).

    ``chunked`` (ours): `chunked_cross_entropy`, through the loss kernel `prepare` attached to
    ``model`` where there is one (`kernels.attach_loss_kernel`); else (the baseline, as
    transformers computes it) one fp32 copy of the logits, whose log-probabilities autograd keeps
    for the backward."""
    # on the CPU, model code takes its torch path, never a GPU kernel library it found
    with torch_reference_paths() if ids.device.type == "cpu" else contextlib.nullcontext():
        logits = lm_logits(model, ids[:, :-1])
    flat, targets = logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    if chunked:
        from onboarding.train.kernels import LOSS_KERNEL_ATTR

        return chunked_cross_entropy(flat, targets, kernel=getattr(model, LOSS_KERNEL_ATTR, None))
    return F.cross_entropy(flat.float(), targets)


CE_CHUNK_ELEMENTS = 1 << 26  # fp32 elements of one chunk's logits (256 MiB)
IGNORE_INDEX = -100  # F.cross_entropy's default: such targets add no loss and no gradient


class _ChunkedCE(torch.autograd.Function):
    """Summed cross-entropy of ``logits`` [N, V] against ``targets`` [N], divided by ``count``,
    in fp32 over row chunks, with the gradient written in the forward.

    Each chunk is read once: its fp32 log-softmax gives the chunk's loss and, by the same aten
    ops autograd's backward of ``F.cross_entropy(chunk.float(), t, reduction="sum") / count``
    runs (`NllLossBackward0`'s one-hot, `_log_softmax_backward_data`, the cast back), its
    gradient, stored into one [N, V] buffer in the logits' dtype. Autograd keeps that buffer,
    not the logits (the same bytes): the logits are freed with the model's output, and the
    backward only scales the buffer in place by the incoming gradient (exactly 1 in training: a
    bf16 multiply by 1 changes nothing). The checkpointed form this replaces recomputed every
    chunk in the backward, and each chunk's slice-backward filled a zero [N, V] gradient that
    autograd then summed: on the H200 (Qwen3-MoE-style proxy, 16,384 tokens x 32,000)
    `SliceBackward0` took 10.8 ms of a 242 ms step (with the rotary embedding's slices).
    Backward once (the buffer is reused)."""

    @staticmethod
    def forward(ctx, logits, targets, count):
        n, v = logits.shape
        grad = torch.empty_like(logits)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        scale = torch.ones((), dtype=torch.float32, device=logits.device) / count
        step = max(1, CE_CHUNK_ELEMENTS // max(v, 1))
        for lo in range(0, n, step):
            t = targets[lo:lo + step]
            lsm = torch.log_softmax(logits[lo:lo + step].float(), dim=-1)
            keep = (t != IGNORE_INDEX).unsqueeze(-1)
            tt = t.clamp(min=0).unsqueeze(-1)
            total -= (lsm.gather(1, tt) * keep).sum()
            gout = torch.zeros_like(lsm).scatter_(1, tt, (-scale).expand(tt.shape) * keep)
            grad[lo:lo + step] = torch.ops.aten._log_softmax_backward_data(
                gout, lsm, -1, torch.float32)
        ctx.save_for_backward(grad)
        return total / count

    @staticmethod
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors
        return grad.mul_(grad_out.to(grad.dtype)), None, None


def chunked_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *,
                          kernel=None) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` [N, V] (any dtype) against ``targets`` [N] over all N
    rows (ignored targets count in the mean, as `F.cross_entropy` over a sum / N would), in
    fp32 by row chunks (`_ChunkedCE`): autograd keeps one [N, V] gradient in the logits' dtype
    (bf16: 2 bytes x N x V), not fp32 log-probabilities (4 bytes x N x V: 2 GiB at 16,384 tokens
    x 32,000), and the fp32 temporaries are one chunk's.

    ``kernel``: an attached loss kernel (`kernels.LossKernel`, checked against `_ChunkedCE`; the
    same semantics, one [N, V] gradient kept), used when it serves these logits (the vocabulary
    and dtype it was checked at)."""
    if kernel is not None and kernel.serves(logits):
        return kernel(logits, targets)
    return _ChunkedCE.apply(logits, targets, targets.numel())


def _world_sum(values: list[float], layout: Layout, device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if layout.distributed:
        dist.all_reduce(t)
    return t.tolist()


def run(cfg: TrainConfig, role: str) -> None:
    from onboarding.train import data as D
    from onboarding.train.flops import peak_flops, step_flops
    from onboarding.train.lm import baseline_label, lm_facts
    from onboarding.train.lora import lora_parameters
    from onboarding.train.setup import build

    layout, device = _init(role, cfg)
    built = build(cfg, device=device)
    cfg.validate(n_experts=built.n_experts)
    model, graph = built.model, built.graph
    baseline = baseline_label(model)  # what the baseline role runs: its rows and log say it
    torch.manual_seed(cfg.seed)

    t_prepare = time.perf_counter()
    ep_mods, patches, attached = prepare(cfg, role, built, layout, device)
    if layout.rank == 0:  # where a run's minutes before step 1 go (a 4B proxy: about a minute)
        parts = {**built.seconds, "adapters and kernel checks": time.perf_counter() - t_prepare}
        print("set-up: " + ", ".join(f"{k} {v:.1f} s" for k, v in parts.items()), flush=True)
    aux_coef, bias_rate = balancing(cfg, model, graph, ep_mods) if role != "baseline" \
        else (0.0, 0.0)
    taps = RouterTaps(model, graph) if aux_coef > 0 else None
    blocks = decoder_blocks(model, graph)
    apply_recompute(model, graph, blocks, cfg.recompute_mode)
    shard(model, layout, blocks, ep_mods)
    if device.type == "cuda" and cfg.init_device == "device":
        # the fp32 build on the GPU is set-up, not training memory: the peak counts from here
        torch.cuda.reset_peak_memory_stats(device)
    model.train()
    # compile = "blocks": each decoder layer compiled after the first (eager) step, inside
    # recompute and FSDP2 (`onboarding.train.compile`); the baseline stays as users run it
    compiling = cfg.compile == "blocks" and role != "baseline"
    compiled = None
    if layout.rank == 0:
        print(f"compile: {_compile_note(cfg, role, len(blocks), baseline)}", flush=True)

    params = lora_parameters(model) if role != "baseline" else \
        [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    expert_ids = {id(p) for m in ep_mods for p in m.lora_parameters()}
    dense = [p for _, p in params if id(p) not in expert_ids]
    experts = [p for _, p in params if id(p) in expert_ids]
    opt = _adamw([p for _, p in params], cfg, fused=device.type == "cuda" and not layout.distributed)

    out = Path(cfg.out) / "train"
    ckpt = Checkpointer(f"{cfg.ckpt_root.rstrip('/')}/{role}", layout,
                        interval=cfg.checkpoint_interval)
    start = 0
    # bias balancing moves the routers' score biases each step: they are training state too
    balance_state = {f"score_bias/{p}": t for p, t in score_bias_tensors(
        model, graph, ep_mods[0].n_experts).items()} if ep_mods else {}
    latest = ckpt.latest() if cfg.checkpoint_interval > 0 else None
    if latest is not None:
        start = ckpt.load(latest, params, expert_ids, opt, balance_state)
        if layout.rank == 0:
            print(f"resumed from {latest} (step {start})", flush=True)
    writer = M.JsonlWriter(out / f"{role}.jsonl", resume_step=start, enabled=layout.rank == 0)
    board = M.TensorBoard(out / "tb" / role) if layout.rank == 0 else None
    alerts = Alerts(out, rank=layout.rank, stall_timeout=cfg.stall_timeout,
                    webhook=cfg.alert_webhook, run=f"{cfg.out} ({role})")

    tok = D.load_tokenizer(built.tokenizer_dir, lm_facts(model).vocab_size)
    packed = D.PackedData(D.load_texts(cfg.data), tok, cfg.seq_len, cfg.seed)
    n_rows = cfg.global_batch
    lo, hi = layout.rank * cfg.micro_batch, (layout.rank + 1) * cfg.micro_batch
    local_rows = n_rows if role == "reference" else cfg.micro_batch
    peak = peak_flops(device)
    world_group = layout.dense_mesh.get_group() if layout.distributed else None
    paths = [m.path for m in ep_mods]

    alerts.start()  # the stall clock runs from here: the first step's set-up counts too
    peaks = M.StepPeaks(device)
    for step in range(start + 1, cfg.steps + 1):
        rows = packed.global_batch(step - 1, n_rows)
        ids = (rows if role == "reference" else rows[lo:hi]).to(device)
        prof = M.profiler(device) if cfg.profile_every and step % cfg.profile_every == 0 \
            else None
        if device.type == "cuda":
            torch.cuda.synchronize()
        peaks.start()  # each row's peak is its own step's (the run's goes in run_peak_mem_bytes)
        t0 = time.perf_counter()
        if prof is not None:
            prof.__enter__()
        phase = M.phases(prof is not None, model, graph,
                         skip=tuple(compiled.paths) if compiled is not None else ())
        measure = step_context(step) if step_context is not None else contextlib.nullcontext()
        measure.__enter__()
        for g in opt.param_groups:
            g["lr"] = _lr(cfg, step)
        with failures_named(step) if compiled is not None else contextlib.nullcontext():
            with phase("forward"):
                ce = lm_loss(model, ids, chunked=role != "baseline")
                loss = ce
                aux = aux_loss(taps, ep_mods, world_group) if taps is not None else None
                if aux is not None:
                    loss = ce + aux_coef * aux
            _maybe_stall(step)
            with phase("backward"):
                loss.backward()
        with phase("optimizer"):
            finish_expert_grads(experts, layout)
            gnorm = clip_grads(dense, experts, layout, cfg.grad_clip)  # a device tensor: read below
            opt.step()
            opt.zero_grad(set_to_none=True)
        counts = global_counts(ep_mods, world_group) if ep_mods else None
        if counts is not None and bias_rate > 0:
            update_score_bias(model, graph, counts, bias_rate)
        measure.__exit__(None, None, None)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if prof is not None:
            prof.__exit__(None, None, None)
        tokens = local_rows * layout.world * cfg.seq_len
        step_peak, run_peak = peaks.step()
        row = {"step": step, "loss": _world_mean(loss, layout), "ce": _world_mean(ce, layout),
               "aux": _world_mean(aux, layout) if aux is not None else None,
               "grad_norm": float(gnorm), "lr": _lr(cfg, step), "tokens": tokens,
               "step_time_s": dt, "tokens_per_s": tokens / dt,
               "peak_mem_bytes": step_peak, "run_peak_mem_bytes": run_peak}
        if role == "baseline":
            row["runs"] = baseline  # what ran, for the report (`report.baseline_runs`)
        routed = int(counts.sum()) if counts is not None else None
        flops = step_flops(graph, model, tokens=tokens, seq_len=cfg.seq_len,
                           lora_rank=cfg.lora_rank, expert_lora=cfg.expert_lora,
                           routed_tokens=routed)
        row["mfu"] = flops["total"] / dt / (peak * layout.world) if peak else None
        if prof is not None:
            a2a = M.a2a_from_profile(prof)
            row.update(a2a_ms=a2a["a2a_ms"], a2a_share=a2a["a2a_ms"] / 1e3 / dt,
                       a2a_exposed_share=a2a["a2a_exposed_ms"] / 1e3 / dt)
            if layout.rank == 0:
                M.write_breakdown(out / f"profile_{role}_step{step}.json", prof, dt)
        if counts is not None:
            row["expert_load"] = M.expert_load(counts, paths)
            loads = [x["max_over_mean"] for x in row["expert_load"] if x["max_over_mean"]]
            row["expert_imbalance"] = max(loads) if loads else None
            dropped = _world_sum([m.last_dropped for m in ep_mods], layout, device)
            row["dropped_tokens"] = int(sum(dropped)) if cfg.capacity_factor is not None else None
            row["dropped_share"] = sum(dropped) / routed if routed and \
                cfg.capacity_factor is not None else None
            if cfg.capacity_factor is not None:
                row["dropped_by_layer"] = [int(x) for x in dropped]
        row["compile"] = "blocks" if compiled is not None else \
            ("eager warm-up" if compiling else "none")
        if compiled is not None:
            row["compile_stats"] = compile_stats()
        if patches is not None and step == start + 1:  # patches calibrate on the first call
            from onboarding.train.kernels import summary

            row["kernels"] = {**summary(patches), **attached}
            # why a patch fell back to the model's torch path (its calibration's verdict)
            row["kernels_rejected"] = {r.path: r.detail for r in patches.records
                                       if r.status == "rejected"}
        writer.write(row)
        if board is not None:
            board.write(row)
        if layout.rank == 0:
            print(f"step {step} loss {row['loss']:.6f} {row['tokens_per_s']:.0f} tok/s"
                  + (f" dropped {row['dropped_tokens']}" if row.get("dropped_tokens") is not None
                     else ""), flush=True)
        alerts.check_loss(step, row["loss"])  # before the checkpoint: the last one stays finite
        alerts.progress(step)
        if ckpt.due(step):
            ckpt.save(step, params, expert_ids, opt, balance_state)
            alerts.progress(step)  # a slow save (object storage) is not a stalled step
        _maybe_kill(layout, step)
        if compiling and compiled is None:  # after the first step: every patch has calibrated
            compiled = compile_blocks(blocks, patches=patches)
            if layout.rank == 0:
                print(f"compile: blocks: torch.compile of {len(compiled.paths)} decoder layers "
                      f"from step {step + 1} on (step {step} ran eagerly)", flush=True)

    alerts.stop()
    if compiled is not None:  # the export's probe runs at another length: the eager model
        compiled.restore()
    # the run that trained (one process: the reference) exports, unless it only measures (a sweep)
    if cfg.export and (role == "parallel" or (role == "reference" and cfg.nproc == 1)):
        from onboarding.train.peft_export import PROBE_TOKENS, export_run

        export_run(model, graph, cfg, ep_mods,
                   packed.global_batch(0, 1)[:, :PROBE_TOKENS].to(device), out)


def _compile_note(cfg: TrainConfig, role: str, n_blocks: int, baseline: str) -> str:
    """The run log's line on `compile` (which mode runs); ``baseline``: what the baseline runs
    (`lm.baseline_label`)."""
    if cfg.compile != "blocks":
        return "none (eager)"
    if role == "baseline":
        return f"none (eager; compile = blocks applies to ours, not to the {baseline} baseline)"
    return (f"blocks (torch.compile of each of the {n_blocks} decoder layers from the second "
            "step on; the first step runs eagerly while kernel patches calibrate; a compile "
            "failure stops the run)")


def _peft(model, graph, cfg: TrainConfig) -> None:
    """The baseline's adapters: PEFT's own LoRA on the same target linears (in place)."""
    from peft import LoraConfig, inject_adapter_in_model

    from onboarding.train.lora import resolve_targets

    targets = resolve_targets(model, graph, cfg.lora_targets)
    inject_adapter_in_model(LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                                       lora_dropout=cfg.lora_dropout, target_modules=targets),
                            model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
        if p.requires_grad:
            p.data = p.data.float()  # adapters in fp32, as ours


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m onboarding.train.worker")
    ap.add_argument("--config", required=True, help="train.toml")
    ap.add_argument("--role", choices=("reference", "parallel", "baseline"), default="parallel")
    args = ap.parse_args(argv)
    hide_kernel_packages()  # every role runs the model's torch path plus onboard's kernels
    cfg = None
    try:
        cfg = TrainConfig.from_toml(args.config)
        run(cfg, args.role)
    except (InputError, CompileFailed) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        os._exit(exc.exit_code)
    except (RuntimeError, TypeError) as exc:  # the model's own code failing in bf16 is named
        from onboarding.train.dtype_safety import dtype_failure

        note = dtype_failure(exc, cfg.dtype, args.role) if cfg is not None else None
        if note is None:
            raise
        traceback.print_exc()
        print(f"error: {note}", file=sys.stderr, flush=True)
        os._exit(EXIT_BAD_INPUT)
    if dist.is_initialized():
        dist.barrier()  # then skip interpreter teardown (docs/design.md: torchrun shutdown aborts)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
