"""`generate`: every row's prompt prefilled in chunks, then a decode loop inside one `jax.jit`
(`lax.while_loop`) over a donated cache: the programs of dsv4_jax/runtime/decode.py.

Every row has its own position in the cache (dsv4_jax/model/cache.py), so a ragged batch prefills each
row's own prompt: chunk k holds tokens k*C .. (k+1)*C - 1 of every row (C = PREFILL_CHUNK), a row
whose prompt has ended holds its state (its part of the chunk is padding), and the last chunk is
cut to the power of two (from MIN_PREFILL_CHUNK) that holds the longest rest. A row's prompt is
thus cut where it would be cut alone, and each row then decodes from its own position; the
rows of a batch compute what they compute alone, the same operations in another batch shape
(fp32: logits equal to about 1e-6, the same greedy tokens; bf16 rounds each product of a batch
like the lone one's as long as XLA picks the same kernels).

Every shape the compiled programs see comes from a bucket, so requests of nearby sizes reuse
them: the batch is padded to 1, 2, 4 or 8 rows, then a multiple of 8 (and of the devices the
model's mesh splits sequences over; the extra rows are done from the start); the cache and the
decode loop's token buffer hold max_len tokens, by default the first of 128 x (1, 2, 3, 4, 6, 8,
12, 16, ...) that fits the longest prompt plus max_new_tokens. So a (batch, max_len) bucket
compiles one decode loop and at most six prefill chunk programs, each once.

Sampling draws row b with the seed `seed + b` (dsv4_jax/runtime/sampling.py): a row's draws do not
depend on the rows beside it, and a one-prompt call gives what the serving engine gives for
that prompt with that seed.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Sequence

import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from dsv4_jax.model.config import ModelConfig
from dsv4_jax.model.deepseek_v4 import RUNTIME_OPTIONS, DeepseekV4, with_options
from dsv4_jax.model.layer_weights import unstack_layers
from . import decode, speculative
from .buckets import PREFILL_CHUNK, batch_bucket, prefill_chunks
from .request import Request, SamplingParams, validate_request

EOS_SLOTS = 8


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """tokens int32 `[B, N]`, N the most tokens a row may get (row b's first lengths[b] are
    generated, the rest 0); lengths int32 `[B]` (an eos token, when produced, is included);
    speculation: with speculative_tokens, the counters of `speculation_stats`, else None."""

    tokens: np.ndarray
    lengths: np.ndarray
    speculation: dict | None = None

    def rows(self) -> list[list[int]]:
        return [list(map(int, t[:n])) for t, n in zip(self.tokens, self.lengths)]


def _stop_ids(sampling: Sequence[SamplingParams], rows: int) -> np.ndarray:
    """Each row's stop ids as int32 `[rows, K]` (rows past len(sampling): none), K = EOS_SLOTS or
    the next power of two above the most a row has, padded with -1 (which no token equals), so
    that none, one or a few ids share the compiled loop."""
    most = max(len(s.stop_token_ids) for s in sampling)
    ids = np.full((rows, max(EOS_SLOTS, 1 << max(most - 1, 0).bit_length())), -1, np.int32)
    for b, s in enumerate(sampling):
        ids[b, : len(s.stop_token_ids)] = s.stop_token_ids
    return ids


_PARAMETERS = ("model", "prompts", "max_new_tokens", "temperature", "top_k", "top_p", "eos_token_id", "seed",
               "max_len", "speculative_tokens")


def generate(model: DeepseekV4, prompts: Sequence[Sequence[int]] | np.ndarray, max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             eos_token_id: int | Sequence[int] | None = None, seed: int = 0, max_len: int | None = None,
             speculative_tokens: int = 0, **options) -> GenerateOutput:
    """Continues each prompt by up to max_new_tokens tokens.

    prompts: a list of token-id lists (ragged; a row may be a 1-D integer array) or an int array
    `[B, S]`. Greedy at temperature 0, else sampling with top_k (0: off, at most the vocabulary)
    / top_p; a row stops at eos_token_id (one id, or a list: any of them). max_len sizes the
    cache (default: the longest prompt plus max_new_tokens, rounded up to a bucket; see the
    module docstring). speculative_tokens k > 0 decodes with k drafts a round from the
    checkpoint's MTP block (`load(..., mtp=True)`; dsv4_jax/runtime/speculative.py): greedy output is the
    same, sampled output has the same distribution, and `speculation` says what was accepted.
    Invalid input raises ValueError (request.RequestError, naming the argument, in the wording
    of the engine and the server; TypeError for a wrong type or an unknown keyword) before
    anything compiles. `options` override the model's run-time options for this call (e.g.
    use_index_cache=True, index_topk_freq=2; see `load`).
    """
    unknown = sorted(set(options) - set(RUNTIME_OPTIONS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], _PARAMETERS + RUNTIME_OPTIONS, n=1)
        raise TypeError(f"generate() got an unexpected keyword argument {unknown[0]!r}"
                        + (f" (did you mean {close[0]!r}?)" if close else ""))
    cfg = with_options(model.config, **options)
    req = validate_request(prompts, cfg, max_new_tokens, temperature, top_k, top_p, eos_token_id, seed, max_len,
                           speculative_tokens)
    if req.speculative_tokens and model.mtp is None:
        raise ValueError("speculative_tokens needs the checkpoint's MTP block: load the model with "
                         "dsv4_jax.load(path, mtp=True)")
    return run_request(model, cfg, req)


def run_request(model: DeepseekV4, cfg: ModelConfig, req: Request, drafter=None) -> GenerateOutput:
    """`generate` on a checked request, through the programs of dsv4_jax/runtime/decode.py: each
    row with its own token limit, sampling and stop ids. drafter (speculation only): the draft
    source (default: the model's MTP block, `speculative.BlockDrafts`; a test's or a benchmark's
    may draft from a known continuation)."""
    B, Bb = len(req.prompts), model.batch_rows(batch_bucket(len(req.prompts)))
    lengths = np.zeros((Bb,), np.int32)  # the padding rows: no prompt, done from the start
    max_new = np.zeros((Bb,), np.int32)
    buf = np.zeros((Bb, req.max_len), np.int32)
    for b, r in enumerate(req.prompts):
        lengths[b], max_new[b] = len(r), req.max_tokens[b]
        buf[b, : len(r)] = r
    params = unstack_layers(model.params)
    sample = decode.Sampling.rows(Bb, cfg.vocab_size, dict(enumerate(req.sampling)))
    done, eos = np.arange(Bb) >= B, _stop_ids(req.sampling, Bb)
    k = req.speculative_tokens
    mtp = model.mtp.params if k else None
    state = decode.new_state(model, Bb, req.max_len, cfg, k)
    with model.on_mesh():
        first = jnp.zeros((Bb,), jnp.int32)  # each row's first token, from the chunk its prompt ends in
        for ids, n, ends in prefill_chunks(buf, lengths, PREFILL_CHUNK):
            drawn, state = decode.prefill(params, mtp, state, None, ids, n, None, ends, sample, cfg)
            first = jnp.where(ends, drawn.tokens, first)
        counters = None
        if k:
            drafter = (speculative.BlockDrafts(mtp) if drafter is None else drafter).for_rows(Bb)
            drafts = np.zeros((Bb,), np.int32)
            drafts[:B] = [s.speculative_tokens for s in req.sampling]
            out, n_gen, counters, _ = decode.verify_loop(params, drafter, state, first, buf, done, max_new, sample,
                                                         eos, drafts, k, cfg)
        else:
            out, n_gen, _ = decode.decode_loop(params, state, first, buf, done, max_new, sample, eos, cfg)
        out, n_gen = (np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in (out, n_gen))
    tokens = np.zeros((B, max(req.max_tokens)), np.int32)
    for b in range(B):
        tokens[b, : n_gen[b]] = out[b, lengths[b]: lengths[b] + n_gen[b]]
    return GenerateOutput(tokens=tokens, lengths=n_gen[:B].astype(np.int32),
                          speculation=None if counters is None else speculation_stats(counters))


def speculation_stats(counters: dict) -> dict:
    """A speculative run's counters (`decode.verify_loop`) by the names the engine and the server
    use (speculative.SPEC_DECODE_COUNTERS, `accepted_at(i)`), with "rounds" (main-model steps) and
    the acceptance figures (`speculative.acceptance`)."""
    c = {k: np.asarray(v).tolist() for k, v in counters.items()}
    c.update({speculative.accepted_at(i): n for i, n in enumerate(c.pop("accepted_per_position"))})
    return {**c, **speculative.acceptance(*(c[name] for name in speculative.SPEC_DECODE_COUNTERS))}
