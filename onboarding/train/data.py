"""Training data: texts -> token ids -> packed rows of ``seq_len + 1`` tokens.

Texts come from JSONL (``prompt``/``response`` or ``text`` fields), ``.txt`` files (or a
directory of them), local or at an fsspec URL (``s3://bucket/data.jsonl``), or the built-in corpus of docstring/code pairs from the Python standard
library (`onboarding.train.corpus`). Tokens come from the model repo's ``tokenizer.json``
(the `tokenizers` library, offline) when it has one that fits the model's vocabulary, else from a
byte-level tokenizer.

Packing: every text is followed by EOS, the stream is cut into rows of ``seq_len + 1`` (input and
shifted target share a row), and each epoch visits the rows in a permutation drawn from
``(seed, epoch)``. `PackedData.global_batch(step, n)` is therefore a pure function of
``(seed, step, n)``: every rank and the single-process reference see the same global batch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import torch

from onboarding.errors import InputError
from onboarding.train.lm import VOCAB_RESIZE

BUILTIN_CORPUS = Path(__file__).resolve().parent.parent / "data" / "stdlib_pairs.jsonl"
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|im_end|>", "<eos>", "<|end_of_text|>", "[SEP]")


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int
    name: str

    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 with EOS = 0 (the NUL byte, dropped from texts): needs a model
    vocabulary of at least 256 ids."""

    name = "bytes"

    def __init__(self, model_vocab: int, resize: str = VOCAB_RESIZE) -> None:
        if model_vocab < 256:
            raise InputError(f"vocab_size={model_vocab}: the byte-level tokenizer needs at "
                             "least 256 ids; give the model a tokenizer.json or a larger "
                             f"vocabulary ({resize})")
        self.vocab_size = 256
        self.eos_id = 0

    def encode(self, text: str) -> list[int]:
        return [b for b in text.encode("utf-8") if b]


class HFTokenizer:
    """A ``tokenizer.json`` read by the `tokenizers` library (no network, no transformers)."""

    def __init__(self, path: Path, eos_id: int) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = eos_id
        self.name = f"tokenizer.json ({path.parent.name})"

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids


def _eos_token(model_dir: Path, tok) -> int | None:
    names: list[str] = []
    cfg = model_dir / "tokenizer_config.json"
    if cfg.is_file():
        try:
            eos = json.loads(cfg.read_text()).get("eos_token")
        except (json.JSONDecodeError, AttributeError):
            eos = None
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            names.append(eos)
    for name in [*names, *EOS_CANDIDATES]:
        tid = tok.token_to_id(name)
        if tid is not None:
            return tid
    return None


def load_tokenizer(model_dir: Path | None, vocab_size: int,
                   resize: str = VOCAB_RESIZE) -> Tokenizer:
    """The repo's tokenizer when present and fitting ``vocab_size``, else `ByteTokenizer`.

    A repo tokenizer whose ids exceed the model's embedding (e.g. a shrunk proxy vocabulary)
    or that has no EOS token cannot be used as is: the byte tokenizer takes over. ``resize``:
    how the model's vocabulary grows, for the byte tokenizer's refusal (`lm.vocab_resize`).
    """
    path = model_dir / "tokenizer.json" if model_dir is not None else None
    if path is not None and path.is_file():
        from tokenizers import Tokenizer as _Tok

        try:
            tok = _Tok.from_file(str(path))
        except Exception as exc:  # the library raises its own exception types
            raise InputError(f"{path}: the tokenizers library cannot read it: {exc}") from exc
        eos = _eos_token(model_dir, tok)
        if eos is not None and tok.get_vocab_size(with_added_tokens=True) <= vocab_size:
            return HFTokenizer(path, eos)
    return ByteTokenizer(vocab_size, resize)


def _jsonl_texts(path: Path | str, text: str | None = None) -> list[str]:
    texts = []
    if text is None:
        text = Path(path).read_text(encoding="utf-8")
    for n, line in enumerate(text.split("\n"), 1):  # not splitlines: JSON may hold U+2028
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{n}: malformed JSON ({exc.msg})") from exc
        if not isinstance(row, dict):
            raise InputError(f"{path}:{n}: expected a JSON object per line")
        if isinstance(row.get("text"), str):
            texts.append(row["text"])
        elif isinstance(row.get("prompt"), str) and isinstance(row.get("response"), str):
            texts.append(row["prompt"].rstrip() + "\n" + row["response"])
        else:
            raise InputError(f"{path}:{n}: expected a 'text' field or 'prompt' and "
                             f"'response' string fields, got keys {sorted(row)}")
    return texts


