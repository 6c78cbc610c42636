"""Template machinery: validation before rendering, determinism, writing, loading, matching."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from onboarding.generate import templating
from onboarding.errors import InputError
from onboarding.families import families, family_module, get_family, match_block
from onboarding.graph.opgraph import Block
from onboarding.testing import Tolerance, compare, tolerance_for

FAMILIES = tuple(families().values())

ROOT = Path(__file__).resolve().parents[1]
ALL_VARIANTS = [pytest.param(f.name, v, id=f"{f.name}-{v}") for f in FAMILIES for v in f.variants]


@pytest.mark.parametrize("family,variant", ALL_VARIANTS)
def test_every_variant_renders_with_defaults(family, variant):
    source = templating.render(family, variant)
    spec = get_family(family)
    params = spec.resolve(variant)
    lines = source.splitlines()
    assert lines[0] == (
        f"# Rendered by onboard from kernel_templates/{spec.name}/{spec.template} "
        f"(template version {spec.template_version}). Do not edit."
    )
    assert lines[2] == "# params: " + json.dumps(params, sort_keys=True)
    # Backward is registered on the custom op (register_autograd: the op's autograd function).
    # The top-k selection is not differentiated through (issue 7): nothing to register there.
    autograd = () if (family, variant) == ("sparse_attention", "indexer") else (
        "register_autograd",)
    for name in ("TEMPLATE", "TEMPLATE_VERSION", "PARAMS", "TUNING_SPACE", "SHAPE_BUCKETS", "DEFAULT_CONFIG",
                 "def reference(", "register_fake", *autograd):
        assert name in source, name
    assert source.endswith("\n") and not source.endswith("\n\n\n")


@pytest.mark.parametrize("family,variant", ALL_VARIANTS)
def test_render_is_deterministic(family, variant):
    assert templating.render(family, variant) == templating.render(family, variant)


def test_render_is_deterministic_across_processes():
    """Same params in another process (another hash seed) give byte-identical files."""
    code = (
        "import sys, hashlib; sys.path.insert(0, %r)\n"
        "from onboarding.generate import templating\n"
        "from onboarding.families import families\nFAMILIES = tuple(families().values())\n"
        "print(hashlib.sha256(''.join(templating.render(f.name, v) for f in FAMILIES for v in f.variants)"
        ".encode()).hexdigest())\n" % str(ROOT)
    )
    digests = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        digests.add(out.stdout.strip())
    assert len(digests) == 1


def test_param_order_does_not_matter():
    a = templating.render("swiglu", "fused", {"layout": "interleaved", "limit": 7.0, "alpha": 1.702})
    b = templating.render("swiglu", "fused", {"alpha": 1.702, "limit": 7, "layout": "interleaved"})
    assert a == b


def test_op_names_differ_per_params():
    a = templating.render("rmsnorm", "plain", {})
    b = templating.render("rmsnorm", "plain", {"unit_offset": True})
    op = [line for line in a.splitlines() if line.startswith("OP_NAME")][0]
    assert op.startswith('OP_NAME = "onboard::rmsnorm_plain_')
    assert op not in b


BAD = [
    ("nope", "plain", {}, "nope"),
    ("rmsnorm", "nope", {}, "nope"),
    ("rmsnorm", "plain", {"epsilon": 1e-6}, "epsilon"),
    ("rmsnorm", "plain", {"eps": "small"}, "'eps'"),
    ("rmsnorm", "plain", {"eps": -1.0}, "'eps'"),
    ("rmsnorm", "plain", {"eps": float("nan")}, "'eps'"),
    ("rmsnorm", "plain", {"unit_offset": 1}, "'unit_offset'"),
    ("rmsnorm", "l2norm", {"unit_offset": True}, "'unit_offset'"),
    ("swiglu", "split", {"layout": "interleaved"}, "'layout'"),
    ("swiglu", "fused", {"layout": "diagonal"}, "'layout'"),
    ("swiglu", "split", {"clamp_style": "post_act"}, "'clamp_style'"),
    ("swiglu", "split", {"limit": 0.0}, "'limit'"),
    ("rope", "half", {"rotary_dim": 7}, "'rotary_dim'"),
    ("rope", "half", {"rotary_dim": 64, "head_dim": 32}, "'rotary_dim'"),
    ("rope", "half", {"head_dim": True}, "'head_dim'"),
    ("conv1d", "causal", {"kernel_size": 9}, "'kernel_size'"),
    ("conv1d", "causal", {"kernel_size": None}, "'kernel_size'"),
    ("conv1d", "causal", {"activation": "gelu"}, "'activation'"),
]


@pytest.mark.parametrize("family,variant,params,needle", BAD, ids=[f"{b[0]}-{b[1]}-{b[3]}" for b in BAD])
def test_bad_params_raise_input_error_and_write_nothing(tmp_path, family, variant, params, needle):
    with pytest.raises(InputError, match=needle):
        templating.render_to(tmp_path, family, variant, params)
    assert list(tmp_path.iterdir()) == []


def test_write_module_refuses_different_content(tmp_path):
    path = tmp_path / "rmsnorm" / "plain.py"
    a = templating.render("rmsnorm", "plain")
    b = templating.render("rmsnorm", "plain", {"unit_offset": True})
    assert templating.write_module(a, path) == path
    assert templating.write_module(a, path) == path  # identical content: no-op
    with pytest.raises(InputError, match="overwrite=True"):
        templating.write_module(b, path)
    assert path.read_text() == a
    templating.write_module(b, path, overwrite=True)
    assert path.read_text() == b
    assert not (tmp_path / "rmsnorm" / "__init__.py").exists()
    assert [p.name for p in path.parent.iterdir()] == ["plain.py"]  # no temp files left
    with pytest.raises(InputError, match=".py"):
        templating.write_module(a, tmp_path / "x.txt")


def test_module_path_layout(tmp_path):
    assert templating.module_path(tmp_path, "rope", "half") == tmp_path / "rope" / "half.py"
    with pytest.raises(InputError):
        templating.module_path(tmp_path, "rope", "../evil")


def _our_kernels_modules() -> list[str]:
    """Modules named `kernels` or `kernels.*` imported from this repo's reviewed-kernels folder."""
    ours = (ROOT / "kernels").resolve()
    found = []
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "kernels" or name.startswith("kernels.")):
            continue
        places = [getattr(mod, "__file__", None), *list(getattr(mod, "__path__", None) or [])]
        if any(p and (Path(p).resolve() == ours or ours in Path(p).resolve().parents) for p in places):
            found.append(name)
    return found


