"""An answer as a family folder in the plugin layout (docs/families.md), and the `FamilySpec`
behind it.

The folder holds the model's files as sent (``<family>.py.j2``, ``reference.py``) and ours:
``spec.json`` (the answer's spec fields and the structure of the block it was written for) and a
``family.py`` and ``binding.py`` of a few lines that build the spec from ``spec.json`` with the
helpers here. So the folder loads with ``--families DIR`` like any family; the model never
writes Python that runs at discovery.

The family serves blocks of the task's structure: the same kind, the same set of ATen ops and the
same non-numeric attrs (sizes differ between the proxy and the full model; nothing is decided by a
class name). Binding swaps the block module's forward for ``block_forward(module, ...)`` of the
rendered module, checked against the module's own output on its first call
(`onboarding.patching.core.calibrated`, every output tensor compared). A block with a weightless
core module (``core_module``: its task was that module's, `onboarding.generate.tasks.core_path`)
has that module's forward swapped: the family was written for it, and its ``core_module`` attr is
part of what the family serves.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from onboarding.families import FamilySpec, Param, ShapeBucket
from onboarding.generate.llm.contract import Answer

_TYPES = {"int": int, "float": float, "bool": bool, "str": str}

FAMILY_PY = '''"""Kernel family {name}: written by a language model for blocks like {path} ({kind}) and
accepted by onboard's gate (gate.json beside this file says what was checked). spec.json holds the
spec as answered; onboarding.generate.llm.folder builds it."""

from pathlib import Path

from onboarding.generate.llm.folder import load_spec

from .binding import bind

FAMILY = load_spec(Path(__file__).parent, binding=bind)
'''

BINDING_PY = '''"""Binding: the block module's forward becomes block_forward(module, ...) of the rendered kernel
module (checked against the module's own output on the first call)."""

from onboarding.generate.llm.folder import bind_block_forward as bind
'''


def signature(task: Any) -> dict[str, Any]:
    """The structure a generated family serves: kind, ATen op set, non-numeric attrs."""
    attrs = {k: v for k, v in (task.attrs or {}).items()
             if isinstance(v, (bool, str)) or v is None}
    return {"kind": task.kind, "ops": sorted(task.op_histogram), "attrs": attrs}


def spec_dict(answer: Answer, task: Any) -> dict[str, Any]:
    data = answer.model_dump(exclude={"template", "reference"})
    data["serves"] = signature(task)
    data["written_for"] = {"path": task.path, "kind": task.kind, "key": getattr(task, "key", "")}
    return data


def write_folder(answer: Answer, task: Any, root: Path) -> Path:
    """Write the answer's family folder under `root` (``root/<family>/``); returns it. A folder
    already there is replaced only when it was written by this function (it has spec.json)."""
    folder = Path(root) / answer.family
    if folder.exists() and not (folder / "spec.json").is_file():
        raise FileExistsError(f"{folder} exists and is not a generated family folder")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{answer.family}.py.j2").write_text(answer.template)
    (folder / "reference.py").write_text(answer.reference)
    (folder / "spec.json").write_text(json.dumps(spec_dict(answer, task), indent=1) + "\n")
    (folder / "family.py").write_text(FAMILY_PY.format(name=answer.family, path=task.path, kind=task.kind))
    (folder / "binding.py").write_text(BINDING_PY)
    return folder


def build_spec(data: dict[str, Any], folder: Path, binding: Any = None) -> FamilySpec:
    """The `FamilySpec` of a generated folder's spec.json (``data``)."""
    params = tuple(Param(name=p["name"], type=_TYPES[p["type"]], default=p["default"], doc=p["doc"],
                         choices=tuple(p["choices"]) if p.get("choices") is not None else None,
                         min=p.get("min"), max=p.get("max")) for p in data["params"])
    serves = data.get("serves") or {}
    variant = data["variants"][0]["name"]
    spec: FamilySpec | None = None

    def match(block: Any) -> dict[str, Any] | None:
        if not serves or block.kind != serves["kind"] or sorted(block.op_histogram) != serves["ops"]:
            return None
        if any(block.attrs.get(k) != v for k, v in serves["attrs"].items()):
            return None
        return spec.served(variant) if spec is not None else None

    spec = FamilySpec(
        name=data["family"], template=f"{data['family']}.py.j2", template_version=1,
        folder=Path(folder), variants={v["name"]: v["doc"] for v in data["variants"]}, params=params,
        tuning_space={t["key"]: tuple(t["values"]) for t in data["tuning_space"]},
        default_config={t["key"]: t["value"] for t in data["default_config"]},
        shape_buckets=tuple(ShapeBucket(name=b["name"], dim=b["dim"], lo=b["lo"], hi=b["hi"],
                                        config={c["key"]: c["value"] for c in b["config"]})
                            for b in data["shape_buckets"]),
        match=match, binding=binding)
    return spec


def load_spec(folder: Path, binding: Any = None) -> FamilySpec:
    """`build_spec` of ``folder/spec.json`` (what a generated family.py calls)."""
    return build_spec(json.loads((Path(folder) / "spec.json").read_text()), folder, binding)


def flat_tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of a (nested) block output, in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in flat_tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in flat_tensors(o)]
    if hasattr(out, "to_tuple"):
        return flat_tensors(out.to_tuple())
    return []


def _same_tree(out: Any, ref: Any):
    from onboarding.testing.tolerance import compare, tolerance_for

    a, b = flat_tensors(out), flat_tensors(ref)
    if not b or len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return None
    ok = all(compare(x.float(), y.float(), tolerance_for(y.dtype, "layer")).passed for x, y in zip(a, b))
    return ((lambda o: o), "") if ok else None


def bind_block_forward(block: Any, module: Any, kernels: list, record: Any, model: Any):
    """The `binding` hook of a generated family: see the module docstring."""
    from onboarding.patching.core import calibrated

    core = block.attrs.get("core_module")
    if core:
        module = module.get_submodule(core)
    fn = getattr(kernels[0], "block_forward", None)
    if fn is None:
        return calibrated(module, record, {})

    def run(*args, **kwargs):
        return fn(module, *args, **kwargs)

    name = f"block_forward(module{'.' + core if core else ''}, *args, **kwargs)"
    return calibrated(module, record, {name: run}, adapt=_same_tree)


def rendered_module(folder: Path) -> Path:
    """The family's first variant rendered at its defaults into ``folder/rendered/<variant>.py``
    (rewritten only when it changed): the module a swap of the block's forward loads."""
    from onboarding.families.render import render_source
    from onboarding.generate.templating import write_module

    spec = load_spec(Path(folder))
    variant = next(iter(spec.variants))
    source = render_source(spec, variant, spec.resolve(variant))
    return write_module(source, Path(folder) / "rendered" / f"{variant}.py", overwrite=True)


def make_forward(module: Any, folder: str) -> Any:
    """A blockcheck `Replacement` target and alignment's block swap for an accepted generated
    family: ``module``'s forward computed by the family's ``block_forward``."""
    from onboarding.generate.templating import load_module

    kmod = load_module(rendered_module(Path(folder)))

    def forward(*args: Any, **kwargs: Any) -> Any:
        return kmod.block_forward(module, *args, **kwargs)

    return forward
