"""`TrainConfig`: one LoRA training run (FSDP2 x EP layout, data, adapters), TOML round trip.

The TOML file (``<out>/train.toml``) is the editable record of a run: ``onboard train --config``
re-runs it. It is read with `tomllib` and written by the small writer below (no dependency);
``None`` values are omitted and read back as the defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from onboarding.errors import InputError, read_toml
from onboarding.load.examples import model_forms
from onboarding.load.spec import ModelSpec

PROXIES = ("tiny", "small", "none")
DTYPES = ("fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")
RECOMPUTE = ("none", "selective", "full")  # the same three as `onboard plan --recompute`
BALANCE = ("auto", "none", "aux-loss", "bias")
COMPILE = ("none", "blocks")  # `onboarding.train.compile`
INIT_DEVICES = ("cpu", "device")  # where the seed's base weights are made (`train.setup`)

# One line per field: the header comment of the written TOML file.
FIELD_DOCS = {
    "model": f"MODEL: {model_forms()}",
    "overrides": "config overrides (--set KEY=VALUE), applied before the proxy is made",
    "trust_remote_code": "run the model repo's own modeling_*.py",
    "proxy": "tiny (CPU) | small (one GPU) | none (the full config as given)",
    "out": "run directory (absolute path)",
    "nproc": "number of processes; must equal fsdp * ep",
    "ep": "expert-parallel degree (must divide the number of routed experts)",
    "fsdp": "FSDP2 sharding degree of dense parameters",
    "steps": "optimizer steps",
    "seq_len": "tokens per packed sequence",
    "micro_batch": "sequences per rank per step (global batch = micro_batch * nproc)",
    "lr": "AdamW learning rate (adapters only)",
    "weight_decay": "AdamW weight decay",
    "warmup_steps": "linear warm-up steps",
    "grad_clip": "max global gradient norm; 0 = off",
    "lora_rank": "LoRA rank r",
    "lora_alpha": "LoRA alpha (scaling = alpha / r)",
    "lora_dropout": "dropout on the adapter input, in [0, 1)",
    "lora_targets": '["auto"] = projections of every attention kind; else fnmatch patterns',
    "expert_lora": "also train grouped LoRA adapters on the routed experts",
    "activation_checkpointing": "old name of recompute = \"full\" (true: every decoder layer)",
    "recompute": "none | selective (each layer's MLP/experts sub-block) | full (every layer)",
    "compile": "none | blocks (torch.compile of each decoder layer from the second step on)",
    "balance": "auto (the model's own) | none | aux-loss (Switch loss) | bias (aux-loss-free)",
    "aux_loss_coef": "aux-loss coefficient; absent = the model's router_aux_loss_coef or 0.01",
    "bias_rate": "bias balancing: per-step update of each expert's routing-score bias",
    "checkpoint_dir": "checkpoint root (path or fsspec URL, s3://...); absent = <out>/train/ckpt",
    "stall_timeout": "seconds without a finished step before the run stops (alert); 0 = off",
    "alert_webhook": "URL that gets a JSON POST when an alert (stall, NaN/inf loss) fires",
    "checkpoint_interval": "DCP checkpoint every N steps; 0 = none",
    "seed": "seed of the proxy weights, adapters and data order",
    "dtype": "base weight dtype fp32 | bf16 (adapters and optimizer state stay fp32)",
    "device": "auto | cpu | cuda",
    "init_device": "where the seed's base weights are made: cpu (the same on every machine) | "
                   "device (the training device: fast; the same on every device of one kind)",
    "capacity_factor": "expert capacity factor; absent = dropless",
    "data": "JSONL (prompt/response or text), .txt file or directory; absent = built-in corpus",
    "kernels": "use onboard kernels on the GPU where they exist",
    "profile_every": "profile every N-th step (all-to-all share, train/profile_<role>_step<N>.json); 0 = off",
    "baseline": "also time the model as it stands with PEFT's LoRA (transformers + PEFT; a "
                "plain nn.Module: its eager forward + PEFT) on one device with one rank's batch "
                "share",
    "export": "write the adapters and the base they trained on at the end (a sweep does not)",
}


@dataclass(kw_only=True)
class TrainConfig:
    model: str
    overrides: dict = field(default_factory=dict)
    trust_remote_code: bool = False
    proxy: str = "tiny"
    out: str = ""
    nproc: int = 1
    ep: int = 1
    fsdp: int = 1
    steps: int = 20
    seq_len: int = 128
    micro_batch: int = 2
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    grad_clip: float = 0.0
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    lora_targets: list[str] = field(default_factory=lambda: ["auto"])
    expert_lora: bool = False
    activation_checkpointing: bool = False
    recompute: str = "none"
    compile: str = "none"
    balance: str = "auto"
    aux_loss_coef: float | None = None
    bias_rate: float = 1e-3
    checkpoint_interval: int = 0
    checkpoint_dir: str | None = None
    stall_timeout: float = 0.0
    alert_webhook: str | None = None
    seed: int = 0
    dtype: str = "fp32"
    device: str = "auto"
    init_device: str = "cpu"
    capacity_factor: float | None = None
    data: str | None = None
    kernels: bool = True
    profile_every: int = 0
    baseline: bool = False
    export: bool = True

    @classmethod
    def for_model(cls, spec: ModelSpec, **fields: Any) -> TrainConfig:
        """The training setup of `spec`'s model (the TOML keeps its four fields flat)."""
        return cls(model=spec.ref or "", overrides=dict(spec.overrides),
                   trust_remote_code=spec.trust_remote_code, proxy=spec.proxy, **fields)

    @property
    def model_spec(self) -> ModelSpec:
        return ModelSpec(ref=self.model or None, overrides=dict(self.overrides),
                         trust_remote_code=self.trust_remote_code, proxy=self.proxy)

    @property
    def recompute_mode(self) -> str:
        """`recompute`, with the older ``activation_checkpointing = true`` meaning ``full``."""
        return "full" if self.activation_checkpointing else self.recompute

    @property
    def ckpt_root(self) -> str:
        """Where the role folders of the DCP checkpoints live: a path or an fsspec URL."""
        return self.checkpoint_dir or str(Path(self.out) / "train" / "ckpt")

    @property
    def world_size(self) -> int:
        return self.nproc

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.nproc

    def validate(self, *, n_experts: int | None = None) -> None:
        """Raise `InputError` (exit 2) naming the field and value of the first problem.

        ``n_experts`` is the routed expert count of the model that will train (None: no MoE).
        """
        self.validate_fields()
        self._validate_model(n_experts)

    def validate_fields(self) -> None:
        """The checks that need no model: types, ranges, choices, fsdp * ep = nproc."""
        _check_types(self)
        for name in ("nproc", "ep", "fsdp", "steps", "seq_len", "micro_batch", "lora_rank"):
            if getattr(self, name) <= 0:
                raise InputError(f"{name}={getattr(self, name)}: must be positive")
        for name in ("warmup_steps", "checkpoint_interval", "profile_every"):
            if getattr(self, name) < 0:
                raise InputError(f"{name}={getattr(self, name)}: must be >= 0 (0 = off)")
        for name in ("lr", "weight_decay", "grad_clip", "lora_alpha"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0 or (name in ("lr", "lora_alpha") and v == 0):
                raise InputError(f"{name}={v}: must be a finite number "
                                 f"{'> 0' if name in ('lr', 'lora_alpha') else '>= 0'}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise InputError(f"lora_dropout={self.lora_dropout}: must be in [0, 1)")
        for name, allowed in (("proxy", PROXIES), ("dtype", DTYPES), ("device", DEVICES),
                              ("init_device", INIT_DEVICES),
                              ("recompute", RECOMPUTE), ("compile", COMPILE),
                              ("balance", BALANCE)):
            if getattr(self, name) not in allowed:
                raise InputError(f"{name}={getattr(self, name)!r}: expected one of "
                                 f"{', '.join(allowed)}")
        if self.activation_checkpointing and self.recompute not in ("none", "full"):
            raise InputError(f"activation_checkpointing=true is recompute=\"full\"; it "
                             f"contradicts recompute={self.recompute!r}")
        for name in ("aux_loss_coef", "bias_rate", "stall_timeout"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise InputError(f"{name}={v}: must be a finite number >= 0")
        if self.alert_webhook is not None and not self.alert_webhook.startswith(
                ("http://", "https://")):
            raise InputError(f"alert_webhook={self.alert_webhook!r}: expected an http(s):// URL")
        if self.checkpoint_dir is not None and not self.checkpoint_dir.strip():
            raise InputError("checkpoint_dir='': give a path or an fsspec URL, or leave it out")
        if self.checkpoint_dir and "://" not in self.checkpoint_dir and \
                not Path(self.checkpoint_dir).is_absolute():
            raise InputError(f"checkpoint_dir={self.checkpoint_dir!r}: a local path must be "
                             "absolute (or an fsspec URL such as s3://bucket/run)")
        if self.capacity_factor is not None and not (self.capacity_factor > 0
                                                     and math.isfinite(self.capacity_factor)):
            raise InputError(f"capacity_factor={self.capacity_factor}: must be > 0 "
                             "(omit it for dropless routing)")
        if not self.lora_targets or not all(isinstance(t, str) and t.strip()
                                            for t in self.lora_targets):
            raise InputError(f"lora_targets={self.lora_targets!r}: expected a non-empty list "
                             "of module patterns, or [\"auto\"]")
        if self.nproc != self.fsdp * self.ep:
            raise InputError(f"nproc={self.nproc}: world size must equal fsdp * ep "
                             f"= {self.fsdp} * {self.ep} = {self.fsdp * self.ep}")
        if self.out and not Path(self.out).is_absolute():
            raise InputError(f"out={self.out!r}: must be an absolute path")

    def _validate_model(self, n_experts: int | None) -> None:
        if n_experts is None:
            if self.ep > 1:
                raise InputError(f"ep={self.ep}: the model has no routed experts, so expert "
                                 "parallelism needs ep=1")
            if self.expert_lora:
                raise InputError("expert_lora=true: the model has no routed experts")
            if self.capacity_factor is not None:
                raise InputError(f"capacity_factor={self.capacity_factor}: the model has no "
                                 "routed experts")
            if self.balance in ("aux-loss", "bias"):
                raise InputError(f"balance={self.balance!r}: the model has no routed experts")
        elif n_experts % self.ep:
            raise InputError(f"ep={self.ep}: does not divide the model's {n_experts} routed "
                             "experts")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_toml(self, path: str | Path) -> Path:
        path = Path(path)
        lines = ["# onboard train: one LoRA training run. Edit, then re-run with",
                 "#   onboard train --config " + path.name,
                 "# Fields (absent optional fields take their defaults):"]
        lines += [f"#   {name:<24} {doc}" for name, doc in FIELD_DOCS.items()]
        lines.append("")
        tables = []
        for name, value in self.to_dict().items():
            if value is None:
                continue
            if isinstance(value, dict):
                tables.append((name, value))
                continue
            lines.append(f"{name} = {_toml_value(value, name)}")
        for name, table in tables:
            lines += ["", f"[{name}]"]
            lines += [f"{_toml_key(k)} = {_toml_value(v, f'{name}.{k}')}"
                      for k, v in table.items() if v is not None]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
        return path

    @classmethod
    def from_toml(cls, path: str | Path) -> TrainConfig:
        path = Path(path)
        data = read_toml(path, "--config")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InputError(f"{path}: unknown field(s) {', '.join(unknown)}")
        if "model" not in data:
            raise InputError(f"{path}: missing field 'model'")
        cfg = cls(**data)
        _check_types(cfg, where=f"{path}: ")
        return cfg


_TYPES = {"model": str, "overrides": dict, "trust_remote_code": bool, "proxy": str, "out": str,
          "lora_targets": list, "expert_lora": bool, "activation_checkpointing": bool,
          "recompute": str, "compile": str, "balance": str, "checkpoint_dir": (str, type(None)),
          "alert_webhook": (str, type(None)), "aux_loss_coef": (int, float, type(None)),
          "dtype": str, "device": str, "init_device": str, "data": (str, type(None)), "kernels": bool, "baseline": bool, "export": bool,
          "capacity_factor": (int, float, type(None))}
_INTS = ("nproc", "ep", "fsdp", "steps", "seq_len", "micro_batch", "warmup_steps", "lora_rank",
         "checkpoint_interval", "seed", "profile_every")
_FLOATS = ("lr", "weight_decay", "grad_clip", "lora_alpha", "lora_dropout", "bias_rate",
           "stall_timeout")


def _check_types(cfg: TrainConfig, where: str = "") -> None:
    for name in _INTS:
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool):
            raise InputError(f"{where}{name}={v!r}: expected an integer")
    for name in _FLOATS:
        v = getattr(cfg, name)
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise InputError(f"{where}{name}={v!r}: expected a number")
        setattr(cfg, name, float(v))
    for name, t in _TYPES.items():
        v = getattr(cfg, name)
        if not isinstance(v, t) or (isinstance(v, bool) and t in ((int, float, type(None)),)):
            raise InputError(f"{where}{name}={v!r}: expected "
                             f"{getattr(t, '__name__', None) or 'a number or nothing'}")


def _toml_key(key: str) -> str:
    if key and all(c.isalnum() or c in "_-" for c in key):
        return key
    return _toml_str(key)


def _toml_str(s: str) -> str:
    out = s.replace("\\", "\\\\").replace('"', '\\"')
    out = out.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
    out = "".join(c if ord(c) >= 0x20 and c != "\x7f" else f"\\u{ord(c):04x}" for c in out)
    return f'"{out}"'


def _toml_value(v: Any, name: str) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise InputError(f"{name}={v}: TOML cannot hold a non-finite number here")
        return repr(v)
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, (list, tuple)):
        if any(x is None for x in v):
            raise InputError(f"{name}={v!r}: TOML lists cannot hold null")
        return "[" + ", ".join(_toml_value(x, name) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x, f'{name}.{k}')}"
                               for k, x in v.items() if x is not None) + "}"
    raise InputError(f"{name}={v!r}: cannot write a {type(v).__name__} to TOML")
