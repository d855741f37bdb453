"""The files an HF checkpoint directory carries beside its weights that a converted directory
keeps: the tokenizer (for `dsv4-generate --prompt`) and the generation config (its eos ids).

`check_files` reads each one present the way its user will (the tokenizer through the
`tokenizers` package, the two configs as JSON objects, the eos ids as token ids of the model),
so a corrupt file is reported when converting, naming it, instead of when generating.
"""

from __future__ import annotations

import json
import os
import shutil

from .safetensors_io import CheckpointError

TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
FILES = (TOKENIZER, TOKENIZER_CONFIG, GENERATION_CONFIG)
# DeepSeek-V4's special tokens as its tokenizer spells them: bos, eos, the chat roles, thinking
BOS, EOS, USER, ASSISTANT, THINK, END_THINK = (
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>")


def _json_object(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return obj


def generation_eos_ids(directory: str, vocab_size: int | None = None) -> tuple[int, ...]:
    """The eos token ids of `directory`'s generation_config.json: its `eos_token_id` (one id or a
    list of them) as a tuple; () when the file or the field is absent or null. An id that is not
    an integer (a bool is not one), or outside [0, vocab_size) when vocab_size is given, raises
    CheckpointError naming the file."""
    path = os.path.join(directory, GENERATION_CONFIG)
    if not os.path.isfile(path):
        return ()
    eos = _json_object(path).get("eos_token_id")
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0 or (vocab_size is not None and i >= vocab_size):
            bound = f" in [0, {vocab_size})" if vocab_size is not None else ""
            raise CheckpointError(f"{path}: eos_token_id must be a token id{bound} or a list of them, got {eos!r}")
    return tuple(ids)


def check_files(hf_dir: str, vocab_size: int) -> list[str]:
    """The names of FILES present in hf_dir, each checked readable by its user; a corrupt one
    raises CheckpointError naming it."""
    present = [n for n in FILES if os.path.isfile(os.path.join(hf_dir, n))]
    for name in present:
        path = os.path.join(hf_dir, name)
        if name == TOKENIZER:
            from tokenizers import Tokenizer

            try:
                Tokenizer.from_file(path)
            except Exception as e:  # noqa: BLE001  the tokenizers package raises plain Exceptions
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise CheckpointError(f"{path}: not a valid tokenizer ({first})") from None
        elif name == GENERATION_CONFIG:
            generation_eos_ids(hf_dir, vocab_size)
        else:
            _json_object(path)
    return present


def copy_files(hf_dir: str, out_dir: str, names: list[str]) -> None:
    """Copies the named files' contents (a symlink's target, as in an HF hub cache) into out_dir;
    each new file gets the mode the umask gives."""
    for name in names:
        shutil.copyfile(os.path.join(hf_dir, name), os.path.join(out_dir, name))


def tokenizer_config(tok, model_max_length: int) -> dict:
    """tokenizer_config.json as transformers reads it for a `tokenizers.Tokenizer` with the
    special tokens above (bos added in front of every encoding; no chat template: DeepSeek-V4
    checkpoints ship none)."""
    added = {str(i): {"content": t.content, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True}
             for i, t in sorted(tok.get_added_tokens_decoder().items())}
    return {"add_bos_token": True, "add_eos_token": False, "bos_token": BOS, "eos_token": EOS, "pad_token": EOS,
            "unk_token": None, "clean_up_tokenization_spaces": False, "model_max_length": model_max_length,
            "tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added}
