"""Tile space shared by the families whose kernels are tiled matrix products (LoRA, experts)."""

GEMM_TUNING_SPACE = {
    "BLOCK_M": (16, 32, 64, 128),
    "BLOCK_N": (16, 32, 64, 128, 256),
    "BLOCK_K": (16, 32, 64, 128),
    "num_warps": (2, 4, 8),
    "num_stages": (1, 2, 3, 4),
    "dot_precision": ("tf32", "ieee"),
}
# BLOCK_K 64: bf16 inputs dot on 16-bit tensor cores on the GPU (the kernels' `_dot_mode`), whose
# k16 instructions like deep K steps; fp32 operands are capped at BLOCK_K 32 by the kernels (twice
# the shared memory per stage). `dot_precision` applies to fp32 inputs only.
GEMM_DEFAULT_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4,
                       "num_stages": 3, "dot_precision": "tf32"}
