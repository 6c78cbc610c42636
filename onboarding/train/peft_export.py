"""Export trained adapters in PEFT's LoRA format (``adapter_config.json`` +
``adapter_model.safetensors``), loadable with ``peft.PeftModel.from_pretrained`` onto the
transformers model of the same repo.

Key layout (checked against peft 0.21): a LoRA on the linear at ``<path>`` is stored as
``base_model.model.<path>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]``.

Expert adapters use PEFT's ``target_parameters`` LoRA (``lora.ParamWrapper``), which does hold a
separate A/B per expert of a packed 3-D parameter ``W_EOI`` (``[experts, out, in]``): A is stored as
``[E * r, in]`` (expert-major rows) and B as ``[out, r * E]`` (rank-major columns, i.e. B_ORE
flattened). When several parameters of one module are targeted PEFT nests its wrappers in the
module's parameter order, the first innermost: its keys carry one ``.base_layer`` per later
targeted parameter. `expert_lora_tensors` builds exactly that, for the expert module to call from
its ``peft_tensors``. PEFT's ParamWrapper refuses ``lora_dropout != 0``; dropout does nothing at
inference, so the exported config states 0 when expert adapters are present.

The base the adapters trained on is usually a seeded proxy that exists nowhere else, so
`export_run` also saves it (``train/base/``, ``save_pretrained`` with the model's code) and names
it in ``base_model_name_or_path``: ``AutoPeftModelForCausalLM.from_pretrained(adapter_dir,
trust_remote_code=True)`` then loads base and adapters in one call. ``task_type`` is CAUSAL_LM
only for a model that can generate (PEFT's causal-LM wrapper needs GenerationMixin); other
models get none, which plain ``PeftModel.from_pretrained`` loads. ``onboard_probe.safetensors``
holds a few tokens and the trained model's logits on them, to check a load against.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from onboarding.errors import InputError
from onboarding.train.config import TrainConfig
from onboarding.train.lm import lm_logits
from onboarding.train.lora import LoRALinear, adapter_modules

# Path segments that wrappers (activation checkpointing, compile) insert into module paths.
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod")
PEFT_PREFIX = "base_model.model."
PROBE_FILE = "onboard_probe.safetensors"
PROBE_TOKENS = 16  # the probe's logits are [1, 16, vocab]: small even for a 200k vocabulary


def clean_path(path: str) -> str:
    return ".".join(p for p in path.split(".") if p not in WRAPPER_SEGMENTS)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A plain CPU fp32 copy; a sharded DTensor is gathered (a collective: call on every rank)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().to("cpu", torch.float32).contiguous()


def expert_lora_tensors(prefix: str, adapters: list[tuple[str, torch.Tensor, torch.Tensor]]
                        ) -> dict[str, torch.Tensor]:
    """PEFT tensors for per-expert adapters of one module's packed expert parameters.

    ``adapters``: ``(param_name, A_ERI, B_EOR)`` in the module's parameter registration order,
    A ``[experts, r, in]`` and B ``[experts, out, r]`` with ``delta W_e = scaling * B_e @ A_e``
    for a parameter laid out ``[experts, out, in]``.
    """
    out: dict[str, torch.Tensor] = {}
    k = len(adapters)
    for i, (name, a_eri, b_eor) in enumerate(adapters):
        a_eri, b_eor = full_tensor(a_eri), full_tensor(b_eor)
        if a_eri.ndim != 3 or b_eor.ndim != 3 or a_eri.shape[:2] != (b_eor.shape[0],
                                                                     b_eor.shape[2]):
            raise ValueError(f"{prefix}.{name}: expected A [E, r, in] and B [E, out, r], got "
                             f"{tuple(a_eri.shape)} and {tuple(b_eor.shape)}")
        e, r, n_in = a_eri.shape
        key = prefix + ".base_layer" * (k - 1 - i)
        out[f"{key}.lora_A.weight"] = a_eri.reshape(e * r, n_in).contiguous()
        out[f"{key}.lora_B.weight"] = b_eor.permute(1, 2, 0).reshape(b_eor.shape[1],
                                                                     r * e).contiguous()
    return out


def _is_writer() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def collect(model: nn.Module, cfg: TrainConfig) -> tuple[dict[str, torch.Tensor], list[str],
                                                         list[str]]:
    """(PEFT tensors, target module paths, target parameter paths) of every adapter in ``model``."""
    tensors: dict[str, torch.Tensor] = {}
    modules, params = [], []
    for raw, mod in adapter_modules(model).items():
        path = clean_path(raw)
        prefix = PEFT_PREFIX + path
        if isinstance(mod, LoRALinear):
            if mod.rank != cfg.lora_rank or mod.alpha != cfg.lora_alpha:
                raise InputError(f"{path}: adapter rank/alpha {mod.rank}/{mod.alpha} differ from "
                                 f"the config's {cfg.lora_rank}/{cfg.lora_alpha}")
            tensors[f"{prefix}.lora_A.weight"] = full_tensor(mod.lora_A.weight)
            tensors[f"{prefix}.lora_B.weight"] = full_tensor(mod.lora_B.weight)
            modules.append(path)
        else:
            target = mod.peft_target()
            names = target.get("target_parameters") or []
            if not names:
                continue  # an expert module without adapters (expert_lora off)
            tensors.update(mod.peft_tensors(prefix))
            params += [f"{path}.{n}" for n in names]
    return tensors, modules, params


def can_generate(model: nn.Module) -> bool:
    """Whether PEFT's causal-LM wrapper can hold ``model`` (it calls the GenerationMixin API)."""
    return callable(getattr(model, "prepare_inputs_for_generation", None))


