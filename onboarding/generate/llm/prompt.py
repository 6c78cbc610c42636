"""What the model is told: the contract and rules (system), the kernel task with one or two
worked example families (user), and after a failed attempt, the reason it failed. A task asked
again after alignment left its family out also carries what alignment measured there
(`onboarding.generate.retry`) and, when the LLM path wrote that family, its code."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from onboarding.generate.llm.contract import answer_schema
from onboarding.generate.retry import code_lines, prompt_lines

MAX_EXAMPLE_CHARS = 14_000
MAX_SOURCE_CHARS = 30_000

SYSTEM = """You write Triton kernel families for `onboard`, which onboards new model architectures.
Answer with ONE JSON object that follows the schema below; nothing else.

The family is a folder: a Jinja2 template (`template`) rendering to a self-contained Python module,
its spec (variants, render params, tuning space over tile parameters such as num_warps, default
config, shape buckets) and a pure-PyTorch reference (`reference`, its own file).

The rendered module MUST export:
- `block_forward(module, *args, **kwargs)`: the block's forward, called with the block module and
  exactly the arguments its `forward` receives; it returns what the module's forward returns
  (same structure, shapes and dtypes). The core work runs in `@triton.jit` kernels launched as
  `kernel[grid](...)`; the backward is a `torch.autograd.Function` whose backward also launches
  Triton kernels (it may recompute). Gradients must reach every float input and parameter the
  module's own forward gives a gradient to.
- `aot_specs(dtype="bf16", size=...)`: a list of {"kernel", "signature", "constexprs",
  "num_warps"} for every non-underscore `@triton.jit` kernel (name-keyed signatures: "*fp32",
  "i32", "fp32", constexprs typed "constexpr"), used to compile for sm_90 ahead of time.

Rules (an answer that breaks one is rejected, and you are told why):
- Outside kernels, torch may only allocate and lay out memory: empty/zeros/full, view, reshape,
  permute, transpose, contiguous, expand, slicing, .to(). No torch math (matmul, @, einsum, exp,
  softmax, cumsum, sum, ..., torch.nn.functional) on the block's data, no call of the module's own
  forward, of `reference`, or of transformers; no imports besides torch, triton, math, inspect,
  functools (no caches), typing, os.
- No state kept between calls (no module-level dicts/lists written during a call, no global, no
  lru_cache, no hard-coded tensors): every call is checked on freshly drawn inputs, with output
  buffers filled with NaN first, at the block's size and at odd sizes (odd sequence lengths,
  batch 1 and 3), forward and every gradient, against the module's own forward.
- Kernels run in Triton's CPU interpreter on machines without a GPU: load bf16/fp16 and cast to
  fp32 before arithmetic; no tl.make_block_ptr; mask every load and store.
- The template is rendered with these variables: family, variant, template, template_version,
  params (dict), params_json, op_name, tuning_space, default_config, shape_buckets, and each render
  param by name; the filter `py` prints a Python literal. `{% include "_common.py.j2" %}` (after
  `import torch, triton, triton.language as tl` and the constants TEMPLATE, TEMPLATE_VERSION,
  FAMILY, VARIANT, PARAMS, OP_NAME, TUNING_SPACE, DEFAULT_CONFIG, SHAPE_BUCKETS) gives
  `config_for(size)` (the tile config of a problem size), `set_config` and `_empty(shape, dtype,
  device)`.