def test_load_module_by_path_under_private_name(tmp_path):
    """Rendered modules load under `onboard_kernels.*`, never as `kernels`: that is the Hugging
    Face kernel hub's package (transformers 5.25 requires it and imports it with its
    integrations), and this repo's `kernels/` folder of reviewed modules must not stand in for
    it nor be imported under that name."""
    hub_before = sys.modules.get("kernels")
    path = templating.render_to(tmp_path, "swiglu", "split", {"limit": 3.0})
    module = templating.load_module(path)
    assert module.__name__.startswith("onboard_kernels.swiglu.split_")
    assert module.PARAMS == get_family("swiglu").resolve("split", {"limit": 3.0})
    assert module.TEMPLATE == "swiglu/swiglu.py.j2" and module.TEMPLATE_VERSION == 2
    # the loader registered no `kernels`: that entry is what it was (absent, or the hub's)
    assert sys.modules.get("kernels") is hub_before
    assert not _our_kernels_modules()
    reviewed = sorted((ROOT / "kernels").glob("*/*.py"))
    if reviewed:  # a reviewed module loads by path under the private name too
        assert templating.load_module(reviewed[0]).__name__.startswith("onboard_kernels.")
        assert sys.modules.get("kernels") is hub_before and not _our_kernels_modules()
    # same content (another path) -> the same module: custom ops register once per process
    copy = tmp_path / "other" / "split.py"
    templating.write_module(path.read_text(), copy)
    assert templating.load_module(copy) is module
    with pytest.raises(InputError, match="no rendered module"):
        templating.load_module(tmp_path / "missing.py")


def test_rendered_config_api(tmp_path):
    # params used by no other test: modules are shared per content, and kernel tests pin configs
    module = templating.load_module(templating.render_to(tmp_path, "rmsnorm", "l2norm", {"eps": 1e-3}))
    assert module.shape_bucket(100) == "d_le_512"
    bucket = {"BLOCK_N": 2, "num_warps": 8, "BWD_BLOCK_N": 2, "bwd_warps": 8, "programs_per_sm": 2}
    assert module.config_for(4096) == bucket
    module.set_config({"BLOCK_N": 4}, bucket="d_le_4k")  # the rest: the bucket's own values
    assert module.config_for(4096) == {**bucket, "BLOCK_N": 4}
    module.set_config({"num_warps": 1})  # all shapes, over the bucket pin
    assert module.config_for(4096) == {**bucket, "BLOCK_N": 4, "num_warps": 1}
    module.set_config(None)
    module.set_config(None, bucket="d_le_4k")
    with pytest.raises(ValueError, match="BLOCK_N"):
        module.set_config({"BLOCK_N": 3})


