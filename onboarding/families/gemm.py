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

# Backward tile keys, one per forward key: families whose backward GEMMs have other shapes (the
# experts' weight gradients reduce over rows, not over D or F) tune them separately. The backward
# kernels read only these; the forward kernels only the forward keys. `dot_precision` is shared.
GEMM_BWD_KEYS = {"BLOCK_M": "BWD_BLOCK_M", "BLOCK_N": "BWD_BLOCK_N", "BLOCK_K": "BWD_BLOCK_K",
                 "num_warps": "bwd_warps", "num_stages": "bwd_stages"}
GEMM_FWD_BWD_TUNING_SPACE = {**GEMM_TUNING_SPACE,
                             **{bwd: GEMM_TUNING_SPACE[fwd] for fwd, bwd in GEMM_BWD_KEYS.items()}}
GEMM_FWD_BWD_DEFAULT_CONFIG = {**GEMM_DEFAULT_CONFIG,
                               **{bwd: GEMM_DEFAULT_CONFIG[fwd] for fwd, bwd in GEMM_BWD_KEYS.items()}}


def split_tiles(forward: dict, backward: dict) -> dict:
    """One bucket config from forward tiles (BLOCK_M, ..., num_stages) and backward tiles given
    under the same forward names (so both read alike), e.g. split_tiles({"BLOCK_M": 128}, {"BLOCK_M": 64})."""
    bad = sorted(set(forward) - set(GEMM_TUNING_SPACE)) + sorted(set(backward) - set(GEMM_BWD_KEYS))
    if bad:
        raise ValueError(f"split_tiles: unknown tile key(s) {bad}")
    return {**forward, **{GEMM_BWD_KEYS[k]: v for k, v in backward.items()}}
