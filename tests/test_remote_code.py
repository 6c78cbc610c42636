"""Remote code written for transformers 4.x (issue 26, items 2 and 5): the compatibility layer
(`onboarding.load.compat`), failures inside remote code named by file:line and targeted version,
`auto_map` checks, and the shipped safetensors (`onboarding.load.weights`).

The fixture `tests/fixtures/remote_v4` is a 4.x-style repo of our own; the broken variants are
copies under tmp_path, each in a directory of its own name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from onboarding.cli.main import main

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "remote_v4"
MODELING = "modeling_oldlm.py"


def _copy(tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURE, dst, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def _edit(path: Path, old: str, new: str) -> int:
    """Replace ``old`` (once) in ``path``; returns the 1-based line where ``new`` starts."""
    text = path.read_text()
    assert text.count(old) == 1, old
    at = text.index(old)
    path.write_text(text.replace(old, new))
    return text[:at].count("\n") + 1


def _run(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    cap = capsys.readouterr()
    return code, " ".join((cap.out + cap.err).split())  # rich wraps long lines


def _state(directory: Path) -> dict[str, torch.Tensor]:
    from onboarding.load.model import load_model

    loaded = load_model(str(directory), trust_remote_code=True)
    model = loaded.build(seed=123)
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------------------
# the compatibility layer


def test_scan_finds_the_4x_names(tmp_path):
    from onboarding.load.compat import scan_remote_code

    uses = scan_remote_code(FIXTURE)
    assert ("transformers.modeling_attn_mask_utils", "_prepare_4d_causal_attention_mask") \
        in uses.imports
    assert uses.attrs["get_usable_length"].startswith(MODELING + ":")
    assert uses.attrs["rope_scaling"].startswith(MODELING + ":")  # a read, not the config's store


def test_attention_mask_shim_matches_a_causal_padding_mask():
    from onboarding.load.compat import _prepare_4d_causal_attention_mask

    emb = torch.zeros(2, 4, 8)
    pad = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    mask = _prepare_4d_causal_attention_mask(pad, (2, 4), emb, 0)
    assert mask.shape == (2, 1, 4, 4)
    allowed = mask == 0
    causal = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    assert torch.equal(allowed[0, 0], causal)
    assert torch.equal(allowed[1, 0], causal & torch.tensor([False, True, True, True]))
    # with a past: the new queries see every past key
    mask = _prepare_4d_causal_attention_mask(None, (1, 2), emb, 3)
    assert mask.shape == (1, 1, 2, 5) and bool((mask[0, 0, 0, :4] == 0).all())
    assert mask[0, 0, 0, 4] < 0


MASK_MODULE = "transformers.modeling_attn_mask_utils"


def _installed(module: str) -> bool:
    """Whether the installed transformers ships ``module`` (its file: whatever onboard's
    compatibility layer put in ``sys.modules``)."""
    import importlib
    import importlib.machinery

    parent, _, _ = module.rpartition(".")
    return importlib.machinery.PathFinder.find_spec(module, importlib.import_module(parent).__path__) \
        is not None


def _lacks(module: str, name: str) -> bool:
    """Whether the installed transformers lacks ``module.name``: a module it does not ship, or a
    name it does not define (what onboard supplied, recorded in `compat._INSTALLED`, does not
    count). The attention-mask module, where shipped, defines every 4.x helper."""
    import importlib

    from onboarding.load import compat

    if not _installed(module):
        return True
    if module == MASK_MODULE:
        return False
    return not hasattr(importlib.import_module(module), name) or (module, name) in compat._INSTALLED


def test_without_the_layer_the_fixture_fails_at_import():
    """The fixture really needs the shims: the installed transformers lacks names it imports
    (up to 5.24 the whole attention-mask module; 5.25 brought that module back, deprecated, but
    not `SinkCache`, `is_torch_fx_available` or `PretrainedConfig` in modeling_utils)."""
    from onboarding.load.compat import scan_remote_code

    imports = scan_remote_code(FIXTURE).imports
    missing = sorted(f"{m}.{n}" for (m, n) in imports if m.startswith("transformers") and _lacks(m, n))
    assert "transformers.cache_utils.SinkCache" in missing
    assert (f"{MASK_MODULE}._prepare_4d_causal_attention_mask" in missing) is not _installed(MASK_MODULE)


def test_v4_fixture_parses_with_its_shims_listed(tmp_path, capsys):
    out = tmp_path / "out"
    code, text = _run(capsys, "parse", str(FIXTURE), "--trust-remote-code", "--out", str(out))
    assert code == 0, text
    assert "compatibility shims" in text and "_prepare_4d_causal_attention_mask" in text
    shims = json.loads((out / "model.json").read_text())["compat_shims"]
    names = {s["name"] for s in shims}
    # the 4.x mask helpers are supplied where the module is gone (up to 5.24) and where the
    # installed one, 5.25's deprecated copy, cannot build float64 masks (the reference's dtype)
    mask = next(s for s in shims if s["name"] == f"{MASK_MODULE}._prepare_4d_causal_attention_mask")
    assert ("float64" in mask["why"]) is _installed(MASK_MODULE), mask
    assert {"transformers.cache_utils.Cache.from_legacy_cache",
            "transformers.cache_utils.Cache.get_usable_length",
            "config.rope_scaling",
            "transformers.modeling_utils.PretrainedConfig",  # moved: re-exported
            "transformers.cache_utils.SinkCache"} <= names  # removed: a stand-in
    assert all(s["why"] and ":" in s["used_at"] for s in shims)
    graph = json.loads((out / "opgraph.json").read_text())
    kinds = {b["kind"] for b in graph["blocks"]}
    assert {"attention.full", "mlp.dense"} <= kinds


def test_native_models_record_no_shims(tmp_path, capsys):
    out = tmp_path / "out"
    code, text = _run(capsys, "parse", "tiny_dense", "--out", str(out))
    assert code == 0, text
    assert json.loads((out / "model.json").read_text())["compat_shims"] == []


@pytest.mark.slow
def test_v4_fixture_aligns_with_shipped_weights_and_shims_in_the_report(tmp_path, capsys,
                                                                        monkeypatch):
    """Must show: a 4.x-style repo parses and aligns, its shims listed in model.json and the
    report; the safetensors it ships are what align runs."""
    from safetensors.torch import save_file

    import onboarding.stages as stages
    from onboarding.report import build_report

    repo = _copy(tmp_path, "oldlm_weights")
    state = _state(repo)
    save_file(state, str(repo / "model.safetensors"))
    loaded_into: list[dict] = []
    real = stages.load_shipped_weights

    def spy(model, info):
        n = real(model, info)
        loaded_into.append({k: v.clone() for k, v in model.state_dict().items()})
        return n

    monkeypatch.setattr(stages, "load_shipped_weights", spy)
    out = tmp_path / "run"
    code, text = _run(capsys, "align", str(repo), "--trust-remote-code", "--out", str(out))
    assert code == 0, text
    assert loaded_into and all(torch.equal(loaded_into[0][k], v) for k, v in state.items())
    report = build_report(out, title="remote v4").read_text()
    assert "compatibility shims" in report
    assert "_prepare_4d_causal_attention_mask" in report and "config.rope_scaling" in report


# ---------------------------------------------------------------------------------------------
# failures inside remote code: file:line, targeted version, PyPI names; nothing left behind


def test_raise_at_import_names_file_line_and_version(tmp_path, capsys):
    repo = _copy(tmp_path, "oldlm_import_raise")
    line = _edit(repo / MODELING, "logger = logging.get_logger(__name__)\n",
                 "raise RuntimeError('vendor setup failed')\n")
    out = tmp_path / "out"
    code, text = _run(capsys, "parse", str(repo), "--trust-remote-code", "--out", str(out))
    assert code == 2
    assert f"{MODELING}:{line}" in text and "vendor setup failed" in text
    assert "transformers 4.46.0" in text
    assert not out.exists()


def test_raise_in_forward_names_file_line_and_version(tmp_path, capsys):
    repo = _copy(tmp_path, "oldlm_forward_raise")
    line = _edit(repo / MODELING, "        hidden_states = self.norm(hidden_states)\n",
                 "        raise ValueError('vendor forward failed')\n")
    out = tmp_path / "out"
    code, text = _run(capsys, "align", str(repo), "--trust-remote-code", "--out", str(out))
    assert code == 2
    assert f"{MODELING}:{line}" in text and "vendor forward failed" in text
    assert "in forward" in text and "transformers 4.46.0" in text
    assert not out.exists()


def test_missing_packages_are_named_by_their_pypi_names(tmp_path, capsys):
    repo = _copy(tmp_path, "oldlm_missing_pkg")
    line = _edit(repo / MODELING, "from .configuration_oldlm import OldLMConfig\n",
          "from .configuration_oldlm import OldLMConfig\n"
          "from fla.modules import FusedRMSNormGated\nimport causal_conv1d\n")
    code, text = _run(capsys, "parse", str(repo), "--trust-remote-code")
    assert code == 2
    assert "pip install flash-linear-attention" in text and "pip install causal-conv1d" in text
    assert "pip install fla " not in text + " "
    assert f"{MODELING}:{line + 1}" in text or f"{MODELING}:{line + 2}" in text  # an import line
    assert "transformers 4.46.0" in text
    if not torch.cuda.is_available():
        assert "causal-conv1d needs a CUDA GPU" in text


def test_guarded_cuda_imports_take_the_codes_own_path(tmp_path, capsys):
    """A CUDA-only package imported under try/except (the usual 4.x pattern) is not required:
    the code falls back to its own eager path and parses."""
    repo = _copy(tmp_path, "oldlm_guarded_flash")
    _edit(repo / MODELING, "from .configuration_oldlm import OldLMConfig\n",
          "from .configuration_oldlm import OldLMConfig\n"
          "try:\n    from flash_attn import flash_attn_func\nexcept ImportError:\n"
          "    flash_attn_func = None\n")
    code, text = _run(capsys, "parse", str(repo), "--trust-remote-code")
    assert code == 0, text


def test_pypi_names():
    from onboarding.load.compat import pypi_name

    assert pypi_name("fla.ops.kda") == "flash-linear-attention"
    assert pypi_name("flash_attn") == "flash-attn"
    assert pypi_name("mamba_ssm") == "mamba-ssm"
    assert pypi_name("causal_conv1d") == "causal-conv1d"


@pytest.mark.parametrize("entry,expect", [
    ("modeling_gone.OldLMForCausalLM", "has no modeling_gone.py"),
    ("modeling_oldlm.NoSuchClass", "defines no NoSuchClass"),
])
def test_auto_map_pointing_nowhere(tmp_path, capsys, entry, expect):
    repo = _copy(tmp_path, "oldlm_automap_" + entry.split(".")[-1].lower())
    cfg = json.loads((repo / "config.json").read_text())
    cfg["auto_map"]["AutoModelForCausalLM"] = entry
    (repo / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    code, text = _run(capsys, "parse", str(repo), "--trust-remote-code", "--out", str(out))
    assert code == 2
    assert expect in text and "AutoModelForCausalLM" in text
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# shipped weights


def test_weights_of_other_shapes_are_named(tmp_path, capsys):
    from safetensors.torch import save_file

    repo = _copy(tmp_path, "oldlm_bad_shapes")
    state = _state(repo)
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(16, 32)
    state["model.extra.weight"] = torch.zeros(3)
    save_file(state, str(repo / "model.safetensors"))
    out = tmp_path / "out"
    code, text = _run(capsys, "align", str(repo), "--trust-remote-code", "--out", str(out))
    assert code == 2
    assert "do not fit" in text
    assert "model.layers.1.mlp.up_proj.weight (checkpoint [16, 32], model [64, 32])" in text
    assert "model.extra.weight" in text
    assert not out.exists()


def test_weights_missing_a_parameter_are_named(tmp_path):
    from onboarding.load.weights import check_fit

    from onboarding.load.model import load_model

    model = load_model(str(FIXTURE), trust_remote_code=True).build()
    state = dict(model.state_dict())
    del state["lm_head.weight"]
    problems = check_fit(model, state)
    assert problems and "lm_head.weight" in problems[0] and "missing" in problems[0]


def test_truncated_safetensors(tmp_path, capsys):
    from safetensors.torch import save_file

    repo = _copy(tmp_path, "oldlm_truncated")
    file = repo / "model.safetensors"
    save_file(_state(repo), str(file))
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    out = tmp_path / "out"
    code, text = _run(capsys, "align", str(repo), "--trust-remote-code", "--out", str(out))
    assert code == 2
    assert "model.safetensors" in text and "truncated or corrupt" in text
    assert not out.exists()


def test_checkpoint_entries_transformers_skips_are_not_mismatches():
    """An old checkpoint's rotary inv_freq (a non-persistent buffer now) is skipped, not an
    unexpected key."""
    from onboarding.load.model import load_model
    from onboarding.load.weights import check_fit

    model = load_model(str(FIXTURE), trust_remote_code=True).build()
    state = dict(model.state_dict())
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    assert check_fit(model, state) == []


@pytest.mark.parametrize("damage", ["shape", "truncated"])
def test_train_refuses_unfit_weights_before_writing(tmp_path, capsys, monkeypatch, damage):
    from safetensors.torch import save_file

    monkeypatch.chdir(tmp_path)
    repo = _copy(tmp_path, f"oldlm_train_{damage}")
    state = _state(repo)
    if damage == "shape":
        state["lm_head.weight"] = torch.zeros(5, 32)
    file = repo / "model.safetensors"
    save_file(state, str(file))
    if damage == "truncated":
        file.write_bytes(file.read_bytes()[:-100])
    out = tmp_path / "run"
    code, text = _run(capsys, "train", str(repo), "--trust-remote-code", "--steps", "1",
                      "--out", str(out))
    assert code == 2
    assert ("lm_head.weight (checkpoint [5, 32], model [256, 32])" if damage == "shape"
            else "truncated or corrupt") in text
    assert not out.exists() and not (tmp_path / "runs").exists()


def test_shipped_weights_that_fit_pass_the_preflight(tmp_path):
    from safetensors.torch import save_file

    from onboarding.graph.parse import load_stage
    from onboarding.load.model import load_model
    from onboarding.load.weights import check_shipped

    repo = _copy(tmp_path, "oldlm_fit")
    save_file(_state(repo), str(repo / "model.safetensors"))
    info = load_stage(load_model(str(repo), trust_remote_code=True))
    assert info.proxy_note.startswith("full size")
    check_shipped(info)  # raises on a mismatch


def test_raise_in_the_remote_config_names_file_line_and_version(tmp_path, capsys):
    repo = _copy(tmp_path, "oldlm_config_raise")
    line = _edit(repo / "configuration_oldlm.py", "        self.vocab_size = vocab_size\n",
                 "        raise KeyError('vendor config failed')\n")
    code, text = _run(capsys, "parse", str(repo), "--trust-remote-code")
    assert code == 2
    assert f"configuration_oldlm.py:{line}" in text and "vendor config failed" in text
    assert "reading the config" in text and "transformers 4.46.0" in text


def test_rope_scaling_reads_as_in_4x():
    """None when unscaled; a scaled one keeps its 4.x 'type' key."""
    from onboarding.load.compat import _rope_scaling_v4

    class Cfg:
        rope_parameters = {"rope_type": "default", "rope_theta": 1e4}

    assert _rope_scaling_v4(Cfg()) is None
    Cfg.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    assert _rope_scaling_v4(Cfg())["type"] == "linear"


def test_shims_come_from_what_the_code_imports(tmp_path):
    """The list is derived from the code and the installed transformers: a per-model attention
    class becomes the one class, a removed probe answers True, a name that moved is re-exported;
    a name the installed transformers still has gets no shim."""
    import importlib

    from onboarding.load.compat import install_shims

    (tmp_path / "modeling_probe.py").write_text(
        "from transformers.models.llama.modeling_llama import LlamaSdpaAttention, "
        "LlamaFlashAttention2, LlamaRMSNorm\n"
        "from transformers.utils import is_torch_sdpa_available, logging\n"
        "from transformers.modeling_utils import PretrainedConfig\n")
    shims = {s["name"]: s for s in install_shims(tmp_path)}
    llama = importlib.import_module("transformers.models.llama.modeling_llama")
    for name in ("LlamaSdpaAttention", "LlamaFlashAttention2"):
        assert f"transformers.models.llama.modeling_llama.{name}" in shims
        assert getattr(llama, name) is llama.LlamaAttention
    assert shims["transformers.utils.is_torch_sdpa_available"]["used_at"] == "modeling_probe.py:2"
    assert importlib.import_module("transformers.utils").is_torch_sdpa_available() is True
    assert "transformers.modeling_utils.PretrainedConfig" in shims
    assert not any(n.endswith(("LlamaRMSNorm", ".logging")) for n in shims)


# ---------------------------------------------------------------------------------------------
# --impl native|remote: remote code for a model_type transformers implements


def _as_llama(tmp_path: Path, name: str) -> Path:
    """The fixture declared as model_type llama: its parameter names are Llama's."""
    repo = _copy(tmp_path, name)
    cfg = json.loads((repo / "config.json").read_text())
    cfg["model_type"] = "llama"
    (repo / "config.json").write_text(json.dumps(cfg))
    _edit(repo / "configuration_oldlm.py", 'model_type = "oldlm"', 'model_type = "llama"')
    return repo


