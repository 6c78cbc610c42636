"""Shared by the gated-delta device diagnostics (gdn_diag.py, gdn_slice.py): our chunk module
rendered from the template, fla's chunk function when importable, and the 4B Qwen3-Next-style
proxy of issue 34 (transformers' init, seed 0, bf16; `small` shrinks it for a CPU smoke run)."""
import tempfile
from pathlib import Path

import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from onboarding.families import family_module
from onboarding.generate import templating


def our_module():
    src = templating.render(family_module("gated_delta").FAMILY, "chunk", {"chunk_size": 64})
    return templating.load_module(templating.write_module(src, Path(tempfile.mkdtemp()) / "gd" / "chunk.py"))


def fla_chunk():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        return chunk_gated_delta_rule
    except Exception as e:  # noqa: BLE001
        print("fla absent:", type(e).__name__)
        return None


def proxy(dev: torch.device, small: bool = False) -> Qwen3NextForCausalLM:
    cfg = Qwen3NextConfig(vocab_size=32000, hidden_size=2048, num_hidden_layers=12, num_attention_heads=16,
                          num_key_value_heads=2, head_dim=128, linear_num_key_heads=16,
                          linear_num_value_heads=32, linear_key_head_dim=64, linear_value_head_dim=64,
                          shared_expert_intermediate_size=768, num_experts=64, num_experts_per_tok=8,
                          moe_intermediate_size=768, intermediate_size=6144, decoder_sparse_step=1)
    if small:
        cfg.num_hidden_layers, cfg.hidden_size, cfg.num_experts, cfg.vocab_size = 4, 256, 4, 512
        cfg.num_experts_per_tok, cfg.layer_types = 2, cfg.layer_types[:4]
    torch.manual_seed(0)
    with dev:
        return Qwen3NextForCausalLM(cfg).to(torch.bfloat16).eval()
