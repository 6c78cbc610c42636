"""Typed inputs of a plan: what to train (`PlanConfig`) and on what (`ClusterConfig`, `Rates`).

Every default below is an assumption, stated where the plan prints it (`assumptions`):
  - GPU memory: this GPU's total memory when one is visible, else an H200's 141 GiB;
  - host memory for offload: 256 GiB per GPU (2 TiB in a node of 8);
  - links per GPU: NVLink 450 GB/s one way inside a node of 8 (H200 NVLink 4: 900 GB/s both
    ways), 50 GB/s between nodes (one 400 Gb/s NIC per GPU);
  - kernel rates of an H200: 790 TFLOP/s dense bf16 achievable by a large GEMM (989 on the
    datasheet), 4.0 TB/s HBM (4.8 on the datasheet), 8 us of host time per launched op;
  - allocator slack: 10% on top of the dynamic (activation and workspace) bytes, plus 1 GiB for
    the CUDA context, cuBLAS and NCCL buffers.
A TOML file (``--cluster FILE``) overrides any of them; its ``[rates]`` table takes measured
rates (``onboard plan --calibrate`` measures them on this GPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from onboarding.errors import InputError, read_toml

GIB = 1024 ** 3
H200_GIB = 141.0
MODES = ("lora", "full")
RECOMPUTE = ("none", "selective", "full")
OFFLOAD = ("none", "optimizer", "params")


@dataclass(kw_only=True, slots=True)
class Rates:
    """Kernel rates of one GPU (``source`` says where they come from)."""

    gemm_tflops: float = 790.0  # dense bf16 GEMM, achievable at large shapes
    attn_tflops: float = 550.0  # fused attention forward+backward (flash), achievable
    hbm_tbps: float = 4.0  # memory-bound ops
    launch_us: float = 8.0  # host time per launched op (eager PyTorch)
    peak_tflops: float = 989.0  # the datasheet peak MFU is measured against
    source: str = "assumed H200 defaults"


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    """The machines: GPUs per node, memory per GPU and link bandwidths per GPU (one way)."""

    gpu_mem_gib: float = H200_GIB
    gpu_mem_source: str = "assumed: an H200's 141 GiB"
    gpus_per_node: int = 8
    nvlink_gbps: float = 450.0  # GB/s per GPU inside a node
    internode_gbps: float = 50.0  # GB/s per GPU between nodes
    pcie_gbps: float = 25.0  # GB/s host <-> device per GPU (offload traffic)
    host_mem_gib: float = 256.0  # host memory per GPU for offload (2 TiB per node of 8)
    slack: float = 0.10  # allocator fragmentation on the dynamic bytes
    reserved_gib: float = 1.0  # CUDA context, cuBLAS workspace, NCCL buffers
    rates: Rates = field(default_factory=Rates)

    @property
    def gpu_bytes(self) -> float:
        return self.gpu_mem_gib * GIB

    def validate(self) -> None:
        if not (math.isfinite(self.gpu_mem_gib) and self.gpu_mem_gib > 0):
            raise InputError(f"GPU memory {self.gpu_mem_gib} GiB: must be a positive number")
        if self.gpus_per_node <= 0:
            raise InputError(f"gpus_per_node={self.gpus_per_node}: must be positive")
        for name in ("nvlink_gbps", "internode_gbps", "pcie_gbps", "host_mem_gib"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise InputError(f"{name}={v}: must be a positive bandwidth in GB/s")
        for name in ("gemm_tflops", "attn_tflops", "hbm_tbps", "peak_tflops"):
            v = getattr(self.rates, name)
            if not (math.isfinite(v) and v > 0):
                raise InputError(f"rates.{name}={v}: must be positive")
        if not (self.slack >= 0 and self.reserved_gib >= 0 and self.rates.launch_us >= 0):
            raise InputError("slack, reserved_gib and rates.launch_us must be >= 0")

    def assumptions(self) -> list[str]:
        r = self.rates
        return [f"GPU memory {self.gpu_mem_gib:.4g} GiB ({self.gpu_mem_source})",
                f"{self.gpus_per_node} GPUs per node; NVLink {self.nvlink_gbps:g} GB/s and "
                f"inter-node {self.internode_gbps:g} GB/s per GPU one way; PCIe "
                f"{self.pcie_gbps:g} GB/s; {self.host_mem_gib:g} GiB of host memory per GPU "
                "for offload",
                f"kernel rates ({r.source}): GEMM {r.gemm_tflops:g} TFLOP/s, attention "
                f"{r.attn_tflops:g} TFLOP/s, HBM {r.hbm_tbps:g} TB/s, {r.launch_us:g} us host "
                f"time per op; MFU against {r.peak_tflops:g} TFLOP/s",
                f"allocator slack {self.slack:.0%} of the activations and workspaces, plus "
                f"{self.reserved_gib:g} GiB reserved (CUDA context, cuBLAS, NCCL)"]


@dataclass(kw_only=True, slots=True)
class PlanConfig:
    """What trains: layout (None: searched), sequence, batch, LoRA or full, memory savers."""

    gpus: int = 8
    seq: int = 4096
    micro_batch: int = 1
    mode: str = "lora"
    lora_rank: int = 16
    expert_lora: bool = False
    recompute: str | None = None  # None: searched
    offload: str | None = None  # None: searched
    ep: int | None = None
    fsdp: int | None = None
    capacity_factor: float | None = None  # None: dropless
    imbalance: float = 1.25  # expected max/mean tokens per EP rank (assumption)
    dtype: str = "bf16"  # base weights (activations are modelled in bf16 either way)
    # onboard's kernels patched into every block a family of them matches, as `onboard train`
    # patches them on a GPU (its default): those blocks keep what the kernels' autograd keeps.
    # False: every block's own torch path (a CPU run, or ``--no-kernels``)
    kernels: bool = True
    # step times within this fraction of the fastest fitting layout count as equally fast, and
    # the lighter memory savers win among them (`onboarding.plan.search.rank` says why 1%)
    time_tolerance: float = 0.01

    def validate(self) -> None:
        for name in ("gpus", "seq", "micro_batch", "lora_rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise InputError(f"--{name.replace('_', '-')} {v}: must be a positive integer")
        if self.dtype not in ("bf16", "fp32"):
            raise InputError(f"dtype {self.dtype!r}: expected bf16 or fp32")
        if self.mode not in MODES:
            raise InputError(f"mode {self.mode!r}: expected one of {', '.join(MODES)}")
        if self.recompute is not None and self.recompute not in RECOMPUTE:
            raise InputError(f"--recompute {self.recompute}: expected one of "
                             f"{', '.join(RECOMPUTE)}")
        if self.offload is not None and self.offload not in OFFLOAD:
            raise InputError(f"--offload {self.offload}: expected one of {', '.join(OFFLOAD)}")
        for name in ("ep", "fsdp"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise InputError(f"--{name} {v}: must be a positive integer")
        if self.ep and self.fsdp and self.ep * self.fsdp != self.gpus:
            raise InputError(f"--ep {self.ep} x --fsdp {self.fsdp} = {self.ep * self.fsdp}: "
                             f"must equal --gpus {self.gpus}")
        for name in ("ep", "fsdp"):
            v = getattr(self, name)
            if v is not None and self.gpus % v:
                raise InputError(f"--{name} {v}: does not divide --gpus {self.gpus}")
        if self.capacity_factor is not None and not (self.capacity_factor > 0
                                                     and math.isfinite(self.capacity_factor)):
            raise InputError(f"--capacity-factor {self.capacity_factor}: must be > 0")
        if not (self.imbalance >= 1 and math.isfinite(self.imbalance)):
            raise InputError(f"--imbalance {self.imbalance}: must be >= 1 (max over mean)")
        if not (0 <= self.time_tolerance < 1):
            raise InputError(f"time_tolerance {self.time_tolerance}: must be in [0, 1) (a "
                             "fraction of the fastest step time)")


def parse_gib(text: str | float | None) -> float | None:
    """``--gpu-mem``: GiB as a number, or with a unit (``141``, ``141GiB``, ``80 GB``)."""
    if text is None:
        return None
    s = str(text).strip().lower().replace(" ", "")
    scale = 1.0
    for unit, mult in (("gib", 1.0), ("gb", 1e9 / GIB), ("tib", 1024.0), ("mib", 1 / 1024)):
        if s.endswith(unit):
            s, scale = s[: -len(unit)], mult
            break
    try:
        v = float(s) * scale
    except ValueError:
        raise InputError(f"--gpu-mem {text!r}: expected a size in GiB (e.g. 141 or 80GB)") \
            from None
    if not (math.isfinite(v) and v > 0):
        raise InputError(f"--gpu-mem {text!r}: must be a positive size in GiB")
    return v


def this_gpu_gib() -> tuple[float, str]:
    """(GiB, where it came from): this GPU's memory, else the H200's (an assumption)."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory / GIB, f"this GPU: {props.name}"
    return H200_GIB, "assumed: no GPU here, an H200's 141 GiB"