def test_impl_native_when_names_and_shapes_agree(tmp_path, capsys):
    repo = _as_llama(tmp_path, "oldlm_as_llama")
    code, text = _run(capsys, "parse", str(repo))
    assert code == 2 and "--impl native" in text  # the refusal says there is a native one
    out = tmp_path / "out"
    code, text = _run(capsys, "parse", str(repo), "--trust-remote-code", "--impl", "native",
                      "--out", str(out))
    assert code == 0, text
    model = json.loads((out / "model.json").read_text())
    assert "native" in model["impl_note"] and model["compat_shims"] == []
    out2 = tmp_path / "out2"
    code, text = _run(capsys, "parse", str(repo), "--trust-remote-code", "--out", str(out2))
    assert code == 0, text
    assert "--impl native" in json.loads((out2 / "model.json").read_text())["impl_note"]


def test_impl_native_refused_when_the_remote_model_differs(tmp_path, capsys):
    repo = _as_llama(tmp_path, "oldlm_as_llama_renamed")
    _edit(repo / MODELING, "        self.up_proj = nn.Linear(", "        self.w3 = nn.Linear(")
    _edit(repo / MODELING, "self.act_fn(self.gate_proj(x)) * self.up_proj(x)",
          "self.act_fn(self.gate_proj(x)) * self.w3(x)")
    code, text = _run(capsys, "parse", str(repo), "--trust-remote-code", "--impl", "native")
    assert code == 2
    assert "does not match the model's own code" in text and "mlp.w3.weight" in text
    assert "--impl remote" in text


def test_impl_native_without_a_native_model_type(capsys):
    code, text = _run(capsys, "parse", str(FIXTURE), "--trust-remote-code", "--impl", "native")
    assert code == 2 and "model_type 'oldlm' has no causal-LM implementation" in text
