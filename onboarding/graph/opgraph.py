"""The operator graph: classified blocks of a captured model, and its JSON form.

The schema is documented in docs/opgraph.md; bump `SCHEMA_VERSION` on any incompatible change.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1

# The stable block vocabulary (docs/opgraph.md). Classification never emits a kind outside this set.
BLOCK_KINDS = (
    "attention.full",
    "attention.gated",
    "attention.sliding",
    "attention.mla",
    "attention.compressed",
    "sparse_attention.topk",
    "linear_attention.gated_delta",
    "linear_attention.kimi_delta",
    "linear_attention.mamba",
    "linear_attention.other",
    "moe.router",
    "moe.experts",
    "moe.shared_expert",
    "mlp.dense",
    "norm.rms",
    "norm.rms_gated",
    "norm.layer",
    "conv.causal1d",
    "conv.noncausal1d",
    "conv.gated",
    "residual.low_rank",
    "residual.streams",
    "residual.input_gate",
    "residual.depth_attention",
    "rope",
    "embedding",
    "embedding.patch",
    "lm_head",
    "unknown",
)
# depthwise convs over the sequence, split out of their module as blocks of their own
CONV_KINDS = ("conv.causal1d", "conv.noncausal1d")


@dataclass(kw_only=True, slots=True)
class TensorMeta:
    shape: list[int]
    dtype: str

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorMeta:
        return cls(shape=list(d["shape"]), dtype=d["dtype"])


@dataclass(kw_only=True, slots=True)
class Block:
    """One classified module (or op group named after the module that owns its weights)."""

    path: str
    kind: str
    layer: int | None
    class_name: str
    evidence: list[str] = field(default_factory=list)
    op_histogram: dict[str, int] = field(default_factory=dict)
    inputs: list[TensorMeta] = field(default_factory=list)
    outputs: list[TensorMeta] = field(default_factory=list)
    params: dict[str, list[int]] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)
    flops: int = 0
    bytes: int = 0

    def __post_init__(self) -> None:
        if self.kind not in BLOCK_KINDS:
            raise ValueError(f"block {self.path!r}: unknown kind {self.kind!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Block:
        d = dict(d)
        d["inputs"] = [TensorMeta.from_dict(t) for t in d.get("inputs", [])]
        d["outputs"] = [TensorMeta.from_dict(t) for t in d.get("outputs", [])]
        return cls(**d)


@dataclass(kw_only=True, slots=True)
class OpGraph:
    model: str
    capture: str  # "export" or "dispatch"
    capture_note: str
    batch: int
    seq: int
    dtype: str
    blocks: list[Block]
    layer_pattern: str
    layer_kinds: list[list[str]]
    param_counts: dict[str, Any]
    total_flops: int
    # parameters (proxy names) read by slices and no matmul: tables, no GEMM weights
    # (`capture.sliced_tables`, `onboarding.train.flops.lookup_tables`)
    sliced_tables: list[str] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION

    def by_kind(self, kind: str) -> list[Block]:
        return [b for b in self.blocks if b.kind == kind]

    def kinds(self) -> set[str]:
        return {b.kind for b in self.blocks}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OpGraph:
        d = dict(d)
        if d.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"opgraph schema {d.get('schema_version')} != {SCHEMA_VERSION}")
        d["blocks"] = [Block.from_dict(b) for b in d["blocks"]]
        return cls(**d)

    @classmethod
    def load(cls, path: Path) -> OpGraph:
        return cls.from_dict(json.loads(Path(path).read_text()))