def test_family_configs_are_in_their_tuning_space():
    for f in FAMILIES:
        f.check_config(f.default_config)
        with pytest.raises(InputError, match="unknown config"):
            f.check_config({"BLOCK_Q": 1})


def test_py_literal_is_sorted_and_exact():
    from onboarding.families.render import py_literal

    assert py_literal({"b": 1, "a": [1.5, None, True], "c": (2,)}) == "{'a': [1.5, None, True], 'b': 1, 'c': (2,)}"
    with pytest.raises(ValueError):
        py_literal(float("inf"))


def _block(kind, attrs, class_name="X", params=None):
    return Block(path="model.layers.0.x", kind=kind, layer=0, class_name=class_name, attrs=attrs,
                 params=params or {})


MATCHES = [
    (_block("norm.rms", {"dim": 64, "eps": 1e-5, "unit_offset": False, "has_weight": True}),
     "rmsnorm", {"variant": "plain", "params": get_family("rmsnorm").resolve("plain", {"eps": 1e-5})}),
    (_block("norm.rms", {"dim": 64, "eps": None, "unit_offset": True, "has_weight": True}),
     "rmsnorm", {"variant": "plain", "params": get_family("rmsnorm").resolve("plain", {"unit_offset": True})}),
    (_block("norm.rms_gated", {"dim": 64, "eps": 1e-6, "unit_offset": False, "has_weight": True}),
     "rmsnorm", {"variant": "gated", "params": get_family("rmsnorm").resolve("gated")}),
    # a weightless mean-RMSNorm (Gemma 4's v_norm) is `plain` rendered without a weight
    (_block("norm.rms", {"dim": 64, "eps": 1e-6, "has_weight": False}),
     "rmsnorm", {"variant": "plain", "params": get_family("rmsnorm").resolve("plain", {"has_weight": False})}),
    (_block("norm.layer", {}), "rmsnorm", None),
    (_block("mlp.dense", {"activation": "silu", "gated": True, "clamp": None}),
     "swiglu", {"variant": "split", "params": get_family("swiglu").resolve("split")}),
    (_block("mlp.dense", {"activation": "gelu", "gated": True, "clamp": None}), "swiglu", None),
    (_block("mlp.dense", {"activation": "silu", "gated": False, "clamp": None}), "swiglu", None),
    (_block("moe.shared_expert", {"activation": "silu", "gated": True, "clamp": 7.0}), "swiglu", None),
    # A class name is no evidence: without a structural clamp style the block stays uncovered.
    (_block("mlp.dense", {"activation": "silu", "gated": True, "clamp": 7.0}, "GptOssMLP",
            {"gate_up": [64, 32], "down": [32, 32]}), "swiglu", None),
    (_block("mlp.dense", {"activation": "silu", "gated": True, "clamp": 7.0,
                          "clamp_style": "pre_act", "alpha": 1.702, "up_offset": 1.0,
                          "gate_up_layout": "interleaved"}, "AnyMLP",
            {"gate_up": [64, 32], "down": [32, 32]}),
     "swiglu", {"variant": "fused", "params": {"alpha": 1.702, "clamp_style": "pre_act", "layout": "interleaved",
                                               "limit": 7.0, "up_offset": 1.0}}),
    (_block("rope", {"layout": "half", "rotary_dim": 32, "head_dim": 64}),
     "rope", {"variant": "half", "params": {"head_dim": 64, "rotary_dim": 32},
              "note": family_module("rope").NOTE}),
    (_block("rope", {"layout": "yarn-2d", "rotary_dim": 32, "head_dim": 64}), "rope", None),
    (_block("conv.causal1d", {"channels": 96, "kernel_size": 4, "activation": "silu"}),
     "conv1d", {"variant": "causal", "params": {"activation": "silu", "kernel_size": 4}}),
    (_block("conv.causal1d", {"channels": 96, "kernel_size": 4, "activation": "gelu"}), "conv1d", None),
    (_block("conv.causal1d", {"channels": 96, "kernel_size": 16, "activation": None}), "conv1d", None),
]


@pytest.mark.parametrize("block,family,expected", MATCHES, ids=[f"{m[0].kind}-{m[1]}-{i}" for i, m in enumerate(MATCHES)])
def test_match(block, family, expected):
    spec = get_family(family)
    assert spec.match(block) == expected
    claimed = [name for name, _ in match_block(block)]
    if expected:
        assert claimed == [family]  # no other family claims it
    else:
        assert family not in claimed


def test_match_result_renders():
    block = _block("norm.rms_gated", {"dim": 64, "eps": 1e-6, "unit_offset": True, "has_weight": True})
    (family, m), = match_block(block)
    assert "(1 + w)" in templating.render(family, m["variant"], m["params"])


