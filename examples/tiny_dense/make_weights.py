"""Regenerate `model.safetensors` for the `tiny_dense` example: a seeded random init.

Run from anywhere: `python examples/tiny_dense/make_weights.py`. The weights carry no training;
they exist so that the loader's weight-loading path (`from_pretrained`) can be tested offline.
"""

import argparse
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

HERE = Path(__file__).resolve().parent


def build_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """The model's state dict after `torch.manual_seed(seed)` and the model's own init."""
    config = AutoConfig.from_pretrained(HERE, trust_remote_code=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True, dtype=torch.float32)
    return {name: t.detach().contiguous() for name, t in model.state_dict().items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE / "model.safetensors")
    args = parser.parse_args()
    state = build_state_dict(args.seed)
    save_file(state, str(args.out), metadata={"format": "pt", "seed": str(args.seed)})
    n_params = sum(t.numel() for t in state.values())
    print(f"wrote {args.out} ({n_params} parameters, {args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
