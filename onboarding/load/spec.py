"""`ModelSpec`: what names a model to onboard, the one declaration every command, the agent and
training take (MODEL, its `--set` overrides, whether its own code may run, the proxy size)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from onboarding.errors import InputError

PROXIES = ("tiny", "small", "none")  # none: the full-size config (training only)
IMPLS = ("auto", "native", "remote")
PARTS = ("language", "vision")  # a multimodal model: its language model, or its vision tower


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """MODEL and how to build it.

    `ref`: a model directory, `hf:<model_type>`, `file.py:Name`, `module:Name` or a built-in
    example (`load.model.model_forms`; None: the default example); `overrides`: config fields set before building
    (`--set key=value`); `trust_remote_code`: run the repo's own modeling code;
    `proxy`: the size of the model that really runs (tiny on a CPU, small on one GPU, none for
    the full-size config); `part`: which part of a multimodal model runs (`load.vision`).
    """

    ref: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    trust_remote_code: bool = False
    proxy: str = "tiny"
    impl: str = "auto"  # remote code whose model_type transformers implements: native | remote
    part: str = "language"  # vision: a multimodal model's vision tower, with synthetic pixels

    def __post_init__(self) -> None:
        if self.ref is not None and not self.ref.strip():  # `onboard parse ''`: not the default
            from onboarding.load.model import model_forms

            raise InputError(f"MODEL is empty: give {model_forms()} (or leave it out)")
        if self.proxy not in PROXIES:
            raise InputError(f"proxy {self.proxy!r}: expected one of {', '.join(PROXIES)}")
        if self.impl not in IMPLS:
            raise InputError(f"impl {self.impl!r}: expected one of {', '.join(IMPLS)}")
        if self.part not in PARTS:
            raise InputError(f"part {self.part!r}: expected one of {', '.join(PARTS)}")

    def load(self):
        """The resolved model (`LoadedModel`): config, builder and provenance, nothing built."""
        from onboarding.load.model import load_model

        return load_model(self.ref, overrides=dict(self.overrides),
                          trust_remote_code=self.trust_remote_code, impl=self.impl,
                          part=self.part)