def load_cluster(path: str | Path | None = None, *, gpu_mem: float | None = None
                 ) -> ClusterConfig:
    """The cluster from a TOML file (any subset of `ClusterConfig`'s fields, rates under
    ``[rates]``), then ``gpu_mem`` (GiB) over it; GPU memory defaults to `this_gpu_gib`."""
    data: dict[str, Any] = {}
    if path is not None:
        data = read_toml(path, "--cluster")
    rates = data.pop("rates", {})
    known, rknown = {f.name for f in fields(ClusterConfig)}, {f.name for f in fields(Rates)}
    unknown = sorted(set(data) - known) + [f"rates.{k}" for k in sorted(set(rates) - rknown)]
    if unknown:
        raise InputError(f"{path}: unknown field(s) {', '.join(unknown)}")
    try:
        r = Rates(**{k: (str(v) if k == "source" else float(v)) for k, v in rates.items()})
        if rates and "source" not in rates:
            r.source = f"from {path}"
        cluster = ClusterConfig(**{k: (float(v) if k not in ("gpus_per_node", "gpu_mem_source")
                                       else v) for k, v in data.items()}, rates=r)
    except (TypeError, ValueError) as exc:
        raise InputError(f"{path}: {exc}") from exc
    if "gpu_mem_gib" in data:
        cluster.gpu_mem_source = f"from {path}"
    if gpu_mem is not None:
        cluster.gpu_mem_gib, cluster.gpu_mem_source = gpu_mem, "--gpu-mem"
    elif "gpu_mem_gib" not in data:
        cluster.gpu_mem_gib, cluster.gpu_mem_source = this_gpu_gib()
    if not isinstance(cluster.gpus_per_node, int):
        raise InputError(f"{path}: gpus_per_node must be an integer")
    cluster.validate()
    return cluster
