"""Build the model that trains: the proxy (or full config) of MODEL, deterministic from the seed.

Every process (each rank and the single-process reference) calls `build` with the same config
and gets bit-identical base weights, so the parallel run and the reference start equal.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from onboarding.load.accounting import count_parameters, find_moe
from onboarding.dtypes import as_dtype
from onboarding.errors import InputError
from onboarding.load.model import LoadedModel
from onboarding.graph.opgraph import OpGraph
from onboarding.graph.parse import ModelInfo, load_stage, load_weights, parse_stage
from onboarding.train.config import TrainConfig

PARSE_SEQ = 64  # the op graph is shape-generic enough at a short sequence (and export is fast)
TOKENIZER_FILES = ("tokenizer.json",)


@dataclass
class Built:
    model: nn.Module
    graph: OpGraph
    info: ModelInfo
    n_experts: int | None
    tokenizer_dir: Path | None
    seconds: dict[str, float] = field(default_factory=dict)  # wall time of each set-up part: weights, graph, cast and move


def resolve_device(cfg: TrainConfig) -> torch.device:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise InputError("device='cuda': no CUDA device is available here")
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def model_info(cfg: TrainConfig, loaded: LoadedModel | None = None) -> ModelInfo:
    """Load MODEL and choose the config that trains (``proxy="none"``: the full config)."""
    loaded = loaded or cfg.model_spec.load()
    if cfg.proxy != "none":
        return load_stage(loaded, cfg.proxy)
    from onboarding.load.multimodal import account

    full = account(loaded.build(device="meta", seed=None), loaded.config)
    return ModelInfo(loaded=loaded, full=full, proxy_config=copy.deepcopy(loaded.config),
                     proxy_note=f"full size ({full.total:,} parameters): proxy none",
                     proxy_size="none")


def routed_experts(model: nn.Module, config=None) -> int | None:
    """Routed experts per MoE block (None without MoE); structural, via `find_moe`."""
    counts = {m.n_experts for m in find_moe(model, config) if m.router_path is not None}
    if not counts:
        return None
    if len(counts) > 1:
        raise InputError(f"MoE blocks have different expert counts {sorted(counts)}; expert "
                         "parallelism needs one count")
    return counts.pop()


def _uses_weights(info: ModelInfo) -> bool:
    return bool(info.loaded.weights) and info.proxy_note.startswith("full size")


def _graph(cfg: TrainConfig, info: ModelInfo, model: nn.Module) -> OpGraph:
    path = Path(cfg.out) / "opgraph.json" if cfg.out else None
    if path is not None and path.is_file():
        try:
            graph = OpGraph.load(path)
        except (ValueError, KeyError, TypeError):
            graph = None
        if graph is not None and _graph_matches(graph, info, model):
            return graph
    if next(model.parameters(), torch.empty(0)).device.type != "cpu":
        model.cpu()  # built on the training device (`init_device`): captured on the CPU
    graph = parse_stage(info, seq=PARSE_SEQ, seed=cfg.seed, model=model)  # fp32, CPU: as it builds
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Several ranks may get here at once: write privately, then rename atomically.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        graph.save(tmp)
        tmp.replace(path)
    return graph


def _graph_matches(graph: OpGraph, info: ModelInfo, model: nn.Module) -> bool:
    proxy = graph.param_counts.get("proxy", {})
    modules = dict(model.named_modules())
    return (graph.model == info.loaded.name
            and proxy.get("total") == count_parameters(model, info.proxy_config).total
            and all(b.path in modules for b in graph.blocks if b.path))


def tokenizer_dir(info: ModelInfo) -> Path | None:
    """The model directory when it ships a tokenizer the `tokenizers` library reads."""
    from onboarding.load.model import EXAMPLES_DIR

    lm = info.loaded
    d = {"directory": Path(lm.ref), "example": EXAMPLES_DIR / lm.ref}.get(lm.source)
    return d if d is not None and any((d / f).is_file() for f in TOKENIZER_FILES) else None


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast floating parameters to ``dtype`` as transformers' loading does: buffers (rotary
    frequencies) keep their dtype, and parameters the model class keeps in fp32 for bf16
    (``_keep_in_fp32_modules_strict``, e.g. router weights and score biases) stay fp32."""
    keep = [str(k) for k in getattr(model, "_keep_in_fp32_modules_strict", None) or []] \
        if dtype == torch.bfloat16 else []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_floating_point() and p.dtype != dtype and not any(k in name for k in keep):
                p.data = p.data.to(dtype)


def init_device(cfg: TrainConfig, device: torch.device | str | None = None) -> torch.device:
    """Where ``cfg``'s base weights are made (`TrainConfig.init_device`): the CPU (the same
    weights on every machine), or the training device (``device``; None: `resolve_device`, the
    current CUDA device there). torch's CPU generator fills each tensor on one thread (a
    1.38 B-parameter build took 20 s on this project's 2-core CI machine, `normal_` most of it);
    a CUDA build takes seconds and gives the same weights on every GPU of one kind, not the
    CPU's. Every role, rank and rebuild of a run (the baseline, resume, the exported base) reads
    the same config, so all make the same weights."""
    if cfg.init_device != "device":
        return torch.device("cpu")
    return torch.device(device) if device is not None else resolve_device(cfg)


def base_model(cfg: TrainConfig, info: ModelInfo, device: torch.device | str | None = None
               ) -> nn.Module:
    """The base weights that train, in fp32 on `init_device`: built from ``cfg.seed`` (the same
    in every process and every call), the repo's weights loaded when they fit the trained
    config."""
    model = info.loaded.build(info.proxy_config, device=init_device(cfg, device),
                              seed=cfg.seed).float()
    if _uses_weights(info):
        load_weights(model, info.loaded.weights)
    return model


def build(cfg: TrainConfig, *, device: torch.device | str = "cpu") -> Built:
    """The model to train on ``device`` with base weights in ``cfg.dtype``, its op graph and facts.

    Weights are built in fp32 on `init_device` from ``cfg.seed`` (identical in every process),
    the repo's real weights are loaded when they fit the trained config, then cast and moved.
    """
    t = [time.perf_counter()]

    def lap() -> float:
        t.append(time.perf_counter())
        return round(t[-1] - t[-2], 1)

    info = model_info(cfg)
    model = base_model(cfg, info, device)
    seconds = {"weights": lap()}
    graph = _graph(cfg, info, model)
    seconds["graph"] = lap()
    n_experts = routed_experts(model, info.proxy_config)
    cast_parameters(model, as_dtype(cfg.dtype))
    model = model.to(device=device)
    seconds["cast and move"] = lap()
    return Built(model=model, graph=graph, info=info, n_experts=n_experts,
                 tokenizer_dir=tokenizer_dir(info), seconds=seconds)
