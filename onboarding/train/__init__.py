"""The train stage: FSDP2 + expert-parallel LoRA training of a model's proxy, checked against a
single-process reference (``onboard train``).

The names below are imported at first use (`onboarding.lazy`): `onboard train --help` reads
`train.config` without torch."""

from onboarding.lazy import lazy_exports

_EXPORTS = {
    "onboarding.train.config": ["TrainConfig"],
    "onboarding.train.data": ["ByteTokenizer", "PackedData", "Tokenizer", "load_texts",
                              "load_tokenizer"],
    "onboarding.train.flops": ["peak_flops", "step_flops"],
    "onboarding.train.lora": ["LoRALinear", "default_targets", "inject_lora", "lora_parameters"],
    "onboarding.train.peft_export": ["export_peft"],
    "onboarding.train.setup": ["Built", "build"]}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(name for names in _EXPORTS.values() for name in names)