# ---- onboarding.testing.tolerance (shared with layer-wise alignment) ----------------------


def test_compare_pass_fail_and_messages():
    tol = tolerance_for(torch.float32)
    b = torch.randn(8, 8)
    assert compare(b + 1e-7, b, tol).passed
    bad = b.clone()
    bad[3, 4] += 1.0
    res = compare(bad, b, tol, "out")
    assert not res.passed and "(3, 4)" in res.message and "rel_rms" in res.message
    nan = b.clone()
    nan[1, 2] = float("nan")
    res = compare(nan, b, tol, "out")
    assert not res.passed and "non-finite" in res.message and "(1, 2)" in res.message
    assert not compare(b[:4], b, tol).passed
    # expected ~0 (a gradient that cancels): the absolute floor applies
    assert compare(torch.full((4,), 1e-9), torch.full((4,), 2e-9), tol).passed


def test_tolerance_lookup():
    assert tolerance_for("bf16", "layer") == tolerance_for(torch.bfloat16, "layer")
    assert isinstance(tolerance_for(torch.float16), Tolerance)
    assert tolerance_for(torch.float32).max_rel_rms < tolerance_for(torch.float16).max_rel_rms
    with pytest.raises(ValueError):
        tolerance_for(torch.float32, "whatever")


def test_an_edited_module_gets_its_own_op_name(tmp_path):
    """Two sources that render one op name (an edited or re-rendered module) in one process:
    torch would replace the first one's custom op and leave it calling a destroyed op (a test
    run crashed with a garbled op name); the second gets a name of its own."""
    first = templating.load_module(templating.render_to(tmp_path / "a", "rmsnorm", "plain", {"eps": 3e-5}))
    path = templating.render_to(tmp_path / "b", "rmsnorm", "plain", {"eps": 3e-5})
    path.write_text(path.read_text() + "\nEDITED = True\n")
    second = templating.load_module(path)
    assert second.EDITED and second.OP_NAME.startswith(first.OP_NAME + "_")
    x, w = torch.randn(3, 64), torch.rand(64)
    for module in (first, second):
        torch.testing.assert_close(module.entry(x, w), module.reference(x, w))
    assert templating.load_module(path) is second  # cached by content, named once


def test_generate_fails_a_candidate_that_returns_fewer_outputs(tmp_path, monkeypatch):
    """`check_candidate` counts outputs before pairing them with the reference's. The router
    returns (logits, weights, indices, counts); a candidate that drops the counts (no gradient
    to miss) passed on the other three while zip stopped at the shorter side. Now it fails,
    with both counts named."""
    from onboarding.generate import candidates as generate

    path = tmp_path / "moe_router" / "softmax.py"
    templating.write_module(templating.render("moe_router", "softmax", {}), path)

    def candidate():
        return generate.Candidate(family="moe_router", variant="softmax", params={},
                                  path=str(path))

    full = generate.check_candidate(candidate(), [[37, 32]])
    assert full.status == "passed", full.error or full.checks
    assert [c["name"] for c in full.checks if ".out" in c["name"]] == [
        "sample.out0", "sample.out1", "sample.out2", "sample.out3"]

    real = generate.entry_function
    monkeypatch.setattr(generate, "entry_function",
                        lambda mod: (lambda *a: real(mod)(*a)[:3]))  # no counts
    short = generate.check_candidate(candidate(), [[37, 32]])
    assert short.status == "failed" and short.error == ""
    assert short.checks == [{"name": "sample.outputs", "passed": False,
                             "message": "candidate returned 3 outputs, the reference 4"}]


def test_one_source_loaded_by_two_threads_at_once_is_one_module(tmp_path, monkeypatch):
    """A run's studies start at once and load their modules on their own threads: two loads of
    one source in flight together give one module (before, both missed the cache, and the
    second's custom op registration destroyed the first's). The import is slowed so that the
    two loads overlap whatever the scheduler does."""
    import importlib.util
    import threading
    import time

    path = templating.render_to(tmp_path, "rmsnorm", "plain")
    path.write_text(path.read_text() + "\n# a source no other test loads\n")
    real = importlib.util.module_from_spec

    def slow(spec):
        time.sleep(0.2)
        return real(spec)

    monkeypatch.setattr(importlib.util, "module_from_spec", slow)
    got = []
    threads = [threading.Thread(target=lambda: got.append(templating.load_module(path)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 2 and got[0] is got[1]
    from onboarding.patching.core import entry_function

    x, w = torch.randn(3, 8), torch.rand(8) + 0.5  # its custom op alive and right
    torch.testing.assert_close(entry_function(got[0])(x, w), got[0].reference(x, w))
