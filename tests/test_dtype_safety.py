"""`onboarding.train.dtype_safety`: a dtype mismatch raised by the model's own code in bf16
training is named as the model's, with what to do; anything else is left as it is."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from onboarding.train.dtype_safety import dtype_failure

# a model's block that builds its own float32 decay and multiplies 16-bit scores by it, as
# transformers' MiniMax lightning attention does
MODEL_CODE = '''
import torch

def attention(scores):
    decay = torch.exp(-torch.arange(scores.shape[-1], dtype=torch.float32))
    return torch.matmul(scores, torch.diag(decay))

def other(scores):
    raise RuntimeError("CUDA out of memory")
'''


def _load(tmp_path: Path, subdir: str, name: str = "modeling_toy"):
    """MODEL_CODE at ``tmp_path/subdir``, imported as module ``name`` (what tells onboard's code
    from the model's is the module a frame runs in, not the file's folder)."""
    path = tmp_path / subdir / "modeling_toy.py"
    path.parent.mkdir(parents=True)
    path.write_text(MODEL_CODE)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, path


def _raised(fn) -> BaseException:
    with pytest.raises((RuntimeError, TypeError)) as info:
        fn(torch.ones(2, 3, dtype=torch.bfloat16))
    return info.value


def test_the_models_own_mismatch_is_named(tmp_path):
    mod, path = _load(tmp_path, "model")
    exc = _raised(mod.attention)
    note = dtype_failure(exc, "bf16", "baseline")
    assert note is not None and str(path) in note and "in attention" in note
    assert "--baseline" in note and "--dtype fp32" in note and "none of onboard's kernels" in note
    other = dtype_failure(exc, "bf16", "reference")
    assert other is not None and "not in onboard's" in other and "--no-kernels" in other


def test_other_failures_are_left_as_they_are(tmp_path):
    mod, _ = _load(tmp_path, "model")
    exc = _raised(mod.attention)
    assert dtype_failure(exc, "fp32", "baseline") is None  # not a 16-bit run
    assert dtype_failure(_raised(mod.other), "bf16", "baseline") is None  # not a dtype mismatch
    assert dtype_failure(ValueError("same dtype"), "bf16", "baseline") is None


@pytest.mark.parametrize("name", ["onboarding.patching.toy", "onboard_kernels.toy.plain_0123",
                                  "onboard_families.toy.binding"])
def test_a_mismatch_raised_in_onboards_code_is_not_blamed_on_the_model(tmp_path, name):
    """onboard's library, a rendered kernel module (run folders, kernels/) and a family folder's
    code are onboard's wherever their files sit."""
    mod, _ = _load(tmp_path, "run/candidates", name)
    assert dtype_failure(_raised(mod.attention), "bf16", "reference") is None


def test_a_model_in_a_folder_named_onboarding_is_the_models(tmp_path):
    mod, path = _load(tmp_path, "onboarding/models")  # e.g. a checkout of this repository
    note = dtype_failure(_raised(mod.attention), "bf16", "baseline")
    assert note is not None and str(path) in note


@pytest.mark.slow  # one `onboard train` launch: about 40 s on 2 busy cores
def test_train_names_a_model_that_cannot_run_in_bf16(tmp_path, capsys):
    """`onboard train --dtype bf16` of a model whose own code mixes dtypes stops with exit 2 and a
    line that names the model's file and line and says what to do. Before: exit 1 and the
    worker's bare traceback."""
    from onboarding.cli.main import main

    model = Path(__file__).resolve().parent / "fixtures" / "bf16_unsafe_models.py"
    rc = main(["train", f"{model}:DecayLM", "--set", "vocab=256", "--nproc", "1", "--steps", "1",
               "--seq", "16", "--lora-rank", "4", "--lora-targets", "up,down", "--device", "cpu",
               "--dtype", "bf16", "--out", str(tmp_path / "run")])
    printed = capsys.readouterr()
    text = " ".join((printed.out + printed.err).split())  # the console wraps long lines
    assert rc == 2, text[-3000:]
    assert "bf16 training failed in the model's own code, not in onboard's" in text, text[-3000:]
    assert "bf16_unsafe_models.py:24 (in forward)" in text and "--dtype fp32" in text