def export_peft(model: nn.Module, cfg: TrainConfig, out_dir: Path, *,
                base_model_name_or_path: str, base: dict | None = None) -> Path:
    """Write the adapters of ``model`` to ``out_dir`` in PEFT's format; returns ``out_dir``.

    Call on every rank when parameters are sharded (gathering is collective); rank 0 writes.
    ``base``: how the base model was saved (recorded in ``onboard_adapter.json``).
    """
    from peft import LoraConfig
    from safetensors.torch import save_file

    tensors, modules, params = collect(model, cfg)
    if not tensors:
        raise InputError("export_peft: the model has no LoRA adapters (inject_lora first)")
    if cfg.expert_lora and not params:
        raise InputError("expert_lora=true but no expert module exposes peft_tensors(); "
                         "the expert adapters cannot be exported")
    out_dir = Path(out_dir)
    if not _is_writer():
        return out_dir
    config = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                        lora_dropout=0.0 if params else cfg.lora_dropout,
                        target_modules=sorted(modules) or None,
                        target_parameters=sorted(params) or None, bias="none",
                        task_type="CAUSAL_LM" if can_generate(model) else None,
                        base_model_name_or_path=base_model_name_or_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out_dir))
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out_dir / "onboard_adapter.json").write_text(json.dumps({
        "model": cfg.model, "overrides": cfg.overrides, "proxy": cfg.proxy, "seed": cfg.seed,
        "lora_dropout_trained": cfg.lora_dropout, "n_tensors": len(tensors),
        "target_modules": len(modules), "target_parameters": len(params),
        "task_type": config.task_type, "base": base}, indent=1) + "\n")
    return out_dir


def changed_state(model: nn.Module, graph) -> dict[str, torch.Tensor]:
    """Tensors outside the adapters that training moves: the score-correction biases of routers
    with aux-loss-free balancing (`moe_ep.update_score_bias`), full, by clean module path. The
    saved base needs them for the adapters to give the trained model's logits. Collective when
    sharded: call on every rank."""
    routers = {b.path for b in graph.by_kind("moe.router") if b.attrs.get("score_bias")}
    out: dict[str, torch.Tensor] = {}
    for raw, mod in model.named_modules():
        path = clean_path(raw)
        if path not in routers:
            continue
        for name, t in (*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)):
            if t.ndim == 1:
                out[f"{path}.{name}"] = full_tensor(t)
    return out


@torch.no_grad()
def probe_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits on ``ids`` in eval mode (no dropout), fp32 on the CPU. Collective when
    sharded: every rank passes the same ids."""
    was = model.training
    model.eval()
    try:
        logits = lm_logits(model, ids)
    finally:
        model.train(was)
    return full_tensor(logits)


def save_base(cfg: TrainConfig, changed: dict[str, torch.Tensor], out_dir: Path
              ) -> tuple[str, dict]:
    """Save the base the adapters trained on; returns (``base_model_name_or_path``, a record).

    The repo itself when its own weights trained unchanged; else the rebuilt base (same seed,
    same dtype, trained biases applied) with ``save_pretrained``, which copies remote code too.
    A model that is not a transformers model cannot be saved so: the record says how to rebuild.
    """
    from onboarding.dtypes import as_dtype
    from onboarding.load.model import EXAMPLES_DIR
    from onboarding.train.setup import _uses_weights, base_model, cast_parameters, model_info

    info = model_info(cfg)
    lm = info.loaded
    rebuild = ("onboarding.train.setup.build(TrainConfig.from_toml('train.toml')).model "
               "rebuilds it (same seed, same weights)")
    if not lm.is_hf:
        return cfg.model, {"saved": False, "why": "not a transformers model (no save_pretrained "
                           "config)", "rebuild": rebuild}
    repo = {"directory": Path(lm.ref), "example": EXAMPLES_DIR / lm.ref}.get(lm.source)
    if repo is not None and not changed and _uses_weights(info):
        return str(repo.resolve()), {"saved": False, "why": "the repo's own weights trained"}
    model = base_model(cfg, info)
    with torch.no_grad():
        for name, t in changed.items():
            target = model.get_parameter(name) if name in dict(model.named_parameters()) \
                else model.get_buffer(name)
            target.copy_(t)
    cast_parameters(model, as_dtype(cfg.dtype))
    model.cpu()  # built on the training device under init_device = "device": saved from the CPU
    out_dir = Path(out_dir)
    try:
        model.save_pretrained(str(out_dir))
    except Exception as exc:  # a model class transformers cannot save: say so, keep the adapters
        return cfg.model, {"saved": False, "why": f"save_pretrained failed: "
                           f"{type(exc).__name__}: {exc}".splitlines()[0], "rebuild": rebuild}
    return str(out_dir.resolve()), {"saved": True, "dir": str(out_dir.resolve()),
                                    "trust_remote_code": lm.trust_remote_code,
                                    "changed": sorted(changed)}


def export_run(model: nn.Module, graph, cfg: TrainConfig, ep_mods: list, ids: torch.Tensor,
               train_dir: Path) -> Path:
    """After training: the probe logits, the base (``train_dir/base``) and the adapters
    (``train_dir/adapter``). Call on every rank; rank 0 writes."""
    from safetensors.torch import save_file

    logits = probe_logits(model, ids)
    changed = changed_state(model, graph)
    for m in ep_mods:
        m.gather_lora()
    name, record = (save_base(cfg, changed, Path(train_dir) / "base") if _is_writer()
                    else (cfg.model, None))
    out = export_peft(model, cfg, Path(train_dir) / "adapter", base_model_name_or_path=name,
                      base=record)
    if _is_writer():
        save_file({"input_ids": ids.detach().cpu().contiguous(), "logits": logits},
                  str(out / PROBE_FILE), metadata={"dtype": cfg.dtype})
    return out