def _url_texts(url: str) -> list[str]:
    """`load_texts` of an fsspec URL: the same forms, read through its filesystem."""
    from onboarding.train.checkpoint import filesystem

    fs, root = filesystem(url)
    try:
        if fs.isdir(root):
            files = sorted(f for f in fs.find(root) if f.endswith(".txt"))
            if not files:
                raise InputError(f"--data {url}: the folder has no .txt files")
            return [fs.cat_file(f).decode("utf-8", errors="replace") for f in files]
        if not fs.isfile(root):
            raise InputError(f"--data {url}: no such object")
        if root.endswith(".jsonl"):
            return _jsonl_texts(url, fs.cat_file(root).decode("utf-8"))
        if root.endswith(".txt"):
            return [fs.cat_file(root).decode("utf-8", errors="replace")]
    except (OSError, PermissionError) as exc:  # credentials, endpoint, network: said, not raised
        raise InputError(f"--data {url}: cannot read it ({exc})") from exc
    raise InputError(f"--data {url}: expected a .jsonl or .txt object or a folder")


def load_texts(path: str | None) -> list[str]:
    """Texts from JSONL / .txt / a directory of .txt files (local or an fsspec URL); None reads
    the built-in corpus."""
    if path is not None and "://" in path:
        texts = [t for t in _url_texts(path) if t.strip()]
        if not texts:
            raise InputError(f"--data {path}: no text in it")
        return texts
    p = Path(path) if path is not None else BUILTIN_CORPUS
    if not p.exists():
        if path is None:
            raise InputError(f"the built-in corpus {p} is missing; generate it with "
                             "python -m onboarding.train.corpus")
        raise InputError(f"--data {path}: no such file or directory")
    if p.is_dir():
        files = sorted(p.rglob("*.txt"))
        if not files:
            raise InputError(f"--data {path}: the directory has no .txt files")
        texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    elif p.suffix == ".jsonl":
        texts = _jsonl_texts(p)
    elif p.suffix == ".txt":
        texts = [p.read_text(encoding="utf-8", errors="replace")]
    else:
        raise InputError(f"--data {path}: expected a .jsonl or .txt file or a directory")
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise InputError(f"--data {p}: no text in it")
    return texts


class PackedData:
    """Texts packed with EOS separators into rows of ``seq_len + 1`` token ids."""

    def __init__(self, texts: list[str], tokenizer: Tokenizer, seq_len: int, seed: int) -> None:
        if seq_len <= 0:
            raise InputError(f"seq_len={seq_len}: must be positive")
        ids: list[int] = []
        for t in texts:
            ids.extend(tokenizer.encode(t))
            ids.append(tokenizer.eos_id)
        row = seq_len + 1
        n_rows = len(ids) // row
        if n_rows == 0:
            raise InputError(f"the data holds {len(ids)} tokens, fewer than one row of "
                             f"seq_len + 1 = {row}; add data or shorten seq_len")
        self.rows = torch.tensor(ids[:n_rows * row], dtype=torch.long).view(n_rows, row)
        self.seq_len = seq_len
        self.seed = seed
        self.tokens = len(ids)
        self._perms: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.rows.shape[0]

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(len(self), generator=gen)
        return self._perms[epoch]

    def global_batch(self, step: int, n_rows: int) -> torch.LongTensor:
        """Rows ``[step * n_rows, (step + 1) * n_rows)`` of the endless epoch sequence."""
        if step < 0 or n_rows <= 0:
            raise ValueError(f"global_batch(step={step}, n_rows={n_rows}): need step >= 0, "
                             "n_rows > 0")
        n = len(self)
        idx = []
        for i in range(step * n_rows, (step + 1) * n_rows):
            idx.append(self._perm(i // n)[i % n])
        return self.rows[torch.stack(idx)]
