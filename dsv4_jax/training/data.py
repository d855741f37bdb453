"""The training text: corpus files, a byte-level BPE trained on them, and batches of token windows.

The default corpus is the Python standard library's `.py` sources that ship with the interpreter:
real text that every machine running this package has. Files are split by a hash of their path
into training and held-out sets (about 1 in 20 held out), so the held-out loss is measured on
files the model never saw. Each set is one token stream: every file's tokens after a bos token.
Batches are windows of seq_len + 1 tokens at positions drawn from (seed, step), so a resumed run
draws the batches the uninterrupted run would have.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sysconfig
from typing import NamedTuple

import numpy as np

from dsv4_jax.checkpoint.hf_files import ASSISTANT, BOS, END_THINK, EOS, THINK, USER

SPECIALS = (BOS, EOS, USER, ASSISTANT, THINK, END_THINK)  # ids 0 .. 5, in this order
BOS_ID, EOS_ID = 0, 1
HELD_OUT = 20  # one file in HELD_OUT goes to the held-out set
SUFFIXES = (".py", ".txt", ".md", ".rst", ".c", ".h", ".json", ".toml", ".cfg", ".ini", ".html", ".css",
            ".js", ".sh")  # what a directory given as corpus contributes


class DataError(ValueError):
    """A corpus the trainer cannot use; the message names the problem."""


def default_corpus() -> list[str]:
    """The standard library's directory (its .py files are the default corpus)."""
    return [sysconfig.get_paths()["stdlib"]]


def corpus_files(paths: list[str]) -> list[str]:
    """The text files under `paths` (a file as given; a directory walked for files with one of
    SUFFIXES, skipping site-packages and hidden directories), sorted. Raises DataError for a
    missing path or when nothing is found."""
    found = set()
    for p in paths:
        if os.path.isfile(p):
            found.add(os.path.abspath(p))
        elif os.path.isdir(p):
            for root, dirs, files in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in ("site-packages",
                                                                                     "__pycache__"))
                found.update(os.path.join(root, f) for f in files if f.endswith(SUFFIXES))
        else:
            raise DataError(f"corpus path not found: {p}")
    if not found:
        raise DataError(f"no text files in the corpus ({', '.join(paths)}; a directory contributes "
                        f"{' '.join(SUFFIXES)} files)")
    return sorted(found)


def held_out(path: str) -> bool:
    """Whether a file belongs to the held-out set (a hash of its path, stable across machines
    for the same relative layout: the file name and its parent directory)."""
    key = "/".join(os.path.normpath(path).split(os.sep)[-2:]).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % HELD_OUT == 0


