"""Requests: the one check of what `generate`, the `Engine` and the server are asked to run, and
the checked types they run.

- `SamplingParams`: how one request draws its tokens and when it stops; `SamplingParams.checked`
  builds it from raw values.
- `check_prompt`: a prompt and its token limit, against the vocabulary and the context.
- `Request` (`validate_request`): a checked `generate` call, a batch of prompts, each row with its
  own token limit and sampling, and the cache length that holds them.

A bad value raises `RequestError`, a ValueError whose `param` names the field at fault, in one
wording whoever asks: `generate` raises it, `Engine.submit` raises it, and the server answers it
as an HTTP 400 with the field as OpenAI's `param`. The context-length messages are OpenAI's
("This model's maximum context length is N tokens. However, ..."), which users and clients
recognise. A value of the wrong Python type raises TypeError. A message names a field as its
caller spells it (`generate`'s max_new_tokens and eos_token_id are the engine's and the server's
max_tokens and stop_token_ids), and prompt i of several as `prompt[i]`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from dsv4_jax.model.config import ModelConfig
from .buckets import length_bucket
from .sampling import MAX_LOGIT_BIAS, MAX_STOP_IDS, MAX_TOP_LOGPROBS

MAX_SPECULATIVE_TOKENS = 8
FLOAT32_MAX = float(np.finfo(np.float32).max)  # tokens are sampled in float32


class RequestError(ValueError):
    """A request that cannot be served; `param` names the field at fault (OpenAI's `param`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _is_integer(x) -> bool:
    """A Python / numpy integer or a 0-d integer array (not a bool)."""
    if isinstance(x, (bool, np.bool_)):
        return False
    if isinstance(x, (np.ndarray, jax.Array)):
        return x.ndim == 0 and np.issubdtype(x.dtype, np.integer)
    return isinstance(x, (int, np.integer))


def _integer(x, name: str) -> int:
    if not _is_integer(x):
        raise TypeError(f"{name} must be an integer, got {x!r}")
    return int(x)


def _real(x, name: str) -> float:
    """A Python / numpy number or a 0-d int / float array (not a bool) as a float."""
    if isinstance(x, (np.ndarray, jax.Array)) and x.ndim == 0 and not np.issubdtype(x.dtype, np.bool_) and (
            np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)):
        return float(x)
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {x!r}")
    return float(x)


def _outside_vocabulary(field: str, token: int, vocab_size: int) -> RequestError:
    return RequestError(f"{field}: token id {token} is outside the vocabulary [0, {vocab_size})", field)


