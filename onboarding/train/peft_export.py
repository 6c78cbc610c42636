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
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from onboarding.errors import InputError
from onboarding.train.config import TrainConfig
from onboarding.train.lora import LoRALinear, adapter_modules

# Path segments that wrappers (activation checkpointing, compile) insert into module paths.
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod")
PEFT_PREFIX = "base_model.model."


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


def export_peft(model: nn.Module, cfg: TrainConfig, out_dir: Path, *,
                base_model_name_or_path: str) -> Path:
    """Write the adapters of ``model`` to ``out_dir`` in PEFT's format; returns ``out_dir``.

    Call on every rank when parameters are sharded (gathering is collective); rank 0 writes.
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
                        task_type="CAUSAL_LM",
                        base_model_name_or_path=base_model_name_or_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out_dir))
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out_dir / "onboard_adapter.json").write_text(json.dumps({
        "model": cfg.model, "overrides": cfg.overrides, "proxy": cfg.proxy, "seed": cfg.seed,
        "lora_dropout_trained": cfg.lora_dropout, "n_tensors": len(tensors),
        "target_modules": len(modules), "target_parameters": len(params)}, indent=1) + "\n")
    return out_dir