The JSON schema of the answer:
"""


def system_prompt() -> str:
    return SYSTEM + json.dumps(answer_schema(), indent=None)


# a line that is one `{% include "name" %}` (the templates' own form of an include)
_INCLUDE = re.compile(r'^[ \t]*\{%-?\s*include\s+"([^"]+)"\s*-?%\}[ \t]*$', re.M)
# the partial every answer includes itself (the system prompt says what it gives)
_COMMON_INCLUDE = "_common.py.j2"


def _expand_includes(text: str, search: tuple[Path, ...], seen: tuple[str, ...] = ()) -> str:
    """`text` with each included partial written out where it is included (between Jinja
    comments naming it), as the renderer would find it on `search`: the model sees the code
    rather than the name of a file it cannot read. `_common.py.j2` stays an include, as the
    answer's own template writes it; an include found nowhere, or one already being expanded
    (a cycle), stays as written."""
    def written_out(m: re.Match) -> str:
        name = m.group(1)
        if name == _COMMON_INCLUDE or name in seen:
            return m.group(0)
        for folder in search:
            p = Path(folder) / name
            if p.is_file():
                body = _expand_includes(p.read_text(), search, (*seen, name)).rstrip("\n")
                return f"{{#- {name}, included here: -#}}\n{body}\n{{#- end of {name} -#}}"
        return m.group(0)

    return _INCLUDE.sub(written_out, text)


def _example(name: str) -> str:
    from onboarding.families import get_family
    from onboarding.families.render import search_path

    spec = get_family(name)
    folder = Path(spec.folder)
    search = search_path(spec, get_family(spec.extends) if spec.extends else None, None)
    parts = [f"### worked example: family `{name}` (folder {folder.name}/)"]
    for fname in ("family.py", spec.template, "binding.py"):
        p = folder / fname
        if p.is_file():
            text = p.read_text()
            if fname == spec.template:
                text = _expand_includes(text, search)
            if len(text) > MAX_EXAMPLE_CHARS:
                text = text[:MAX_EXAMPLE_CHARS] + f"\n# ... ({len(text) - MAX_EXAMPLE_CHARS} more characters)\n"
            parts.append(f"--- {fname}\n{text}")
    return "\n".join(parts)


def task_prompt(task: Any) -> str:
    """The user message for `task` (a `KernelTask`)."""
    source = task.source or f"(unavailable: {task.source_note})"
    if len(source) > MAX_SOURCE_CHARS:
        source = source[:MAX_SOURCE_CHARS] + "\n# ... (truncated)\n"
    facts = {
        "block path": task.path, "kind": task.kind, "module class": task.class_name,
        "why it needs a kernel": task.reason, "uncovered op": task.op, "attrs": task.attrs,
        "ATen ops it runs (count)": task.op_histogram, "evidence": task.evidence,
        "parameters (proxy shapes)": task.params, "parameters (full size)": task.params_full,
        "inputs (proxy)": task.inputs, "outputs (proxy)": task.outputs,
        "inputs (full size)": task.inputs_full, "outputs (full size)": task.outputs_full,
        "full-size shapes": task.full_note, "captured at batch, seq": [task.batch, task.seq],
    }
    if getattr(task, "block", "") and task.block != task.path:  # a block's weightless core module
        facts["inside block"] = (f"{task.block}: its weight projections stay on the torch path; "
                                 f"block_forward replaces {task.path} alone (kind, attrs and ATen "
                                 "ops above are the whole block's)")
    examples = "\n\n".join(_example(n) for n in task.examples) if task.examples else "(none)"
    failure = prompt_lines(getattr(task, "alignment_failure", None) or {}, task.failed_family)
    again = ("## How the family that served it failed alignment\n" + "\n".join(failure)
             + "\n\n") if failure else ""
    code = code_lines(getattr(task, "previous_family", None) or {},
                      getattr(task, "alignment_failure", None) or {}, task.block_path)
    if code:  # a first-pass task has none: its prompt is as before, byte for byte
        again += "## The left-out family's code\n" + "\n".join(code) + "\n\n"
    return (f"Write a kernel family for this block.\n\n## The block\n{json.dumps(facts, indent=1, default=str)}\n\n"
            f"{again}## Its source ({task.source_note})\n```python\n{source}\n```\n\n"
            f"## Worked examples in the family layout ({task.examples_note or 'built-in families'}); "
            f"yours differs: it exports block_forward(module, *args, **kwargs) instead of an entry "
            f"function and a binding\n{examples}\n")


def initial_messages(task: Any) -> list[dict[str, str]]:
    return [{"role": "system", "content": system_prompt()}, {"role": "user", "content": task_prompt(task)}]


def feedback(reason: str) -> str:
    return (f"Your answer was rejected: {reason}\nSend the whole corrected answer again as one "
            "JSON object in the same schema.")


def prompt_hash(messages: list[dict[str, str]]) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:16]
