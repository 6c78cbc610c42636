"""Tile space shared by the families whose kernels are tiled matrix products (LoRA, experts)."""

GEMM_TUNING_SPACE = {
    "BLOCK_M": (16, 32, 64, 128),
    "BLOCK_N": (16, 32, 64, 128, 256),
    "BLOCK_K": (16, 32, 64, 128),
    "num_warps": (2, 4, 8),
    "num_stages": (1, 2, 3, 4),
    "dot_precision": ("tf32", "ieee"),
}
GEMM_DEFAULT_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4,
                       "num_stages": 3, "dot_precision": "tf32"}