def read_texts(files: list[str], max_bytes: int | None = None) -> list[str]:
    """The files' texts (undecodable bytes replaced), stopping once max_bytes are read."""
    texts, total = [], 0
    for f in files:
        try:
            with open(f, encoding="utf-8", errors="replace") as fh:
                t = fh.read()
        except OSError as e:
            raise DataError(f"cannot read corpus file {f}: {e.strerror}") from None
        if t.strip():
            texts.append(t)
            total += len(t)
        if max_bytes is not None and total >= max_bytes:
            break
    return texts


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE `tokenizers.Tokenizer` of exactly vocab_size ids trained on texts: ids 0 .. 5
    the SPECIALS, then the 256 bytes, then the learned merges; bos added in front of every
    encoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    floor = len(SPECIALS) + 256
    if vocab_size < floor:
        raise DataError(f"a byte-level tokenizer needs vocab_size >= {floor}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, BOS_ID)])
    if tok.get_vocab_size() != vocab_size:
        raise DataError(f"the corpus is too small for a vocabulary of {vocab_size} tokens (BPE found "
                        f"{tok.get_vocab_size()}); give more text or a smaller model")
    return tok


def token_stream(tok, texts: list[str]) -> np.ndarray:
    """Every text's tokens (bos first) in one int32 stream."""
    if not texts:
        return np.zeros((0,), np.int32)
    return np.concatenate([np.asarray(e.ids, np.int32) for e in tok.encode_batch(texts)])


@dataclasses.dataclass
class Corpus:
    """The tokenized training and held-out streams."""

    train: np.ndarray  # int32 [N]
    held_out: np.ndarray  # int32 [M]
    files: int
    held_out_files: int

    def batch(self, seed: int, step: int, rows: int, seq_len: int) -> np.ndarray:
        """Training windows int32 `[rows, seq_len + 1]` at positions drawn from (seed, step)."""
        starts = np.random.default_rng([seed, step]).integers(0, len(self.train) - seq_len, rows)
        return np.stack([self.train[s:s + seq_len + 1] for s in starts])

    def eval_batches(self, rows: int, seq_len: int, max_windows: int) -> list[np.ndarray]:
        """Held-out windows `[rows, seq_len + 1]`, at most max_windows in all (whole batches only),
        spread evenly over the whole held-out stream (its files differ: tables of constants read
        far easier than code), the same every call."""
        fit = (len(self.held_out) - 1) // seq_len
        n = min(fit, max_windows) // rows * rows
        starts = np.linspace(0, fit - 1, n).astype(np.int64) * seq_len if n else []
        windows = [self.held_out[s:s + seq_len + 1] for s in starts]
        return [np.stack(windows[i:i + rows]) for i in range(0, n, rows)]

    def unigram_loss(self, vocab_size: int) -> float:
        """The held-out stream's cross-entropy (nats per token) under the training stream's token
        frequencies (add-one smoothed): the baseline a model must beat."""
        counts = np.bincount(self.train, minlength=vocab_size).astype(np.float64) + 1.0
        logp = np.log(counts / counts.sum())
        return float(-np.mean(logp[self.held_out[1:]]))


class Texts(NamedTuple):
    """A corpus read and split into training and held-out files (`read_corpus`)."""

    train: list[str]
    held_out: list[str]
    train_files: int
    held_out_files: int


def read_corpus(paths: list[str], max_bytes: int | None) -> Texts:
    """The texts of the corpus's files, split by `held_out` (a corpus of a few files, none of
    them held out by the hash: the last one); max_bytes caps the training text, a twentieth of
    it the held-out text."""
    files = corpus_files(paths)
    train_files = [f for f in files if not held_out(f)]
    eval_files = [f for f in files if held_out(f)]
    if not eval_files:
        train_files, eval_files = files[:-1], files[-1:]
    return Texts(read_texts(train_files, max_bytes),
                 read_texts(eval_files, None if max_bytes is None else max(max_bytes // HELD_OUT, 1)),
                 len(train_files), len(eval_files))


def build_corpus(texts: Texts, tok, seq_len: int, rows: int) -> Corpus:
    """Tokenizes the corpus's texts; raises DataError when either part cannot fill one batch of
    `rows` windows of seq_len + 1 tokens."""
    train, evals = token_stream(tok, texts.train), token_stream(tok, texts.held_out)
    need = rows * (seq_len + 1)
    for name, stream in (("training", train), ("held-out", evals)):
        if len(stream) < need:
            raise DataError(f"the corpus is too small: its {name} part has {len(stream)} tokens, one batch needs "
                            f"{need} ({rows} rows of {seq_len + 1}); give more text")
    return Corpus(train, evals, texts.train_files, texts.held_out_files)


def save_tokenizer(tok, directory: str, model_max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json and generation_config.json, as a checkpoint carries them."""
    from dsv4_jax.checkpoint.hf_files import tokenizer_config

    tok.save(os.path.join(directory, "tokenizer.json"))
    files = {"tokenizer_config.json": tokenizer_config(tok, model_max_length),
             "generation_config.json": {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}}
    for name, obj in files.items():
        with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, ensure_ascii=False)