def check_speculative_tokens(k, most: int) -> int:
    """Drafts a round, 0 (no speculation) to `most` (MAX_SPECULATIVE_TOKENS, or an engine's own)."""
    k = _integer(k, "speculative_tokens")
    if k and not most:
        raise RequestError(f"speculative_tokens must be 0: speculative decoding is off here (the engine or server "
                           f"was started without speculative_tokens), got {k}", "speculative_tokens")
    if not 0 <= k <= most:
        raise RequestError(f"speculative_tokens must be between 0 (off) and {most}, got {k}", "speculative_tokens")
    return k


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request draws its tokens and when it stops (`checked`): greedy at temperature 0,
    else a draw restricted to the top_k most likely tokens (0: all), to top_p of the probability
    and to tokens of at least min_p x the top probability (dsv4_jax/runtime/sampling.py), from the
    random stream of `seed` (its low 32 bits), after its logit_bias ((token, bias) pairs), its
    presence, frequency and repetition penalties, and its stop ids held back until it has
    min_tokens; it stops at any of `stop_token_ids`; with speculation it proposes
    `speculative_tokens` drafts a round. logprobs: None, or the model's log-probability of each
    token and of its `logprobs` most likely ones (0 to MAX_TOP_LOGPROBS) come back with it."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    speculative_tokens: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None

    @property
    def penalized(self) -> bool:
        """Whether its draws depend on the tokens before them (penalties): such a request does
        not speculate (a round's later positions would not see the tokens kept before them)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @classmethod
    def checked(cls, vocab_size: int, temperature=0.0, top_k=0, top_p=1.0, seed=0, stop_token_ids=None,
                speculative_tokens=0, *, max_speculative_tokens: int = MAX_SPECULATIVE_TOKENS,
                stop_field: str = "stop_token_ids", min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0,
                repetition_penalty=1.0, logit_bias=None, min_tokens=0, logprobs=None) -> "SamplingParams":
        """The settings checked for a model of `vocab_size` tokens. Numbers may be Python or numpy
        scalars or 0-d arrays. stop_token_ids: None, one token id or a non-empty list / tuple of
        them (named `stop_field` in errors); speculative_tokens: 0 to max_speculative_tokens;
        min_p in [0, 1]; presence and frequency penalties in [-2, 2] (OpenAI's range);
        repetition_penalty > 0 (1: off); logit_bias: None or a mapping token id (an int or its
        decimal string, as JSON keys are) -> bias in [-100, 100], at most MAX_LOGIT_BIAS entries;
        min_tokens >= 0 (with at most MAX_STOP_IDS stop ids); logprobs: None or 0 to
        MAX_TOP_LOGPROBS."""
        t = _real(temperature, "temperature")
        if not (math.isfinite(t) and 0 <= t <= FLOAT32_MAX):
            raise RequestError(f"temperature must be a finite number >= 0 (0: greedy) that float32 holds, got {t!r}",
                               "temperature")
        top_k = _integer(top_k, "top_k")
        if not 0 <= top_k <= vocab_size:
            raise RequestError(f"top_k must be between 0 (no top-k) and the vocabulary size {vocab_size}, got {top_k}",
                               "top_k")
        p = _real(top_p, "top_p")
        if not 0 < p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {p!r}", "top_p")
        seed = _integer(seed, "seed")
        if not -(2 ** 63) <= seed < 2 ** 63:
            raise RequestError(f"seed must fit in 64 bits, got {seed}", "seed")
        if stop_token_ids is None:
            stops = ()
        else:
            many = isinstance(stop_token_ids, (list, tuple))
            stops = tuple(_integer(i, stop_field) for i in (stop_token_ids if many else [stop_token_ids]))
            if not stops:  # an empty list more likely lost its ids than means none
                raise RequestError(f"{stop_field} must be a token id, a non-empty list of them, or None, got "
                                   f"{stop_token_ids!r}", stop_field)
            bad = next((i for i in stops if not 0 <= i < vocab_size), None)
            if bad is not None:
                raise _outside_vocabulary(stop_field, bad, vocab_size)
        k = check_speculative_tokens(speculative_tokens, max_speculative_tokens)
        min_p = _real(min_p, "min_p")
        if not 0 <= min_p <= 1:
            raise RequestError(f"min_p must be in [0, 1], got {min_p!r}", "min_p")
        penalties = []
        for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
            v = _real(value, name)
            if not -2 <= v <= 2:
                raise RequestError(f"{name} must be between -2 and 2, got {v!r}", name)
            penalties.append(v)
        rep = _real(repetition_penalty, "repetition_penalty")
        if not (math.isfinite(rep) and rep > 0):
            raise RequestError(f"repetition_penalty must be a finite number > 0 (1: off), got {rep!r}",
                               "repetition_penalty")
        bias = _logit_bias(logit_bias, vocab_size)
        min_tokens = _integer(min_tokens, "min_tokens")
        if min_tokens < 0:
            raise RequestError(f"min_tokens must be >= 0, got {min_tokens}", "min_tokens")
        if min_tokens and len(stops) > MAX_STOP_IDS:
            raise RequestError(f"min_tokens holds back at most {MAX_STOP_IDS} stop token ids, got {len(stops)}",
                               stop_field)
        if logprobs is not None:
            logprobs = _integer(logprobs, "logprobs")
            if not 0 <= logprobs <= MAX_TOP_LOGPROBS:
                raise RequestError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {logprobs}", "logprobs")
        return cls(t, top_k, p, seed, stops, k, min_p, *penalties, rep, bias, min_tokens, logprobs)


def _logit_bias(logit_bias, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """A logit_bias mapping as sorted (token id, bias) pairs (SamplingParams.checked)."""
    if logit_bias is None:
        return ()
    if not isinstance(logit_bias, dict):
        raise TypeError(f"logit_bias must be a mapping of token ids to biases, got {logit_bias!r}")
    if len(logit_bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias holds at most {MAX_LOGIT_BIAS} tokens, got {len(logit_bias)}", "logit_bias")
    pairs = {}
    for key, value in logit_bias.items():
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            key = int(key)
        if not _is_integer(key):
            raise RequestError(f"logit_bias: {key!r} is not a token id", "logit_bias")
        if not 0 <= int(key) < vocab_size:
            raise _outside_vocabulary("logit_bias", int(key), vocab_size)
        v = _real(value, f"logit_bias[{key}]")
        if not -100 <= v <= 100:
            raise RequestError(f"logit_bias[{key}] must be between -100 and 100, got {v!r}", "logit_bias")
        pairs[int(key)] = v
    return tuple(sorted(pairs.items()))


def prompt_field(index: int, count: int, name: str = "prompt") -> str:
    """How errors name prompt `index` of a request of `count` prompts: `prompt`, or `prompt[i]`
    among several."""
    return name if count == 1 else f"{name}[{index}]"


def input_too_long(context: int, tokens: int, field: str, characters: int | None = None) -> RequestError:
    """OpenAI's error for a prompt of `tokens` tokens that leaves no room to generate in a context
    of `context` tokens; with `characters`, for a text of that many characters that holds at least
    `tokens` tokens (known before it is tokenized)."""
    has = f"{tokens}" if characters is None else f"at least {tokens}"
    of = "" if characters is None else f" ({characters} characters)"
    return RequestError(f"This model's maximum context length is {context} tokens. However, your request has {has} "
                        f"input tokens{of}. Please reduce the length of the input.", field)


def _token_ids(prompt, field: str) -> list[int]:
    """A prompt as Python ints: a list / tuple of integers or a 1-D integer array."""
    if isinstance(prompt, (np.ndarray, jax.Array)) and prompt.ndim == 1 and np.issubdtype(prompt.dtype, np.integer):
        return np.asarray(prompt).tolist()
    if not isinstance(prompt, (list, tuple)):
        raise TypeError(f"{field} must be a list of token ids or a 1-D integer array, got {prompt!r}")
    bad = next((t for t in prompt if not _is_integer(t)), None)
    if bad is not None:
        raise TypeError(f"{field} holds a non-integer token {bad!r}")
    return [int(t) for t in prompt]


def check_prompt(prompt, max_tokens, vocab_size: int, context: int, lookahead: int = 0, *, field: str = "prompt",
                 max_tokens_field: str = "max_tokens") -> tuple[list[int], int]:
    """A prompt (token ids: a list / tuple of integers or a 1-D integer array) and the most tokens
    to generate after it, checked against the vocabulary and a context of `context` positions,
    of which a speculating request needs `lookahead` past its last token (a verification writes
    its drafts there). Errors name the prompt `field` and the limit `max_tokens_field`. Returns
    (the prompt as Python ints, max_tokens)."""
    prompt = _token_ids(prompt, field)
    if not prompt:
        raise RequestError(f"{field} is empty: a prompt needs at least one token", field)
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise _outside_vocabulary(field, bad, vocab_size)
    max_tokens = _integer(max_tokens, max_tokens_field)
    if max_tokens < 1:
        raise RequestError(f"{max_tokens_field} must be at least 1, got {max_tokens}", max_tokens_field)
    if len(prompt) >= context:
        raise input_too_long(context, len(prompt), field)
    need = len(prompt) + max_tokens + lookahead
    if need > context:
        drafts = f", {lookahead} for speculative decoding" if lookahead else ""
        raise RequestError(f"This model's maximum context length is {context} tokens. However, you requested {need} "
                           f"tokens ({len(prompt)} in the messages, {max_tokens} in the completion{drafts}). Please "
                           f"reduce the length of the messages or completion.", max_tokens_field)
    return prompt, max_tokens


@dataclasses.dataclass(frozen=True)
class Request:
    """A checked batch (`validate_request`, or the engine's checked requests): row b continues
    prompts[b] by up to max_tokens[b] tokens, drawing and stopping as sampling[b], in a cache of
    max_len positions that holds every row's prompt, its tokens and its speculation's lookahead."""

    prompts: list[list[int]]
    max_tokens: tuple[int, ...]
    sampling: tuple[SamplingParams, ...]
    max_len: int

    @property
    def speculative_tokens(self) -> int:
        """The drafts a round the batch runs with (0: no speculation): the most a row asks for."""
        return max(s.speculative_tokens for s in self.sampling)


def _prompt_list(prompts) -> list:
    """The prompts of a `generate` call, each to be checked by `check_prompt`: the rows of an
    integer array `[B, S]`, or the items of a list / tuple."""
    if isinstance(prompts, (np.ndarray, jax.Array)):
        if prompts.ndim != 2 or not np.issubdtype(prompts.dtype, np.integer):
            raise TypeError(f"prompts must be an integer array [B, S] or a list of token-id lists, got "
                            f"{prompts.dtype}{list(prompts.shape)}")
        return np.asarray(prompts).tolist()
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of token-id lists or an integer array [B, S], got "
                        f"{type(prompts).__name__}")
    flat = next((r for r in prompts if _is_integer(r)), None)
    if flat is not None:
        raise TypeError(f"prompts must be a list of prompts, each a list of token ids; got a flat list of "
                        f"integers (one prompt is [[{flat!r}, ...]])")
    return list(prompts)


def validate_request(prompts, cfg: ModelConfig, max_new_tokens, temperature=0.0, top_k=0, top_p=1.0,
                     eos_token_id=None, seed=0, max_len=None, speculative_tokens=0) -> Request:
    """`generate`'s arguments checked against the model, before anything compiles (the settings
    apply to every row; row b draws with seed + b). With speculative_tokens k, the cache holds k
    positions more (a verification writes k past the last token it keeps). max_len (the cache
    length) defaults to the bucket (buckets.length_bucket) of the longest prompt, max_new_tokens
    and k, at most the model's max_position_embeddings."""
    rows = _prompt_list(prompts)
    if not rows:
        raise RequestError("prompts is empty: give at least one prompt", "prompts")
    V, limit = cfg.vocab_size, cfg.max_position_embeddings
    sampling = SamplingParams.checked(V, temperature, top_k, top_p, seed, eos_token_id, speculative_tokens,
                                      stop_field="eos_token_id")
    k = sampling.speculative_tokens
    if max_len is not None:
        max_len = _integer(max_len, "max_len")
        if not 1 <= max_len <= limit:
            raise RequestError(f"max_len must be between 1 and the model's max_position_embeddings ({limit}), got "
                               f"{max_len}", "max_len")
    context = limit if max_len is None else max_len
    checked = [check_prompt(r, max_new_tokens, V, context, k, field=prompt_field(b, len(rows)),
                            max_tokens_field="max_new_tokens") for b, r in enumerate(rows)]
    rows, max_new_tokens = [p for p, _ in checked], checked[0][1]
    if max_len is None:
        max_len = min(length_bucket(max(map(len, rows)) + max_new_tokens + k), limit)
    return Request(rows, (max_new_tokens,) * len(rows),
                   tuple(dataclasses.replace(sampling, seed=sampling.seed + b) for b in range(len(rows))), max_len)
