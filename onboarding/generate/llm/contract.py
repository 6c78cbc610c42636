"""The answer contract: what the model must send back for a kernel task, as a JSON schema, and
its strict parser.

An answer is one complete kernel family in the plugin layout (docs/families.md), written by the
model: a Jinja template that renders to a self-contained Triton module, the family's spec
(variants, render parameters, tuning space, default config, shape buckets) and a pure-PyTorch
reference. The binding contract is one function: the rendered module exports
``block_forward(module, *args, **kwargs)``, which computes the block's forward (the module's own
arguments, the module for its parameters and config) with Triton kernels doing the core work and
a ``torch.autograd.Function`` for the backward; binding the family to a block swaps the module's
forward for it. The module also exports ``aot_specs(dtype, size)`` (kernel signatures for the
sm_90 ahead-of-time compile, as every rendered module does). The reference,
``reference(module, *args, **kwargs)``, lives in its own file and the kernel module may not use it.

Parsing is strict: an unknown or missing key, a value of the wrong type, a name that is not a
lowercase identifier, a default config outside the tuning space, or a reference that does not
parse is rejected with a one-line reason that goes back to the model.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

IDENT = re.compile(r"^[a-z][a-z0-9_]{0,47}$")
MAX_TEMPLATE_CHARS = 200_000


class AnswerError(ValueError):
    """An answer that does not meet the contract (message: the reason, one line)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Variant(_Strict):
    name: str = Field(description="lowercase identifier")
    doc: str = Field(description="one line: what this variant computes")


class RenderParam(_Strict):
    name: str = Field(description="lowercase identifier; a Jinja variable of the template")
    type: Literal["int", "float", "bool", "str"]
    default: int | float | bool | str
    doc: str
    choices: list[int | float | bool | str] | None
    min: float | None
    max: float | None


class TileValues(_Strict):
    key: str = Field(description="a tile parameter, e.g. num_warps or BLOCK_H")
    values: list[int]


class TileValue(_Strict):
    key: str
    value: int


class Bucket(_Strict):
    name: str
    dim: str = Field(description="the problem dimension that decides tiles")
    lo: int
    hi: int
    config: list[TileValue]


class Answer(_Strict):
    """One kernel family, complete (see the module docstring for the binding contract)."""

    family: str = Field(description="the family's name: a lowercase identifier, also its folder")
    summary: str = Field(description="one paragraph: the algorithm and how the kernels split the work")
    template: str = Field(description="Jinja2 text rendering to the kernel module; it may "
                          "{% include \"_common.py.j2\" %} for config_for/set_config/_empty")
    reference: str = Field(description="Python source of reference(module, *args, **kwargs): "
                           "the block's forward in plain PyTorch")
    variants: list[Variant] = Field(min_length=1)
    params: list[RenderParam]
    tuning_space: list[TileValues] = Field(min_length=1)
    default_config: list[TileValue]
    shape_buckets: list[Bucket] = Field(min_length=1)

    def tuning_dict(self) -> dict[str, tuple[int, ...]]:
        return {t.key: tuple(t.values) for t in self.tuning_space}

    def default_dict(self) -> dict[str, int]:
        return {t.key: t.value for t in self.default_config}


def answer_schema() -> dict[str, Any]:
    """The JSON schema of an answer, in the form OpenAI's strict structured output accepts
    (every property required, no additional properties)."""
    schema = Answer.model_json_schema()
    return _strictify(schema)


def _strictify(node: Any) -> Any:
    if isinstance(node, dict):
        # "default" and "title" are schema keywords strict mode refuses; a property may be named so
        out = {k: ({n: _strictify(s) for n, s in v.items()} if k == "properties" else _strictify(v))
               for k, v in node.items() if k not in ("default", "title")}
        if out.get("type") == "object" and "properties" in out:
            out["required"] = sorted(out["properties"])
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_strictify(v) for v in node]
    return node


def response_format() -> dict[str, Any]:
    """The `response_format` argument asking for structured output in this schema."""
    return {"type": "json_schema",
            "json_schema": {"name": "kernel_family", "strict": True, "schema": answer_schema()}}


def _first_error(exc: ValidationError) -> str:
    errs = exc.errors()
    e = errs[0]
    where = ".".join(str(p) for p in e["loc"]) or "answer"
    kind = e["type"]
    if kind == "extra_forbidden":
        what = f"unknown key {where!r}"
    elif kind == "missing":
        what = f"missing key {where!r}"
    else:
        what = f"{where}: {e['msg']}"
    more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
    return what + more


def _extract_json(text: str) -> str:
    """The JSON object of a reply: the whole text, or the one fenced ```json block (servers in
    plain-text mode wrap it); nothing else is guessed."""
    s = text.strip()
    fence = re.fullmatch(r"```(?:json)?\s*\n(.*)\n```", s, flags=re.S)
    return fence.group(1) if fence else s


def parse_answer(text: str | None) -> Answer:
    """The reply text as an `Answer`, or AnswerError with the reason."""
    if text is None or not text.strip():
        raise AnswerError("empty answer: the reply had no content")
    try:
        data = json.loads(_extract_json(text))
    except json.JSONDecodeError as exc:
        raise AnswerError(f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from exc
    if not isinstance(data, dict):
        raise AnswerError(f"the answer must be a JSON object, got {type(data).__name__}")
    try:
        answer = Answer.model_validate(data)
    except ValidationError as exc:
        raise AnswerError(f"answer does not meet the schema: {_first_error(exc)}") from exc
    _check(answer)
    return answer


def _check(a: Answer) -> None:
    names = [("family", a.family)] + [("variant", v.name) for v in a.variants] + \
        [("param", p.name) for p in a.params] + [("shape bucket", b.name) for b in a.shape_buckets]
    for what, name in names:
        if not IDENT.match(name):
            raise AnswerError(f"{what} name {name!r} is not a lowercase identifier")
    for what, group in (("variant", [v.name for v in a.variants]), ("param", [p.name for p in a.params]),
                        ("tuning key", [t.key for t in a.tuning_space])):
        dup = sorted({n for n in group if group.count(n) > 1})
        if dup:
            raise AnswerError(f"duplicate {what} name(s) {dup}")
    for t in a.tuning_space:
        if not t.key.isidentifier() or not t.values:
            raise AnswerError(f"tuning key {t.key!r} must be an identifier with at least one value")
    space = a.tuning_dict()
    for where, config in [("default_config", a.default_config)] + \
            [(f"shape bucket {b.name!r}", b.config) for b in a.shape_buckets]:
        for tv in config:
            if tv.key not in space:
                raise AnswerError(f"{where}: unknown tile key {tv.key!r}; tuning_space has {sorted(space)}")
            if tv.value not in space[tv.key]:
                raise AnswerError(f"{where}: {tv.key}={tv.value} is not in the tuning space {list(space[tv.key])}")
    missing = sorted(set(space) - set(a.default_dict()))
    if missing:
        raise AnswerError(f"default_config misses tile key(s) {missing}")
    if not a.template.strip() or len(a.template) > MAX_TEMPLATE_CHARS:
        raise AnswerError(f"template must be non-empty and at most {MAX_TEMPLATE_CHARS} characters")
    try:
        tree = ast.parse(a.reference)
    except SyntaxError as exc:
        raise AnswerError(f"reference: syntax error at line {exc.lineno}: {exc.msg}") from exc
    if not any(isinstance(n, ast.FunctionDef) and n.name == "reference" for n in tree.body):
        raise AnswerError("reference must define a function named reference(module, *args, **kwargs)")
