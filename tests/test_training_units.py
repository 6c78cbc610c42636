"""Training stage, part A: config, data, LoRA, PEFT export and FLOPs (CPU, tiny proxies)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from onboarding.errors import InputError
from onboarding.train.config import TrainConfig
from onboarding.train.data import (BUILTIN_CORPUS, ByteTokenizer, HFTokenizer, PackedData,
                                      load_texts, load_tokenizer)
from onboarding.train.flops import peak_flops, step_flops
from onboarding.train.lora import (LoRALinear, default_targets, inject_lora,
                                      lora_parameters)
from onboarding.train.peft_export import expert_lora_tensors, export_peft


# ---------------------------------------------------------------------------------- config

def test_config_toml_round_trip(tmp_path):
    cfg = TrainConfig(model="hf:qwen3_moe", overrides={"num_experts": 16, "rope.theta": 1e4,
                                                       "layer_types": ["a", "b"]},
                      out=str(tmp_path), nproc=4, ep=2, fsdp=2, steps=7, lr=3e-4,
                      lora_targets=["auto", "gate_*"], expert_lora=True, capacity_factor=1.25,
                      data='we "quote"\\path', dtype="bf16", init_device="device")
    path = cfg.to_toml(tmp_path / "train.toml")
    text = path.read_text()
    assert text.startswith("#") and "fsdp * ep" in text  # the explaining header
    assert TrainConfig.from_toml(path) == cfg
    # None is omitted and comes back as the default
    cfg2 = TrainConfig(model="x", capacity_factor=None, data=None)
    cfg2.to_toml(tmp_path / "b.toml")
    assert "capacity_factor =" not in (tmp_path / "b.toml").read_text()
    assert TrainConfig.from_toml(tmp_path / "b.toml") == cfg2


@pytest.mark.parametrize("change,n_experts,fragment", [
    ({"nproc": 2, "ep": 1, "fsdp": 1}, 8, "nproc=2: world size must equal fsdp * ep"),
    ({"nproc": 3, "ep": 3}, 8, "ep=3: does not divide the model's 8"),
    ({"nproc": 2, "ep": 2}, None, "ep=2: the model has no routed experts"),
    ({"expert_lora": True}, None, "expert_lora=true: the model has no routed experts"),
    ({"capacity_factor": 1.0}, None, "capacity_factor=1.0: the model has no routed"),
    ({"capacity_factor": 0.0}, 8, "capacity_factor=0.0: must be > 0"),
    ({"steps": 0}, None, "steps=0: must be positive"),
    ({"lora_rank": -1}, None, "lora_rank=-1: must be positive"),
    ({"seq_len": 0}, None, "seq_len=0"),
    ({"micro_batch": 0}, None, "micro_batch=0"),
    ({"checkpoint_interval": -1}, None, "checkpoint_interval=-1: must be >= 0"),
    ({"warmup_steps": -2}, None, "warmup_steps=-2"),
    ({"profile_every": -1}, None, "profile_every=-1"),
    ({"lora_dropout": 1.0}, None, "lora_dropout=1.0: must be in [0, 1)"),
    ({"lora_dropout": -0.1}, None, "lora_dropout=-0.1"),
    ({"lr": 0.0}, None, "lr=0.0: must be a finite number > 0"),
    ({"grad_clip": float("nan")}, None, "grad_clip=nan"),
    ({"dtype": "fp16"}, None, "dtype='fp16': expected one of fp32, bf16"),
    ({"device": "tpu"}, None, "device='tpu'"),
    ({"init_device": "gpu"}, None, "init_device='gpu': expected one of cpu, device"),
    ({"proxy": "huge"}, None, "proxy='huge'"),
    ({"lora_targets": []}, None, "lora_targets=[]"),
    ({"out": "relative/dir"}, None, "out='relative/dir': must be an absolute path"),
    ({"steps": 2.5}, None, "steps=2.5: expected an integer"),
    ({"expert_lora": "yes"}, 8, "expert_lora='yes'"),
], ids=lambda v: str(v)[:40] if not isinstance(v, dict) else ",".join(v))
def test_config_validation_errors(change, n_experts, fragment):
    cfg = TrainConfig(model="hf:qwen3_moe", **change)
    with pytest.raises(InputError) as exc:
        cfg.validate(n_experts=n_experts)
    assert fragment in str(exc.value)


def test_config_valid_layouts_pass():
    TrainConfig(model="m", nproc=4, ep=2, fsdp=2).validate(n_experts=8)
    TrainConfig(model="m", nproc=2, fsdp=2).validate(n_experts=None)


@pytest.mark.parametrize("text,fragment", [
    ('model = "m"\nstepz = 3\n', "unknown field(s) stepz"),
    ('steps = 3\n', "missing field 'model'"),
    ('model = "m"\nsteps = "3"\n', "steps='3': expected an integer"),
    ('model = "m"\nsteps = \n', "malformed TOML"),
])
def test_config_from_toml_errors(tmp_path, text, fragment):
    (tmp_path / "t.toml").write_text(text)
    with pytest.raises(InputError, match=None) as exc:
        TrainConfig.from_toml(tmp_path / "t.toml")
    assert fragment in str(exc.value)


# ------------------------------------------------------------------------------------ data

def test_byte_tokenizer_and_small_vocab_error():
    tok = load_tokenizer(None, 256)
    assert isinstance(tok, ByteTokenizer) and tok.eos_id == 0
    assert tok.encode("é\x00!") == [0xC3, 0xA9, ord("!")]  # NUL is the separator: dropped
    with pytest.raises(InputError, match="vocab_size=255: the byte-level tokenizer needs"):
        load_tokenizer(None, 255)


def _write_tokenizer(d: Path, eos: str = "<|endoftext|>") -> int:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", eos])
    tok.train_from_iterator(["def add(a, b): return a + b", "the quick brown fox"] * 20,
                            trainer)
    tok.save(str(d / "tokenizer.json"))
    return tok.get_vocab_size()


def test_repo_tokenizer_used_when_it_fits(tmp_path):
    n = _write_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path, 512)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == n
    ids = tok.encode("def add(a, b)")
    assert ids and max(ids) < n and tok.eos_id == 1
    # ids beyond the model's (proxy) vocabulary: the byte tokenizer takes over, and says
    # clearly when even that does not fit
    assert n < 256
    with pytest.raises(InputError, match=f"vocab_size={n - 1}: the byte-level tokenizer"):
        load_tokenizer(tmp_path, n - 1)
    # no EOS token to separate packed texts: the byte tokenizer too
    no_eos = tmp_path / "no_eos"
    no_eos.mkdir()
    _write_tokenizer(no_eos, eos="<pad>")
    assert isinstance(load_tokenizer(no_eos, 512), ByteTokenizer)


def test_load_texts_forms_and_errors(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "P1", "response": "R1"}\n\n{"text": "T2"}\n')
    assert load_texts(str(f)) == ["P1\nR1", "T2"]
    f.write_text('{"prompt": "P1"}\n')
    with pytest.raises(InputError, match="d.jsonl:1: expected a 'text' field"):
        load_texts(str(f))
    f.write_text('{"text": "ok"}\n{oops\n')
    with pytest.raises(InputError, match="d.jsonl:2: malformed JSON"):
        load_texts(str(f))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.txt").write_text("bee")
    (tmp_path / "docs" / "a.txt").write_text("ay")
    assert load_texts(str(tmp_path / "docs")) == ["ay", "bee"]
    with pytest.raises(InputError, match="no such file"):
        load_texts(str(tmp_path / "missing.jsonl"))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(InputError, match="expected a .jsonl or .txt"):
        load_texts(str(tmp_path / "x.csv"))


def test_builtin_corpus_loads():
    assert BUILTIN_CORPUS.is_file() and BUILTIN_CORPUS.stat().st_size < 5_000_000
    texts = load_texts(None)
    assert len(texts) > 1000
    assert sum("def " in t for t in texts) > 0.95 * len(texts)
    row = json.loads(BUILTIN_CORPUS.read_text().splitlines()[0])
    assert set(row) == {"prompt", "response", "source"}
    assert row["prompt"] not in row["response"]  # the docstring is the prompt, not in the code


def test_packing_deterministic_and_cycles():
    texts = [f"text number {i} " * (i % 5 + 1) for i in range(60)]
    tok = ByteTokenizer(512)
    a, b = PackedData(texts, tok, 16, seed=3), PackedData(texts, tok, 16, seed=3)
    c = PackedData(texts, tok, 16, seed=4)
    assert a.rows.shape[1] == 17 and (a.rows == tok.eos_id).any()
    for step in range(3):
        assert torch.equal(a.global_batch(step, 4), b.global_batch(step, 4))
    assert not torch.equal(a.global_batch(0, 4), c.global_batch(0, 4))
    # one epoch visits each row once; the next epoch is a different order
    n = len(a)
    epoch0 = torch.cat([a.global_batch(s, 1) for s in range(n)])
    assert sorted(map(tuple, epoch0.tolist())) == sorted(map(tuple, a.rows.tolist()))
    epoch1 = torch.cat([a.global_batch(s, 1) for s in range(n, 2 * n)])
    assert not torch.equal(epoch0, epoch1)
    # ranks' slices of the global batch partition it
    g = a.global_batch(5, 4)
    assert torch.equal(torch.cat([g[r * 2:(r + 1) * 2] for r in range(2)]), g)
    with pytest.raises(InputError, match="fewer than one row"):
        PackedData(["hi"], tok, 64, 0)


# ------------------------------------------------------------------------------------ LoRA

@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from onboarding.train.setup import build

    cache = {}

    def get(ref: str):
        if ref not in cache:
            out = tmp_path_factory.mktemp(ref.replace(":", "_"))
            cache[ref] = build(TrainConfig(model=ref, out=str(out)))
        b = cache[ref]
        return copy.deepcopy(b.model), b.graph, b
    return get


def test_init_device_is_the_training_device_or_the_cpu():
    """`init_device`: "cpu" builds on the CPU whatever the training device; "device" on the one
    the model trains on (here the CPU too, so the same weights as the CPU build)."""
    from onboarding.train.setup import base_model, init_device, model_info

    cfg = TrainConfig(model="hf:qwen3_moe")
    assert init_device(cfg, "cuda:1") == torch.device("cpu")
    on = TrainConfig(model="hf:qwen3_moe", init_device="device")
    assert init_device(on, "cuda:1") == torch.device("cuda:1")
    assert init_device(on, "meta") == torch.device("meta")
    a = base_model(cfg, model_info(cfg))
    b = base_model(on, model_info(on), "cpu")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert next(base_model(on, model_info(on), "meta").parameters()).device.type == "meta"


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("ref,expect,absent", [
    # slow: the first user of the qwen3_next proxy pays for its export (~15-60 s)
    pytest.param("hf:qwen3_next", {"linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba",
                                   "linear_attn.out_proj", "self_attn.q_proj",
                                   "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"},
                 ("mlp", "lm_head"), marks=pytest.mark.slow),
    ("hf:qwen3_moe", {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                      "self_attn.o_proj"}, ("mlp", "lm_head", "gate")),
])
def test_inject_lora_by_structure(built, ref, expect, absent):
    model, graph, b = built(ref)
    assert b.n_experts == b.info.proxy_config.num_experts  # found by structure, as configured
    original = copy.deepcopy(model)
    targets = default_targets(model, graph)
    suffixes = {".".join(t.split(".")[-2:]) for t in targets}
    assert suffixes == expect
    assert not any(a in t.split(".") for t in targets for a in absent)
    wrapped = inject_lora(model, graph, targets=["auto"], rank=4, alpha=8.0, dropout=0.0)
    assert wrapped == targets
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    adapters = {n for n, _ in lora_parameters(model)}
    assert trainable == adapters and len(adapters) == 2 * len(wrapped)
    ids = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_logits(model, ids), _logits(original, ids))  # B = 0 at init
    for n, p in lora_parameters(model):
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    assert not torch.allclose(_logits(model, ids), _logits(original, ids))


def test_inject_lora_patterns_and_errors(built):
    model, graph, _ = built("hf:qwen3_moe")
    wrapped = inject_lora(model, graph, targets=["q_proj", "model.layers.1.self_attn.o_*"],
                          rank=2, alpha=2.0, dropout=0.1)
    assert wrapped == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.o_proj",
                       "model.layers.1.self_attn.q_proj"]
    assert all(isinstance(model.get_submodule(p), LoRALinear) for p in wrapped)
    with pytest.raises(InputError, match="pattern 'nothing_here' matches no nn.Linear"):
        inject_lora(model, graph, targets=["nothing_here"], rank=2, alpha=2.0, dropout=0.0)


def test_lora_same_adapters_from_same_seed():
    base = nn.Linear(8, 6)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    a = LoRALinear(copy.deepcopy(base), rank=3, alpha=6.0, generator=g1)
    b = LoRALinear(copy.deepcopy(base), rank=3, alpha=6.0, generator=g2)
    assert torch.equal(a.lora_A.weight, b.lora_A.weight) and a.scaling == 2.0
    assert not a.base.weight.requires_grad and a.lora_A.weight.dtype == torch.float32


# ------------------------------------------------------------------------------ PEFT export

@pytest.mark.slow  # 17-20 s in CI; the expert adapters' round trips below stay
def test_peft_round_trip_dense(built, tmp_path):
    from peft import PeftModel

    model, graph, _ = built("hf:qwen3_next")
    base = copy.deepcopy(model)
    cfg = TrainConfig(model="hf:qwen3_next", lora_rank=4, lora_alpha=8.0)
    inject_lora(model, graph, targets=["auto"], rank=4, alpha=8.0, dropout=0.0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in lora_parameters(model):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    export_peft(model, cfg, tmp_path, base_model_name_or_path="hf:qwen3_next")
    conf = json.loads((tmp_path / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA" and conf["r"] == 4
    ids = torch.randint(0, 2048, (2, 16), generator=gen)
    ours = _logits(model, ids)
    peft_model = PeftModel.from_pretrained(base, str(tmp_path)).eval()
    theirs = _logits(peft_model, ids)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ours, _logits(built("hf:qwen3_next")[0], ids), atol=1e-4)


@pytest.mark.parametrize("ref", ["hf:qwen3_moe", "hf:nemotron_h"])
def test_peft_round_trip_expert_adapters(built, tmp_path, ref):
    """Per-expert A/B through PEFT's target_parameters equal merging B_e A_e into W_e: SwiGLU
    experts (gate_up [E, 2F, D]) and non-gated ones (up [E, F, D])."""
    from peft import PeftModel

    model, graph, _ = built(ref)
    base = copy.deepcopy(model)
    merged = copy.deepcopy(model)
    r, alpha = 2, 4.0
    inject_lora(model, graph, targets=["q_proj"], rank=r, alpha=alpha, dropout=0.0)
    gen = torch.Generator().manual_seed(2)
    for b in graph.by_kind("moe.experts"):
        experts = model.get_submodule(b.path)
        names = [n for n, p in experts.named_parameters(recurse=False) if p.ndim == 3]
        pairs = {}
        for n in names:
            e, o, i = getattr(experts, n).shape
            a_eri = torch.randn(e, r, i, generator=gen) * 0.1
            b_eor = torch.randn(e, o, r, generator=gen) * 0.1
            pairs[n] = (a_eri, b_eor)
            w = merged.get_submodule(b.path)
            with torch.no_grad():
                getattr(w, n).add_((alpha / r) * torch.bmm(b_eor, a_eri))
        experts.peft_tensors = lambda prefix, p=pairs, ns=names: expert_lora_tensors(
            prefix, [(n, *p[n]) for n in ns])
        experts.peft_target = lambda ns=names: {"target_parameters": ns}
    cfg = TrainConfig(model=ref, lora_rank=r, lora_alpha=alpha, expert_lora=True)
    export_peft(model, cfg, tmp_path, base_model_name_or_path=ref)
    conf = json.loads((tmp_path / "adapter_config.json").read_text())
    assert len(conf["target_parameters"]) == 2 * len(graph.by_kind("moe.experts"))
    ids = torch.randint(0, 2048, (2, 16), generator=gen)
    # ours: q_proj LoRA (B = 0 so far) + experts merged
    merged_lora = copy.deepcopy(merged)
    inject_lora(merged_lora, graph, targets=["q_proj"], rank=r, alpha=alpha, dropout=0.0)
    theirs = _logits(PeftModel.from_pretrained(base, str(tmp_path)).eval(), ids)
    torch.testing.assert_close(theirs, _logits(merged_lora, ids), rtol=1e-5, atol=1e-5)


def test_export_without_adapters_errors(built, tmp_path):
    model, _, _ = built("hf:qwen3_moe")
    with pytest.raises(InputError, match="no LoRA adapters"):
        export_peft(model, TrainConfig(model="m"), tmp_path, base_model_name_or_path="m")


# ----------------------------------------------------------------------------------- FLOPs

def test_flops_lora_correct_and_routed_scaling(built):
    model, graph, b = built("hf:qwen3_moe")
    kw = dict(tokens=512, seq_len=64, lora_rank=8, expert_lora=False)
    f = step_flops(graph, model, **kw)
    assert f["total"] < f["total_6n"] and f["uncounted_blocks"] == 0
    assert f["attention"] > 0 and f["linear_attention"] == 0
    routed = 512 * b.info.proxy_config.num_experts_per_tok * len(graph.by_kind("moe.experts"))
    expected = step_flops(graph, model, routed_tokens=routed, **kw)  # tokens x top-k x layers
    assert expected["base_experts"] == pytest.approx(f["base_experts"])
    double = step_flops(graph, model, routed_tokens=2 * routed, **kw)
    assert double["base_experts"] == pytest.approx(2 * f["base_experts"])
    assert f["expert_adapters"] == 0
    assert step_flops(graph, model, **{**kw, "expert_lora": True})["expert_adapters"] > 0
    # attention grows faster than linearly with the sequence; GEMMs stay per token
    long = step_flops(graph, model, **{**kw, "seq_len": 128})
    assert long["attention"] > 1.8 * f["attention"]
    assert long["base_dense"] == f["base_dense"]
    # injecting rank-8 adapters counts them from the model itself, same number
    inject_lora(model, graph, targets=["auto"], rank=8, alpha=8.0, dropout=0.0)
    assert step_flops(graph, model, **kw)["adapters"] == pytest.approx(f["adapters"])


def test_flops_linear_attention_counted(built):
    model, graph, _ = built("hf:qwen3_next")
    f = step_flops(graph, model, tokens=256, seq_len=128, lora_rank=4, expert_lora=False)
    assert f["linear_attention"] > 0 and f["attention"] > 0 and f["uncounted_blocks"] == 0
    assert peak_flops("cpu") is None


def test_flops_attention_of_a_config_model_unchanged_and_the_same_from_the_graph(built,
                                                                               monkeypatch):
    """A config model's attention FLOPs are the config's widths at the training length (causal:
    a query sees i + 1 keys); the op graph's ``core_widths`` give the same count where no config
    is read (a config-less model's route, `flops.CapturedCore`). Before: none counted there."""
    from onboarding.train import flops

    model, graph, b = built("hf:qwen3_moe")
    cfg = b.info.proxy_config
    kw = dict(tokens=512, seq_len=64, lora_rank=8, expert_lora=False)
    f = step_flops(graph, model, **kw)
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layers = len(graph.by_kind("attention.full"))
    assert layers == cfg.num_hidden_layers
    want = layers * 3 * 2 * cfg.num_attention_heads * (d + d) * (65 / 2) * 512
    assert f["attention"] == pytest.approx(want) and f["uncounted_blocks"] == 0
    monkeypatch.setattr(flops, "model_text_config", lambda m: None)
    hidden = step_flops(graph, model, **kw)
    assert hidden["attention"] == pytest.approx(want) and hidden["uncounted_blocks"] == 0


def test_flops_unchanged_when_experts_are_sharded(built):
    """Expert-parallel ranks hold E/ep experts (+ expert adapters) at the same path: the count
    comes from the op graph, so it neither drops the experts nor counts them as dense."""
    model, graph, _ = built("hf:qwen3_moe")
    kw = dict(tokens=512, seq_len=64, lora_rank=4, expert_lora=True)
    full = step_flops(graph, model, **kw)

    class LocalExperts(nn.Module):
        def __init__(self, src: nn.Module) -> None:
            super().__init__()
            for n, p in src.named_parameters(recurse=False):
                self.register_parameter(n, nn.Parameter(p[: p.shape[0] // 2].clone()))
                self.register_parameter(f"lora_A_{n}", nn.Parameter(
                    torch.zeros(p.shape[0] // 2, 4, p.shape[-1])))

    for b in graph.by_kind("moe.experts"):
        parent, _, attr = b.path.rpartition(".")
        setattr(model.get_submodule(parent), attr, LocalExperts(model.get_submodule(b.path)))
    sharded = step_flops(graph, model, **kw)
    for part in ("base_dense", "base_experts", "expert_adapters", "total"):
        assert sharded[part] == pytest.approx(full[part]), part


# ---------------------------------------------------------------------------------- metrics

def test_cpu_peak_memory_is_in_bytes_and_covers_what_the_process_holds():
    """`peak_memory` on the CPU (the process's max RSS; Linux reports KiB): at least the resident
    set of this moment, a 256 MiB tensor included, and no more than the machine has (a KiB/byte
    slip either way fails). The peak may sit far above the moment's resident set: Linux carries
    it over from the process that forked this one."""
    import os

    if not os.path.exists("/proc/self/statm"):
        pytest.skip("needs Linux's /proc/self/statm for the resident set")
    from onboarding.train.metrics import peak_memory

    page = os.sysconf("SC_PAGE_SIZE")

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    cpu = torch.device("cpu")
    before, rss_before = peak_memory(cpu), resident()
    held = torch.ones(64 * 2**20)  # 256 MiB of fp32, every page written
    rss_held = resident()
    # the set-up (half: other memory of this pytest worker may be released meanwhile; CI at
    # 2db1ba4 saw 64 MiB fall under 0.9 of itself once)
    assert rss_held - rss_before >= 0.5 * held.numel() * held.element_size()
    after = peak_memory(cpu)
    # the kernel's RSS counters are synced lazily: the peak may read a few pages under statm
    assert before <= after and 0.95 * rss_held <= after <= page * os.sysconf("SC_PHYS_PAGES"), \
        (before, rss_held, after)
    del held


# ------------------------------------------------------------------------ config-less models

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _plain(name: str, file: str = "compressed_attention_models.py", **kw) -> nn.Module:
    """``file.py:name`` as `onboard train` loads it: a plain nn.Module class, no config."""
    from onboarding.load.model import load_model

    loaded = load_model(f"{FIXTURES / file}:{name}", overrides=kw)
    assert loaded.config is None
    return loaded.build(seed=0)


def test_config_less_model_facts_and_loss_by_structure():
    """A plain nn.Module (no transformers config) trains: its vocabulary is its token
    embedding's rows, no context limit or router coefficient is made up, and the loss calls it
    as its forward names the ids (``input_ids`` here, ``ids`` positionally below) and takes its
    tensor output as the logits. Before: ``model.config`` (AttributeError) in the worker."""
    from onboarding.train.lm import lm_facts, lm_logits
    from onboarding.train.worker import lm_loss

    model = _plain("CompressedTopkMaskLM", vocab=256)
    facts = lm_facts(model)
    assert (facts.vocab_size, facts.max_positions, facts.router_aux_loss_coef,
            facts.text_config) == (256, None, 0.0, None)
    assert "token embedding `embed` (256 x 32)" in facts.source
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    for chunked in (False, True):  # the baseline's loss and ours
        loss = lm_loss(model, ids, chunked=chunked)
        loss.backward()
        assert torch.isfinite(loss) and model.embed.weight.grad is not None
    positional = _plain("SelectiveScanLM", file="user_models.py")  # forward(self, ids)
    assert lm_logits(positional, ids[:, :8] % 97).shape == (2, 8, 97)


def test_transformers_call_and_output_forms():
    """A forward that names ``input_ids`` and ``use_cache`` is called as transformers' models
    are; ``.logits`` and a tuple's first tensor are the logits; anything else, or logits that
    are not [B, T, V] for ids [B, T], is bad input naming what came back."""
    from types import SimpleNamespace

    from onboarding.train.lm import lm_logits

    class HFLike(nn.Module):
        def forward(self, input_ids=None, use_cache=None):
            assert use_cache is False
            return SimpleNamespace(logits=torch.zeros(*input_ids.shape, 5))

    class Pair(nn.Module):
        def forward(self, x):
            return torch.zeros(*x.shape, 5), None

    class Hidden(nn.Module):
        def forward(self, x):
            return {"logits": torch.zeros(*x.shape, 5)}

    class Flat(nn.Module):
        def forward(self, x):
            return torch.zeros(x.numel(), 5)

    ids = torch.zeros(2, 3, dtype=torch.long)
    assert lm_logits(HFLike(), ids).shape == lm_logits(Pair(), ids).shape == (2, 3, 5)
    with pytest.raises(InputError, match=r"logits \[B, T, V\].*returned a dict"):
        lm_logits(Hidden(), ids)
    with pytest.raises(InputError, match=r"for token ids \[2, 3\] it returned shape \[6, 5\]"):
        lm_logits(Flat(), ids)


def test_config_less_model_without_a_vocabulary_or_full_logits_is_bad_input():
    """What structure cannot give is said: no config vocab_size and no nn.Embedding (no ids to
    draw), or logits narrower than the ids the model embeds (`check_logits`, on meta)."""
    from onboarding.train.lm import check_logits, lm_facts

    class NoEmbedding(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

    class Narrow(nn.Module):  # returns its hidden states, not logits over its 300 ids
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(300, 16)

        def forward(self, input_ids):
            return self.embed(input_ids)

    with pytest.raises(InputError, match="no vocabulary to train on.*nn.Embedding"):
        lm_facts(NoEmbedding())
    with torch.device("meta"):
        narrow = Narrow()
    with pytest.raises(InputError, match="16 entries per token, fewer than the 300 token ids"):
        check_logits(narrow, lm_facts(narrow))


def test_flops_of_a_config_less_model_count_its_attention_from_the_graph(parse_model):
    """A plain nn.Module (no config) has its attention counted from the op graph the run parsed:
    heads and widths of each captured core (2 heads x 16 here) and its top-k's k (2), at the
    training length (32, not the capture's 16): T causal local keys plus the pooled entries a
    query sees (T // 4, at most k). Before: no attention counted, 2 blocks uncounted."""
    from onboarding.load.model import load_model
    from onboarding.train.flops import _causal_keys

    fixture = f"{FIXTURES / 'compressed_attention_models.py'}:CompressedTopkMaskLM"
    graph = parse_model(fixture, seq=16, try_export=False)  # as test_lora_targets_no_grad's
    model = load_model(fixture).build(None, seed=0)
    f = step_flops(graph, model, tokens=128, seq_len=32, lora_rank=4, expert_lora=False)
    per_token = 3 * 2 * 2 * (16 + 16) * (_causal_keys(32) + _causal_keys(32 // 4, 2))
    assert per_token == 7056  # 384 x (16.5 + 1.875)
    assert f["attention"] == pytest.approx(2 * per_token * 128)
    assert f["uncounted_blocks"] == 0


def test_position_limit_by_structure():
    """A config-less model's context limit, where a fixed-size table bounds its positions: an
    nn.Embedding looked up with arange positions (its rows), a learned table sliced to the
    sequence along a shorter dim (read at the Python slice: past the end ATen runs none).
    Relative positions clamped into a small table bound nothing; neither does attention over
    pooled keys. One forward on meta at the training length."""
    from onboarding.load.model import load_model
    from onboarding.train.lm import position_limit

    def meta(name: str, file: str = "position_table_models.py") -> nn.Module:
        return load_model(f"{FIXTURES / file}:{name}").build(device="meta", seed=None)

    learned = position_limit(meta("LearnedPositionLM"), 128)
    assert learned.limit == 96 and "`pos.weight` (96 rows" in learned.what
    assert position_limit(meta("LearnedPositionLM"), 64).limit == 96  # seen, not exceeded
    sliced = position_limit(meta("SlicedTableLM"), 128)
    assert sliced.limit == 80 and "`pos` [1, 80, 16]" in sliced.what and "dim 1" in sliced.what
    assert position_limit(meta("SlicedTableLM"), 80) is None  # a slice that fits: no bound seen
    assert position_limit(meta("RelativeBiasLM"), 128) is None
    assert position_limit(meta("CompressedTopkMaskLM", "compressed_attention_models.py"),
                          64) is None


def test_baseline_label_follows_what_runs():
    """``--baseline`` runs the model's own forward with PEFT: transformers' code for a
    transformers model, a plain module's eager code otherwise; the run log says which."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from onboarding.train.lm import baseline_label
    from onboarding.train.worker import _compile_note

    with torch.device("meta"):
        hf = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16,
                                          num_hidden_layers=1, num_attention_heads=2))
    assert baseline_label(hf) == "transformers + PEFT"
    plain = _plain("CompressedTopkMaskLM")
    assert baseline_label(plain) == "eager model + PEFT"
    cfg = TrainConfig(model="m", compile="blocks")
    assert _compile_note(cfg, "baseline", 2, baseline_label(plain)) == (
        "none (eager; compile = blocks applies to ours, not to the eager model + PEFT baseline)")


@pytest.mark.slow
def test_plan_counts_a_config_less_models_attention_as_training_does(parse_model):
    """A model without a config (``file.py:Name``) has its attention cores costed by the plan
    from the widths its capture read (`flops.CapturedCore`), the count `onboard train` makes of
    the same graph at the same length: 2 blocks of 2 heads x 16 at T = 32. Before: none (no
    config, no core FLOPs), so the plan gave its attention no time."""
    from onboarding.load.model import load_model
    from onboarding.plan import ClusterConfig, PlanConfig, build_plan
    from onboarding.plan.estimate import step_flops as plan_flops
    from onboarding.plan.shapes import model_shape

    fixture = f"{FIXTURES / 'compressed_attention_models.py'}:CompressedTopkMaskLM"
    graph = parse_model(fixture, seq=16, try_export=False)
    model = load_model(fixture).build(None, seed=0)
    shape = model_shape(model, None, graph)
    cfg = PlanConfig(gpus=1, seq=32)
    core = plan_flops(shape, cfg)[2]
    trained = step_flops(graph, model, tokens=128, seq_len=32, lora_rank=4, expert_lora=False)
    assert core == 2 * 7056 and core * 128 == pytest.approx(trained["attention"])
    assert build_plan(shape, cfg, ClusterConfig()).chosen.time.attn_s > 0


def test_attention_widths_of_a_split_head_and_of_a_partial_rotary_head():
    """MLA's query/key head is its position-free plus rotary parts (DeepSeek V3, whose
    ``head_dim`` is the rotary part alone; GLM-5-Next's rotary part is 0); a rotary width with
    no position-free part is a share of ``head_dim`` (DeepSeek V4's partial rotary), so the head
    is ``head_dim`` wide. Before: V4's MLA layers read 4 wide (the rotary share) instead of 32,
    a split head with no rotary part hidden / heads (32) instead of its 64."""
    from types import SimpleNamespace

    from transformers import DeepseekV3Config, DeepseekV4Config

    from onboarding.train.flops import _attention_widths

    v4 = DeepseekV4Config(num_attention_heads=4, num_key_value_heads=4, hidden_size=128,
                          head_dim=32, qk_rope_head_dim=4)
    assert v4.qk_rope_head_dim == 4 and getattr(v4, "qk_nope_head_dim", None) is None
    assert _attention_widths(v4, "attention.mla") == (4, 32, 32)
    v3 = DeepseekV3Config(num_attention_heads=4, hidden_size=128, qk_nope_head_dim=32,
                          qk_rope_head_dim=16, v_head_dim=32)
    assert v3.head_dim == 16 and _attention_widths(v3, "attention.mla") == (4, 48, 32)
    assert _attention_widths(v3, "sparse_attention.topk") == (4, 48, 32)
    no_rope = SimpleNamespace(num_attention_heads=4, hidden_size=128, head_dim=0,
                              qk_nope_head_dim=64, qk_rope_head_dim=0, v_head_dim=64)
    assert _attention_widths(no_rope, "attention.mla") == (4, 64, 64)


@pytest.mark.slow
def test_attention_widths_of_deepseek_v4_are_what_its_capture_runs(parse_model):
    """hf:deepseek_v4's tiny proxy: every softmax-attention block's config widths (what the
    FLOPs count) equal the widths its captured core ran (``core_widths``). Before: its MLA
    layers read (4, 4, 4) against the capture's (4, 32, 32)."""
    from onboarding.graph.parse import load_stage
    from onboarding.load.model import load_model
    from onboarding.load.proxy import text_config
    from onboarding.train.flops import _attention_widths

    cfg = text_config(load_stage(load_model("hf:deepseek_v4"), "tiny").proxy_config)
    graph = parse_model("hf:deepseek_v4", seq=64, try_export=False)
    blocks = [b for b in graph.blocks if b.kind.startswith(("attention.", "sparse_attention."))]
    assert "attention.mla" in {b.kind for b in blocks}
    for b in blocks:
        w = b.attrs["core_widths"]
        assert _attention_widths(cfg, b.kind, b.layer) == (w["heads"], w["d_qk"], w["d_v"]), b.path
