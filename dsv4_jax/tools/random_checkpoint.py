"""Random-weight DeepSeek-V4 checkpoints for trying things (the server, the CLIs, OpenAI-API tools).

    python -m dsv4_jax.tools.random_checkpoint DIR --preset tiny|flash-mini [--with-mtp] [--seed S] [--overwrite]

writes an HF checkpoint directory in the published format: config.json in the official form,
official tensor names, FP8 e4m3 linears and FP4 e2m1 routed experts with their E8M0 scales,
sharded safetensors with an index (`dsv4_jax.checkpoint.export_hf.write_hf_checkpoint`), plus

* `tokenizer.json`: a byte-level BPE built on the spot with the `tokenizers` package, so any
  text encodes. Ids: 0 `<｜begin▁of▁sentence｜>` (bos, added in front of every encoding), 1
  `<｜end▁of▁sentence｜>` (eos), 2..257 the 256 bytes, then merges drawn from the seed (pieces of
  lowercase words, with or without their leading space), and the last four ids `<｜User｜>`,
  `<｜Assistant｜>`, `<think>`, `</think>`; the vocabulary is exactly the model's vocab_size.
* `tokenizer_config.json` (special tokens, add_bos_token; no chat template: DeepSeek-V4
  checkpoints ship none) and `generation_config.json` (bos and eos ids, as config.json has them).

With --with-mtp the checkpoint also has the next-token-prediction block `mtp.0.*` of
architecture.md §9-10 (a window-only block with learned routing and its gate bias, its own hc
head and norm, enorm / hnorm, and e_proj / h_proj in FP8), and config.json says
num_nextn_predict_layers 1. Everything is a function of (preset, with_mtp, seed): the same
arguments give byte-identical files.

DIR must be missing or empty; with --overwrite a DIR holding a previous random checkpoint (its
config.json says so, and it holds nothing else) is replaced, and nothing else ever is. The
checkpoint is built in a temporary directory next to DIR and renamed at the end, so DIR appears
complete or not at all. Bad input prints one line and exits with status 1.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import sys

import numpy as np

from dsv4_jax.checkpoint.hf_files import ASSISTANT, BOS, END_THINK, EOS, THINK, USER, tokenizer_config
from dsv4_jax.model.config import ModelConfig, Yarn
from dsv4_jax.model.params import init_params

# Every layer kind (window only, ratio 4 with its indexer, ratio 128), hash and learned routing,
# 4 hyper-connection streams, Flash's rope geometry scaled down (examples/demo.py's model). The
# vocabulary holds the byte-level tokenizer: 256 bytes, 6 special tokens and merges.
TINY = ModelConfig(
    vocab_size=512, hidden_size=128, num_layers=6, num_heads=4, head_dim=128, rope_head_dim=32,
    q_lora_rank=64, o_groups=2, o_lora_rank=64, sliding_window=32,
    compress_ratios=(0, 4, 128, 4, 128, 4), hash_layers=(True,) + (False,) * 5,
    index_n_heads=16, index_head_dim=64, index_topk=16, n_routed_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=64, routed_scaling_factor=1.5, swiglu_limit=10.0, hc_mult=4,
    hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, rope_theta=10000.0,
    compress_rope_theta=160000.0, yarn=Yarn(16.0, 65536, 32.0, 1.0), num_nextn_predict_layers=0)

# Flash's attention geometry (head_dim 512, rope 64, window 128, indexer 8 x 128 top-64, YaRN
# 16 over 65536) on an 8-layer, 512-wide body: about 87 M parameters. In the official (legacy)
# config form, as dsv4_jax.tools.bench also hands it to transformers.
FLASH_MINI = dict(
    vocab_size=4096, hidden_size=512, moe_intermediate_size=256, num_hidden_layers=8,
    num_attention_heads=8, head_dim=512, qk_rope_head_dim=64, q_lora_rank=256, o_groups=2, o_lora_rank=256,
    sliding_window=128, index_n_heads=8, index_head_dim=128, index_topk=64,
    compress_ratios=[0, 0, 4, 128, 4, 128, 4, 128], num_nextn_predict_layers=0,
    num_hash_layers=1, n_routed_experts=16, num_experts_per_tok=2, hc_mult=4, hc_sinkhorn_iters=20,
    routed_scaling_factor=1.5, swiglu_limit=10.0, rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                  "beta_fast": 32, "beta_slow": 1},
    max_position_embeddings=1048576, tie_word_embeddings=False,
)

# name -> (config, safetensors shards)
PRESETS: dict[str, tuple[ModelConfig, int]] = {
    "tiny": (TINY, 3),
    "flash-mini": (ModelConfig.from_hf(FLASH_MINI), 4),
}

BOS_ID, EOS_ID = 0, 1
FIRST_BYTE_ID = 2
MIN_VOCAB = 256 + 6  # the bytes and the special tokens
WEIGHT_STD = 0.08  # random weights' scale (norms, sinks, biases, hc: see params.init_params)
MARKER = "random_checkpoint"  # config.json key recording (preset, with_mtp, seed)
_WEIGHT_FILE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
_OUR_FILES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "model.safetensors.index.json"}


class RandomCheckpointError(ValueError):
    """A request this tool refuses; the message names the problem."""


def preset_config(preset: str, with_mtp: bool = False) -> ModelConfig:
    """The preset's config, with one MTP block when with_mtp, bos / eos as the tokenizer has them."""
    if preset not in PRESETS:
        raise RandomCheckpointError(f"unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
    cfg = PRESETS[preset][0]
    return cfg.replace(num_nextn_predict_layers=int(with_mtp), bos_token_id=BOS_ID, eos_token_id=EOS_ID)


# ---- tokenizer ------------------------------------------------------------------------------

def report_model(ckpt: str | None, preset: str, dtype, seed: int = 0):
    """The model a report tool runs: the converted checkpoint `ckpt` in dtype, else a random-weight
    model of `preset` (seeded); an unknown preset is a UsageError naming --preset."""
    import dsv4_jax
    from dsv4_jax.runtime.cli_args import UsageError

    if ckpt:
        return dsv4_jax.load(ckpt, dtype=dtype)
    if preset not in PRESETS:
        raise UsageError(f"--preset must be one of {sorted(PRESETS)}")
    cfg = PRESETS[preset][0]
    return dsv4_jax.DeepseekV4(init_params(cfg, seed=seed, dtype=dtype), cfg)


def byte_chars() -> list[str]:
    """The printable character byte-level BPE writes for each byte value 0..255 (GPT-2's table:
    printable Latin-1 bytes stand for themselves, the others for 256, 257, ... in byte order)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in kept:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _random_merges(n: int, rng: np.random.Generator) -> list[tuple[str, str]]:
    """n BPE merges of lowercase-word pieces: the left part may start with the space marker, the
    right part never does, so merged tokens look like `Ġab`, `cde` (pieces of words)."""
    chars = byte_chars()
    space, letters = chars[ord(" ")], [chars[b] for b in b"abcdefghijklmnopqrstuvwxyz"]
    lefts, rights = [space, *letters], list(letters)
    seen = set(chars)
    merges: list[tuple[str, str]] = []
    while len(merges) < n:
        left, right = lefts[rng.integers(len(lefts))], rights[rng.integers(len(rights))]
        token = left + right
        if token in seen or len(token) > 12:
            continue
        seen.add(token)
        merges.append((left, right))
        lefts.append(token)
        if not token.startswith(space):
            rights.append(token)
    return merges


def build_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE `tokenizers.Tokenizer` with exactly vocab_size ids (layout: module doc)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if vocab_size < MIN_VOCAB:
        raise RandomCheckpointError(f"a byte-level tokenizer needs vocab_size >= {MIN_VOCAB}, got {vocab_size}")
    chars = byte_chars()
    tail = [USER, ASSISTANT, THINK, END_THINK]
    merges = _random_merges(vocab_size - MIN_VOCAB, np.random.default_rng(seed))
    vocab = {BOS: BOS_ID, EOS: EOS_ID}
    for token in chars + [left + right for left, right in merges] + tail:
        vocab[token] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in [BOS, EOS] + tail])
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, BOS_ID)])
    return tok


# ---- weights --------------------------------------------------------------------------------

def mtp_tensors(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """The `mtp.0.*` tensors (float, by official name) of architecture.md §9-10 for cfg: one
    window-only block with learned routing (gate bias, no tid2eid) and the norm and hc head of a
    one-layer model (embed and head are the main model's), plus enorm, hnorm, e_proj, h_proj."""
    from dsv4_jax.checkpoint.export_hf import official_tensors

    block = cfg.replace(num_layers=1, compress_ratios=(0,), hash_layers=(False,), num_nextn_predict_layers=0,
                        use_index_cache=False, index_topk_pattern=None)
    block_seed, extra_seed = (int(x) for x in np.random.SeedSequence([seed, 1]).generate_state(2))
    out = {}
    for name, arr in official_tensors(init_params(block, seed=block_seed, std=WEIGHT_STD), block).items():
        if name not in ("embed.weight", "head.weight"):
            out["mtp.0." + name.removeprefix("layers.0.")] = np.asarray(arr)
    rng = np.random.default_rng(extra_seed)
    D = cfg.hidden_size
    for proj in ("e_proj", "h_proj"):
        out[f"mtp.0.{proj}.weight"] = (WEIGHT_STD * rng.standard_normal((D, D))).astype(np.float32)
    for norm in ("enorm", "hnorm"):
        out[f"mtp.0.{norm}.weight"] = (1.0 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    return out


# ---- the directory --------------------------------------------------------------------------

def is_random_checkpoint(directory: str) -> bool:
    """Whether directory holds a checkpoint this tool wrote and nothing else."""
    try:
        with open(os.path.join(directory, "config.json")) as f:
            marked = MARKER in json.load(f)
        entries = os.listdir(directory)
    except (OSError, ValueError, TypeError):
        return False
    return marked and all((e in _OUR_FILES or _WEIGHT_FILE.match(e)) and os.path.isfile(os.path.join(directory, e))
                          for e in entries)


def _check_target(directory: str, overwrite: bool) -> bool:
    """Raises unless directory may be written; returns whether it holds a checkpoint to replace."""
    if not os.path.lexists(directory):
        return False
    if not os.path.isdir(directory):
        raise RandomCheckpointError(f"{directory} exists and is not a directory")
    if not os.listdir(directory):
        return False
    if not overwrite:
        raise RandomCheckpointError(
            f"{directory} is not empty (--overwrite replaces only a previous random checkpoint)")
    if not is_random_checkpoint(directory):
        raise RandomCheckpointError(f"{directory} is not empty and is not a random checkpoint written by this tool; "
                                    f"refusing to replace it")
    return True


def _write_into(tmp: str, preset: str, cfg: ModelConfig, shards: int, with_mtp: bool, seed: int) -> None:
    from dsv4_jax.checkpoint.export_hf import write_hf_checkpoint

    mtp = mtp_tensors(cfg, seed) if with_mtp else None
    write_hf_checkpoint(init_params(cfg, seed=seed, std=WEIGHT_STD), cfg, tmp, num_shards=shards, quantize=True,
                        mtp=mtp)
    path = os.path.join(tmp, "config.json")
    with open(path) as f:
        config = json.load(f)
    config[MARKER] = {"preset": preset, "with_mtp": with_mtp, "seed": seed}
    tok = build_tokenizer(cfg.vocab_size, seed)
    files = {"config.json": config,
             "generation_config.json": {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id},
             "tokenizer_config.json": tokenizer_config(tok, cfg.max_position_embeddings)}
    for name, obj in files.items():
        with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, ensure_ascii=False)
    tok.save(os.path.join(tmp, "tokenizer.json"))


def write_random_checkpoint(directory: str | os.PathLike, preset: str, with_mtp: bool = False, seed: int = 0,
                            overwrite: bool = False) -> str:
    """Writes the random checkpoint (module doc) to directory; returns its path."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise RandomCheckpointError(f"seed must be an integer in [0, 2**32), got {seed!r}")
    cfg = preset_config(preset, with_mtp)
    shards = PRESETS[preset][1]
    directory = os.path.realpath(os.fspath(directory))  # a symlinked DIR: its target is written
    replace = _check_target(directory, overwrite)
    parent = os.path.dirname(directory)
    created = []  # the missing parents, innermost first: made here, removed again on failure
    probe = parent
    while not os.path.lexists(probe):
        created.append(probe)
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise RandomCheckpointError(f"cannot create {directory}: {probe} is not a directory")
    tmp = os.path.join(parent, f".{os.path.basename(directory)}.tmp-{secrets.token_hex(4)}")
    try:
        os.makedirs(parent, exist_ok=True)
        os.mkdir(tmp)
        _write_into(tmp, preset, cfg, shards, with_mtp, seed)
        if replace:
            old = os.path.join(parent, f".{os.path.basename(directory)}.old-{secrets.token_hex(4)}")
            os.rename(directory, old)
            try:
                os.rename(tmp, directory)
            except OSError:
                os.rename(old, directory)
                raise
            shutil.rmtree(old)
        else:
            os.rename(tmp, directory)  # replaces an empty directory
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in created:
            try:
                os.rmdir(d)
            except OSError:
                break
        raise
    return directory


def main(argv=None) -> int:
    from dsv4_jax.runtime.cli_args import ArgumentParser, UsageError

    ap = ArgumentParser(prog="python -m dsv4_jax.tools.random_checkpoint", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="output directory (missing or empty)")
    ap.add_argument("--preset", required=True, help=f"model size: {' | '.join(PRESETS)}")
    ap.add_argument("--with-mtp", action="store_true", help="add the mtp.0.* block (num_nextn_predict_layers 1)")
    ap.add_argument("--seed", type=int, default=0,
                    help="random seed of the weights and the tokenizer's merges (default 0)")
    ap.add_argument("--overwrite", action="store_true", help="replace DIR if it holds a previous random checkpoint")
    try:
        args = ap.parse_args(argv)
        path = write_random_checkpoint(args.dir, args.preset, with_mtp=args.with_mtp, seed=args.seed,
                                       overwrite=args.overwrite)
    except (UsageError, RandomCheckpointError, OSError) as e:
        print(f"random_checkpoint: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("random_checkpoint: interrupted", file=sys.stderr)
        return 130
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    print(f"random_checkpoint: wrote {path} (preset {args.preset}{', with mtp' if args.with_mtp else ''}, "
          f"seed {args.seed}, {size / 1e6:.1f} MB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
