"""The train stage: FSDP2 + expert-parallel LoRA training of a model's proxy, checked against a
single-process reference (``onboard train``)."""

from onboarding.train.config import TrainConfig
from onboarding.train.data import (ByteTokenizer, PackedData, Tokenizer, load_texts,
                                      load_tokenizer)
from onboarding.train.flops import peak_flops, step_flops
from onboarding.train.lora import LoRALinear, default_targets, inject_lora, lora_parameters
from onboarding.train.peft_export import export_peft
from onboarding.train.setup import Built, build

__all__ = ["Built", "ByteTokenizer", "LoRALinear", "PackedData", "Tokenizer", "TrainConfig",
           "build", "default_targets", "export_peft", "inject_lora", "load_texts",
           "load_tokenizer", "lora_parameters", "peak_flops", "step_flops"]
