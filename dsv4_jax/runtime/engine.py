"""The serving engine: continuous batching over a fixed set of cache slots and a pool of cache
blocks.

Requests (token ids, a token limit and `request.SamplingParams`: sampling, a seed, stop ids; all
checked by dsv4_jax/runtime/request.py, as `generate` and the server check theirs) wait in a
queue, are admitted to free slots, prefilled in chunks interleaved with the decode steps of the
running slots, stream their tokens as they come, and free their slot at a stop token, their token
limit, the slot's length or a cancel. Each slot is a row of one cache with its own position
(dsv4_jax/model/cache.py), so rows at any positions decode together in one program, and a row can
be reset and prefilled into while the others hold their state.

One engine step (`Engine.step`):
1. admits waiting requests into free slots (first come, first served);
2. prefills: requests still prefilling get a chunk each of up to `prefill_chunk` tokens, oldest
   first, while the step's tokens stay within `max_tokens_per_step` (one chunk always goes, so
   prefill is never starved); their rows run as one sub-batch of the cache (`take_rows` /
   `put_rows`); a request whose prompt completes samples its first token;
3. decodes: every slot holding a generating request advances one token (one program over all
   slots; the others hold).
A long prompt therefore costs its neighbours one chunk's time per step, not its whole prefill.

The compressed entries live in paged pools shared by the slots (dsv4_jax/model/cache.py): blocks
of `block_size` tokens, `num_blocks` of them (default: enough for every slot at max_len; or what
`kv_cache_memory` bytes hold), handed out as sequences grow (dsv4_jax/runtime/blocks.py). A
request is admitted when a slot is free and the blocks for its whole prompt are; a decode step
first gives every generating request the blocks it will write, and when there are none left the
newest running request is preempted: its blocks and slot are freed and it waits again at the
front of the queue, to be prefilled anew with its prompt and the tokens it has produced, then to
go on where it stopped, its next token drawn with the key it would have had (with speculation
its MTP block's pending row starts from its last token, as before); nothing it streamed changes,
sampled or greedy.

With prefix caching (`enable_prefix_caching`, on by default), full blocks stay cached by the
tokens up to their end (dsv4_jax/runtime/blocks.py), also after their request ends. An admitted
request takes the longest cached prefix of its context (full blocks, up to its last token, which
must run for its first token). Its window rings and compressor states at the reuse point come
from a snapshot where one is kept: wherever a prefill chunk ends at a block's end, a row's state
there is saved (`prefix_snapshots` places, default twice the slots, the least recently used given
up first) under that block's key, and a request starts from the one at the latest block end of
its cached prefix (`_snapshot_for`), running only what comes after it. Otherwise it prefills from
`recompute_span` tokens before the reuse point: those tokens run again to rebuild the rings and
states there, their compressed entries read from the shared blocks (dsv4_jax/model/cache.py),
each chunk of them through only the layers it needs (`layers_to_run`: the lowest layers first,
every layer by the reuse point), the last one ending at the reuse point, whose state is then
saved for the next request. Then the rest of the prompt runs as usual. Its tokens are those it
gets without the cache. The counters `prefix_cache_queries` and `prefix_cache_hits` count the
admitted prompt tokens looked up and those found (vLLM's), `prefix_cache_snapshot_hits` the
requests started from a snapshot.

Every shape is bucketed: the decode program is one, the fork one (`fork_rows` choices, padded),
the block table's update one per power of two of rows (up to the slots), the prefill program one
per (rows, chunk) pair of powers of two (rows up to the slots, chunk from 16 up to
prefill_chunk), so after `warmup()` (which also runs each program once) nothing compiles,
whatever the requests. A
prompt is cut at multiples of prefill_chunk, as `generate` cuts it, so a request's greedy tokens
are those `generate` gives for its prompt alone (after a prefix-cache hit its chunks start at its
recomputed span or its snapshot instead: the same values to fp32 rounding, and from a snapshot
saved on those chunk boundaries the same bits, tests/test_prefix_cache.py).

With `speculative_tokens` k (dsv4_jax/runtime/speculative.py: the checkpoint's MTP block drafts, the main
model verifies), the decode step is one verification round: each generating slot gets 1 to
k + 1 tokens, as many as it keeps (a request may ask for fewer drafts than k); prefill runs the
block over the prompt too. The counters `spec_decode_num_drafts`, `..._num_draft_tokens`,
`..._num_accepted_tokens` and `..._num_accepted_tokens_pos_<i>` (`stats()`) say what was kept.
A request whose draws depend on the tokens before it (penalties) or that has a constraint
proposes no drafts: its token comes from the verification's first position.

Beyond the sampling itself (dsv4_jax/runtime/sampling.py: logit bias, min_tokens, penalties from
each slot's token counts kept in the state, min_p), a request may carry:
- a `constraint` (a grammar, dsv4_jax/serving/grammar.py; any object with `fill(row)`,
  `accept(token)` and `done`): before each step that draws its token the engine asks it for the
  allowed tokens (a bitmask row, sampling.Controls.mask), after it hands it the token drawn, and
  the request stops ("stop") once the constraint is done;
- logprobs (SamplingParams.logprobs): each token's and the most likely tokens' log-probabilities
  under the model's raw distribution, in `request.logprobs`, one `TokenLogprobs` per token;
- `after`, another request with the same prompt (the choices of an `n` > 1 request, below).

The choices of an `n` > 1 request share one prefill: each choice after the first is submitted
`after` the first (its parent) and waits until the parent's prompt is prefilled. In the step that
prefills the parent's last prompt chunk, its waiting choices are forked from its slot
(`decode.fork`, one program): each takes a free slot, its row gets a copy of the parent's row
(position, window rings, compressor states; with speculation the MTP block's row, carry and
pending row) and its penalty history as any new request does, and it draws its first token from
the parent's prompt logits (kept in the state by the prefill) with its own sampling and seed,
so its tokens are those it gets alone. The prompt's full blocks are shared by reference count
(`BlockPool.hold`); the partly filled last block, which each choice goes on writing into, is
copied into a fresh block of its own (a copy now rather than copy-on-write: every choice writes
into it at its first decode step anyway). A choice that finds no free slot on the parent's
device (on a mesh each device's slots draw on its own blocks) or no block then is admitted later
as any request: from the prompt's cached blocks with prefix caching, else prefilled in full; so
is every choice in deterministic mode, where no prefill program runs. A forked choice is
otherwise a request like any other: preempted, it lets go of its blocks (the shared ones by
reference count) and is prefilled anew from its own prompt and tokens. The counter
`forked_requests` counts the choices forked.

Deterministic mode (`deterministic`): a request's tokens do not depend on what else runs or on
how its prompt is cut. Every step is the one decode program over all slots, a fixed shape, and a
prompt goes in one token a step through it (its row restarts at its first token; no prefill
program, no chunks), so each row's arithmetic is the same whatever the other rows hold and
however the steps fall: a prompt of n tokens takes n steps, the price (docs/serving.md). No
speculation in this mode.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import threading
import time
import typing
from typing import Callable

import jax
import numpy as np

from dsv4_jax.model import sharding
from dsv4_jax.model.cache import (block_bytes, blocks_per_row, cache_spec, check_block_size, check_kv_cache_dtype,
                                  default_block_size, layers_to_run, recompute_span, row_state)
from dsv4_jax.model.deepseek_v4 import DeepseekV4
from dsv4_jax.model.layer_weights import unstack_layers
from . import decode, speculative
from .blocks import BlockPool, SnapshotIndex, chain
from .buckets import MIN_PREFILL_CHUNK, PREFILL_CHUNK, batch_bucket, chunk_bucket
from .generate import run_request
from .request import (MAX_SPECULATIVE_TOKENS, Request, RequestError, SamplingParams, check_prompt,
                      check_speculative_tokens, validate_request)
from .sampling import only_token


KV_CACHE_FRACTION = 0.9  # of a device's free memory for the cache when kv_cache_memory is not given


def device_free_bytes(devices: list) -> int | None:
    """The least free memory of `devices` (bytes_limit - bytes_in_use, as the runtime reports
    it), None when one reports none (a CPU)."""
    free = []
    for d in devices:
        stats = d.memory_stats()
        if not stats or "bytes_limit" not in stats:
            return None
        free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return min(free)


class EngineConfigError(ValueError):
    """An engine setting that cannot work; `param` names the constructor argument."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class TokenLogprobs(typing.NamedTuple):
    """The model's log-probability of a drawn token and its top alternatives (most likely first;
    as many as the request's SamplingParams.logprobs)."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class _AnyToken:
    """A constraint that allows every token (warm-up runs the constrained path with it)."""

    done = False

    def fill(self, row: np.ndarray) -> None:
        row[:] = -1

    def accept(self, token: int) -> None:
        pass


class QueueFull(Exception):
    """`max_queue` requests already wait with no free slot to take them."""


@dataclasses.dataclass
class EngineRequest:
    """A submitted request (checked: its prompt, token limit and sampling) and what became of it.
    Timestamps are `time.monotonic()` seconds."""

    id: int
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    on_token: Callable[["EngineRequest", int | None], None] | None = None  # (request, token or None at the end)
    tokens: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length" or "cancelled"
    arrival: float = 0.0
    admitted: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)
    slot: int | None = None
    prefilled: int = 0  # tokens of `context` in the cache
    cancelled: bool = False
    blocks: list[int] = dataclasses.field(default_factory=list)  # the cache blocks it holds, in order
    keys: list[bytes] = dataclasses.field(default_factory=list)  # blocks.chain keys of its full blocks so far
    cached: int = 0  # its first blocks known to the prefix cache
    start: int = 0  # the position its prefill starts from (inside a cached prefix after a hit)
    reuse: int = 0  # its cached prefix's end (after a hit)
    restore: int | None = None  # the snapshot its first chunk starts from, until it has
    restored: bool = False  # its prefill started from a snapshot
    resume: list[int] | None = None  # after a preemption: the prompt and the tokens it had drawn but the last
    preempted: int = 0
    constraint: typing.Any = None  # a grammar's host state (module doc)
    after: "EngineRequest | None" = None  # forked from this one once its prompt is prefilled (module doc)
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)

    @property
    def span_start(self) -> int:
        """Where the span it runs to rebuild its state at `reuse` starts (`recompute_span`); 0 when
        its state is its sequence's own from its first chunk on (prefilled from 0, or from a
        snapshot)."""
        return 0 if self.restored else self.start

    @property
    def drafts(self) -> int:
        """Drafts it proposes a round: none when penalized or constrained (module doc)."""
        s = self.sampling
        return 0 if s.penalized or self.constraint is not None else s.speculative_tokens

    @property
    def ready(self) -> bool:
        """Whether it may be admitted: the request it comes `after` has its prompt prefilled."""
        a = self.after
        return a is None or a.done or (a.slot is not None and a.prefilled >= len(a.prompt))

    @property
    def context(self) -> list[int]:
        """The tokens to prefill: the prompt, or after a preemption the prompt and every token it
        drew but the last (which the next decode step feeds)."""
        return self.prompt if self.resume is None else self.resume

    @property
    def in_cache(self) -> int:
        """Positions its cache holds: those prefilled, then every token but the last drawn."""
        n = len(self.context)
        return self.prefilled if self.prefilled < n else max(n, len(self.prompt) + len(self.tokens) - 1)

    def tokens_at(self, a: int, b: int) -> list[int]:
        """Its tokens at positions a .. b - 1 (the prompt's, then those it drew)."""
        n = len(self.prompt)
        return self.prompt[a:b] + self.tokens[max(a - n, 0):max(b - n, 0)]

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class Engine:
    """Continuous batching over `slots` cache rows of `max_len` tokens each (see the module doc).

    `submit` queues a request (thread-safe) and returns it; tokens arrive through its `on_token`
    callback (called from the thread running `step`) and in `request.tokens`. `run_forever` /
    `start` drive `step` in a loop; tests call `step` directly."""

    def __init__(self, model: DeepseekV4, *, slots: int = 8, max_len: int = 4096, prefill_chunk: int = 512,
                 max_tokens_per_step: int | None = None, max_queue: int = 1024, speculative_tokens: int = 0,
                 block_size: int | None = None, kv_cache_memory: int | None = None,
                 enable_prefix_caching: bool = True, kv_cache_dtype: str = "auto", deterministic: bool = False,
                 prefix_snapshots: int | None = None):
        cfg = model.config
        if deterministic and speculative_tokens:
            raise EngineConfigError("deterministic", "deterministic mode runs no speculation: drop speculative_tokens")
        if speculative_tokens and model.mtp is None:
            raise ValueError("speculative_tokens needs the checkpoint's MTP block: load the model with mtp=True")
        check_speculative_tokens(speculative_tokens, MAX_SPECULATIVE_TOKENS)
        if slots < 1 or max_len < 2 or prefill_chunk < MIN_PREFILL_CHUNK or max_queue < 1:
            raise ValueError(f"slots >= 1, max_len >= 2, prefill_chunk >= {MIN_PREFILL_CHUNK} and max_queue >= 1 are "
                             f"needed, got {slots}, {max_len}, {prefill_chunk}, {max_queue}")
        if prefill_chunk & (prefill_chunk - 1):
            raise ValueError(f"prefill_chunk must be a power of two, got {prefill_chunk}")
        if max_len > cfg.max_position_embeddings:
            raise ValueError(f"max_len {max_len} exceeds the model's max_position_embeddings "
                             f"({cfg.max_position_embeddings})")
        self.model, self.cfg = model, cfg
        self.params = self._step_params()
        self.slots, self.max_len, self.prefill_chunk = model.batch_rows(slots), max_len, prefill_chunk
        self.max_tokens_per_step = max_tokens_per_step or prefill_chunk + self.slots
        if self.max_tokens_per_step < prefill_chunk:
            raise ValueError(f"max_tokens_per_step ({self.max_tokens_per_step}) must hold a prefill chunk "
                             f"({prefill_chunk})")
        self.max_queue = max_queue
        self.deterministic = deterministic
        self.k = speculative_tokens
        self.mtp = model.mtp.params if self.k else None  # the block's rows run in prefill only with speculation
        self.block_size = default_block_size(cfg) if block_size is None else block_size
        try:
            check_block_size(cfg, self.block_size)
        except ValueError as e:
            raise EngineConfigError("block_size", str(e)) from None
        try:
            check_kv_cache_dtype(kv_cache_dtype)
        except ValueError as e:
            raise EngineConfigError("kv_cache_dtype", str(e)) from None
        self.kv_cache_dtype = kv_cache_dtype
        self.row_shards = 1 if model.mesh is None else cfg.layout.shards(sharding.BATCH, model.mesh)
        paged = "blocks" in cache_spec(cfg, 1, self.block_size, self.model.dtype, block_size=self.block_size,
                                       num_blocks=1)
        if prefix_snapshots is not None and prefix_snapshots < 0:
            raise EngineConfigError("prefix_snapshots", f"prefix_snapshots must be >= 0, got {prefix_snapshots}")
        snapshots = 2 * self.slots if prefix_snapshots is None else prefix_snapshots
        # Prefix caching's saved row states, as many on each of the mesh's row shards; none where no
        # prefill program runs (deterministic mode).
        self.snapshots = (0 if deterministic or not (enable_prefix_caching and paged)
                          else -(-snapshots // self.row_shards) * self.row_shards)
        self.num_blocks = self._num_blocks(kv_cache_memory)
        self.state = self._new_state()
        self.paged = self.state is not None and paged
        self.table = np.zeros((self.slots, blocks_per_row(max_len + self.k, self.block_size)), np.int32)
        self.shared = np.zeros((self.slots,), np.int32)  # each slot's reuse point (cache.py's `shared`)
        self.prefix_caching = enable_prefix_caching and self.paged
        self.pool = BlockPool(self.num_blocks, self.slots, self.row_shards, caching=self.prefix_caching)
        self.saved = SnapshotIndex(self.snapshots, self.row_shards) if self.snapshots and self.prefix_caching else None
        # The most choices one fork program starts: the other slots of the parent's device.
        self.fork_rows = 0 if deterministic else self.pool.rows_per_shard - 1
        self.recompute = recompute_span(cfg, lookahead_layers=1 if self.k else 0)
        # The slots whose table rows or reuse points the device has yet to get (`_upload_table`):
        # every row at first, as the device's table starts otherwise.
        self._changed_rows = set(range(self.slots)) if self.paged else set()
        # The decode step's sampling controls on the devices, and the (slot, request id) pairs they
        # are for (`_decode_sampling`).
        self._controls: tuple[tuple, decode.Sampling] | None = None
        self.waiting: collections.deque[EngineRequest] = collections.deque()
        self.running: dict[int, EngineRequest] = {}  # slot -> request
        self.free = list(range(self.slots))
        self.next_token = np.zeros((self.slots,), np.int32)  # each generating slot's last token
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.ids = itertools.count()
        self.counters = collections.Counter()
        if self.prefix_caching:
            self.counters["prefix_cache_queries"] = self.counters["prefix_cache_hits"] = 0
        if self.saved is not None:
            self.counters["prefix_cache_snapshot_hits"] = 0
        if self.fork_rows:
            self.counters["forked_requests"] = 0
        if self.k:  # reported from the start, zero until a round runs
            for name in (*speculative.SPEC_DECODE_COUNTERS, *map(speculative.accepted_at, range(self.k))):
                self.counters[name] = 0
        self._stop = False
        self._thread: threading.Thread | None = None

    def _step_params(self):
        """The weights the engine's programs read: on CPU the large layer weights split into one
        buffer per layer, once (dsv4_jax/model/layer_weights.py)."""
        return unstack_layers(self.model.params)

    def _num_blocks(self, kv_cache_memory: int | None) -> int:
        """The pools' blocks: what kv_cache_memory bytes hold, else KV_CACHE_FRACTION of what the
        devices have free less the slots' rings and states and the snapshots (on a device that
        reports no memory, as a CPU: one max_len sequence per slot); a multiple of the mesh's row
        shards, each shard able to hold one max_len sequence."""
        nb, shards = blocks_per_row(self.max_len + self.k, self.block_size), self.row_shards
        per = block_bytes(self.cfg, self.block_size, self.model.dtype, self.kv_cache_dtype)
        if kv_cache_memory is None:
            devices = self.model.mesh.devices.flat if self.model.mesh is not None else jax.devices()[:1]
            free = device_free_bytes(list(devices))
            if free is None:
                return self.slots * nb
            def spec(rows: int) -> dict:
                return cache_spec(self.cfg, rows, self.max_len + self.k, self.model.dtype, self.k,
                                  block_size=self.block_size, num_blocks=0, kv_cache_dtype=self.kv_cache_dtype)

            def nbytes(tree: dict) -> int:
                return sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize for shape, dtype in
                           jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, tuple)))

            rows = nbytes(spec(self.slots // shards)) + nbytes(row_state(spec(self.snapshots // shards)))
            kv_cache_memory = max(int(free * KV_CACHE_FRACTION) - rows, 0) * shards
        n = kv_cache_memory // max(per, 1) // shards * shards
        if n < nb * shards:
            raise EngineConfigError(
                "kv_cache_memory", f"kv_cache_memory {kv_cache_memory} bytes holds {n} blocks of {self.block_size} "
                f"tokens ({per} bytes each); one sequence of max_len {self.max_len} tokens needs {nb}"
                + (f" on each of the mesh's {shards} row shards" if shards > 1 else "")
                + f": at least {nb * shards * per} bytes")
        return n

    # ---- requests -----------------------------------------------------------------------------

    def submit(self, prompt, max_tokens: int, *, on_token=None, speculative_tokens: int | None = None,
               constraint=None, after: EngineRequest | None = None, **sampling) -> EngineRequest:
        """Queues a request; request.RequestError (a ValueError; TypeError for a wrong type) if it
        cannot be served: request.py's checks (`check_prompt` against this engine's max_len tokens,
        `SamplingParams.checked`, whose keywords `sampling` takes: temperature, top_k, top_p,
        seed, stop_token_ids, min_p, the penalties, logit_bias, min_tokens, logprobs), in the
        wording `generate` and the server use. QueueFull if the queue is full. speculative_tokens:
        drafts a round for this request (default, and at most, the engine's); constraint, after:
        the module doc."""
        V = self.cfg.vocab_size
        # No lookahead counts against the context: the slots hold k positions past max_len.
        prompt, max_tokens = check_prompt(prompt, max_tokens, V, self.max_len)
        sampling = SamplingParams.checked(V, speculative_tokens=self.k if speculative_tokens is None
                                          else speculative_tokens, max_speculative_tokens=self.k, **sampling)
        with self.lock:
            # Only requests that no free slot will take at the next step wait; the others are
            # admitted then, so they never count against max_queue.
            queued = len(self.waiting) - len(self.free)
            if queued >= self.max_queue:
                raise QueueFull(f"{queued} requests are waiting for a slot already (the queue holds {self.max_queue})")
            req = EngineRequest(next(self.ids), prompt, max_tokens, sampling, on_token, arrival=time.monotonic(),
                                constraint=constraint, after=after)
            self.waiting.append(req)
            self.counters["requests"] += 1
            self.wake.notify()
        return req

    def cancel(self, req: EngineRequest) -> None:
        """Ends the request at the next step (its slot is freed); a no-op once it is done."""
        with self.lock:
            req.cancelled = True
            self.wake.notify()

    def _new_state(self) -> decode.DecodeState:
        """The device state of the slots (decode.new_state): their cache and, with speculation (k
        drafts), the MTP block's state. The caches hold k positions past max_len (a verification
        writes k past the last token it keeps)."""
        return decode.new_state(self.model, self.slots, self.max_len + self.k, k=self.k, block_size=self.block_size,
                                num_blocks=self.num_blocks, kv_cache_dtype=self.kv_cache_dtype, penalties=True,
                                forks=True, snapshots=self.snapshots)

    # ---- the step -----------------------------------------------------------------------------

    def step(self) -> bool:
        """One engine step (see the module doc); returns whether there was anything to do."""
        with self.lock:
            self._drop_cancelled()
            # First come, first served, passing over the requests that wait for another's prefill.
            while self.free and (req := next((r for r in self.waiting if r.ready), None)) is not None:
                if not self._admit(req, slot := self._slot_for(req)):
                    break
                self._place(req, slot)
        if self.deterministic:
            running = self._make_room(list(self.running.values()))
            self._upload_table()
            if running:
                self._feed(running)
            return bool(running)
        generating = self._make_room([r for r in self.running.values() if r.prefilled == len(r.context)])
        prefilling = sorted((r for r in self.running.values() if r.prefilled < len(r.context)), key=lambda r: r.id)
        self._upload_table()
        budget = self.max_tokens_per_step - len(generating)
        chosen = []
        for r in prefilling:
            n = min(self.prefill_chunk, len(r.context) - r.prefilled)
            if self.saved is not None and r.prefilled < r.reuse:  # a chunk ends there: its state is saved
                n = min(n, r.reuse - r.prefilled)
            if chosen and n > budget:
                break
            chosen.append((r, n))
            budget -= n
        if chosen:
            self._prefill(chosen)
        if generating:
            self._decode(generating)
        return bool(chosen or generating)

    def _slot_for(self, req: EngineRequest) -> int:
        """The free slot to admit req to: the lowest, or on a mesh (each device's slots draw on
        its own blocks) the lowest on the device holding most of req's cached prefix."""
        if not self.prefix_caching or self.row_shards == 1:
            return self.free[0]
        keys = self._keys(req, (len(req.context) - 1) // self.block_size)
        return max(self.free, key=lambda s: (self.pool.found(s, keys), -s))

    def _admit(self, req: EngineRequest, slot: int) -> bool:
        """Gives req (at slot) the cached blocks of its context's longest cached prefix and the
        blocks for the rest of it and its first token, and sets where its prefill starts; False
        (nothing given) if the pool lacks them."""
        context, hit = req.context, []
        if self.prefix_caching:
            hit = self.pool.lookup(slot, self._keys(req, (len(context) - 1) // self.block_size))
        req.blocks = list(hit)
        if not self._grow(req, slot, len(context) + 1):
            self.pool.give(slot, hit)
            req.blocks = []
            return False
        reuse = len(hit) * self.block_size
        req.cached, req.reuse, req.start = len(hit), reuse, max(reuse - self.recompute, 0)
        found = self._snapshot_for(req, slot, reuse)
        req.restored = found is not None
        req.restore = None
        if found is not None:
            req.restore, req.start = found
            self.saved.pin(req.restore)
            self.counters["prefix_cache_snapshot_hits"] += 1
        req.prefilled = req.start
        if self.paged:
            self.table[slot, :len(req.blocks)] = req.blocks
            self.shared[slot] = reuse
            self._changed_rows.add(slot)
        if self.prefix_caching:
            self.counters["prefix_cache_queries"] += len(context)
            self.counters["prefix_cache_hits"] += reuse
        return True

    def _snapshot_for(self, req: EngineRequest, slot: int, reuse: int) -> tuple[int, int] | None:
        """The snapshot to start req (at slot, its cached prefix ending at `reuse`) from and its
        position: the state saved at the latest end of a block of the prefix found, if it lies
        past the start of the span that would run instead (`recompute_span`); else None."""
        if self.saved is None:
            return None
        bs, shard = self.block_size, self.pool.shard_of(slot)
        keys = self._keys(req, reuse // bs)
        for j in range(len(keys), 0, -1):
            if j * bs <= reuse - self.recompute:
                return None
            at = self.saved.find(shard, keys[j - 1])
            if at is not None:
                return at, j * bs
        return None

    def _snapshot_place(self, req: EngineRequest, end: int) -> int:
        """Where req's state after a chunk ending at `end` is to be saved (`decode.prefill`'s keep):
        a snapshot's place if `end` ends a block and req's state there is its sequence's own (a
        span running before the reuse point rebuilds it only there); else past the last (none)."""
        none = self.snapshots
        if self.saved is None or end % self.block_size or not end:
            return none
        if req.span_start and end < req.reuse:
            return none
        at = self.saved.place_for(self.pool.shard_of(req.slot), self._keys(req, end // self.block_size)[-1])
        return none if at is None else at

    def _place(self, req: EngineRequest, slot: int) -> None:
        """Moves req (given its blocks) from the queue into slot, with its penalty history."""
        self.waiting.remove(req)
        self.free.remove(slot)
        req.slot = slot
        if req.admitted is None:
            req.admitted = time.monotonic()
        self.running[slot] = req
        if req.sampling.penalized:
            self._set_history(req)

    def _fork(self, parents: list[EngineRequest]) -> None:
        """Starts the waiting choices submitted `after` parents (whose prompts were just prefilled,
        their first tokens not yet emitted: a parent that stops at once still holds its slot) from
        copies of the parents' slots (module doc), as many as free slots on each parent's device,
        blocks and `fork_rows` allow; the rest are admitted later as any request."""
        P = self.fork_rows
        src, dst, src_block, dst_block = self._no_forks()
        forked: dict[int, EngineRequest] = {}
        with self.lock:
            for parent in parents:
                device = self.pool.shard_of(parent.slot)
                for req in [r for r in self.waiting if r.after is parent and r.admitted is None and not r.cancelled
                            and r.prompt == parent.prompt]:
                    slot = next((s for s in self.free if self.pool.shard_of(s) == device), None)
                    last = None if len(forked) == P or slot is None else self._share(parent, req, slot)
                    if last is None:
                        break
                    i = len(forked)
                    src[i], dst[i] = parent.slot, slot
                    if self.paged:
                        src_block[i], dst_block[i] = parent.blocks[last], req.blocks[last]
                    self._place(req, slot)
                    forked[i] = req
        if not forked:
            return
        with self.model.on_mesh():
            drawn, self.state = decode.fork(self.state, src, dst, src_block, dst_block, self._sampling(forked, P))
        self._upload_table()  # after the fork, which copied the parents' table rows into the new rows
        drawn = self._fetch(drawn, forked.values())
        self.counters["forked_requests"] += len(forked)
        for i, req in forked.items():
            self._emit_drawn(req, drawn, i)

    def _no_forks(self) -> tuple[np.ndarray, ...]:
        """`decode.fork`'s src, dst, src_block and dst_block `[fork_rows]`, every entry padding (a
        row and a block past the last)."""
        P = self.fork_rows
        return (np.zeros(P, np.int32), np.full(P, self.slots, np.int32), np.zeros(P, np.int32),
                np.full(P, self.num_blocks, np.int32))

    def _share(self, parent: EngineRequest, req: EngineRequest, slot: int) -> int | None:
        """Gives req (a choice of parent's prompt, to fork into slot) parent's full prompt blocks,
        held once more, and a fresh block for the partly filled last one and its first token.
        Returns that block's index in both tables (`_fork` copies parent's into req's), or None
        (nothing given) if the pool lacks it."""
        full = len(parent.prompt) // self.block_size
        if self.paged:
            req.blocks = parent.blocks[:full]
            self.pool.hold(slot, req.blocks)
            if not self._grow(req, slot, len(req.prompt) + 1):
                self.pool.give(slot, req.blocks)
                req.blocks = []
                return None
            self.shared[slot] = full * self.block_size  # its entries before it are the parent's
        req.prefilled, req.keys, req.cached = len(req.prompt), list(parent.keys), parent.cached
        return full

    def _set_history(self, req: EngineRequest) -> None:
        """req's penalty history into its slot's row (decode.set_history): its prompt's tokens, and
        the tokens it has fed back (after a preemption, all it drew but the last)."""
        V = self.cfg.vocab_size
        prompt = np.zeros(V, bool)
        prompt[req.prompt] = True
        counts = np.bincount(np.asarray(req.tokens[:-1], np.int64), minlength=V).astype(np.int32)
        self.state = decode.set_history(self.state, np.int32(req.slot), prompt, counts)

    def _keys(self, req: EngineRequest, n: int) -> list[bytes]:
        """The prefix-cache keys of req's first n blocks (of its tokens so far; kept on it)."""
        bs = self.block_size
        for j in range(len(req.keys), n):
            req.keys.append(chain(req.keys[-1] if req.keys else b"", req.tokens_at(j * bs, (j + 1) * bs)))
        return req.keys[:n]

    def _cache_full_blocks(self, req: EngineRequest) -> None:
        """Offers the prefix cache req's blocks that filled up since it last did."""
        if not self.prefix_caching:
            return
        full = min(req.in_cache // self.block_size, len(req.blocks))
        for j, key in enumerate(self._keys(req, full)[req.cached:], req.cached):
            self.pool.cache(req.slot, req.blocks[j], key)
        req.cached = max(req.cached, full)

    def _grow(self, req: EngineRequest, slot: int, tokens: int) -> bool:
        """Gives req (at slot) the blocks for its first `tokens` positions; False (nothing given)
        if the pool lacks them."""
        if not self.paged:
            return True
        need = blocks_per_row(min(tokens, self.max_len + self.k), self.block_size) - len(req.blocks)
        if need <= 0:
            return True
        got = self.pool.take(slot, need)
        if got is None:
            return False
        req.blocks += got
        self.table[slot, :len(req.blocks)] = req.blocks
        self._changed_rows.add(slot)
        return True

    def _make_room(self, generating: list[EngineRequest]) -> list[EngineRequest]:
        """The generating requests that decode this step, each given the blocks its step writes
        (its position and k drafts past it), oldest first; the newest running requests preempted
        while the blocks run short."""
        out = []
        for r in sorted(generating, key=lambda r: r.id):
            while r.slot is not None and not self._grow(r, r.slot, len(r.prompt) + len(r.tokens) + self.k):
                self._preempt(max(self.running.values(), key=lambda x: x.id))
            if r.slot is not None:
                out.append(r)
        return out

    def _preempt(self, req: EngineRequest) -> None:
        """Frees req's slot and blocks and queues it again first, to be prefilled anew with what it
        has so far (`context`)."""
        self._release(req)
        req.slot = None
        req.resume = (req.prompt + req.tokens[:-1]) if req.tokens else None
        req.prefilled, req.preempted = 0, req.preempted + 1
        self.counters["preemptions"] += 1
        with self.lock:
            self.waiting.appendleft(req)

    def _unpin(self, req: EngineRequest) -> None:
        """Lets go of the snapshot req was to start from (it has, or it leaves its slot)."""
        if req.restore is not None:
            self.saved.unpin(req.restore)
            req.restore = None

    def _release(self, req: EngineRequest) -> None:
        """Frees req's slot and blocks (req.slot still says which slot it had)."""
        self._unpin(req)
        if req.slot is not None and self.running.get(req.slot) is req:
            self._cache_full_blocks(req)
            del self.running[req.slot]
            if req.blocks:
                self.pool.give(req.slot, req.blocks)
            req.blocks = []
            self.free.append(req.slot)
            self.free.sort()

    def _upload_table(self) -> None:
        """The table rows and reuse points of the slots given blocks since the last call into the
        device state (decode.set_table), their number padded to a power of two (or the slots)."""
        if not self._changed_rows:
            return
        rows = np.full(self._rows_bucket(len(self._changed_rows)), self.slots, np.int32)  # padding: dropped
        rows[:len(self._changed_rows)] = sorted(self._changed_rows)
        self._changed_rows.clear()
        at = np.minimum(rows, self.slots - 1)
        with self.model.on_mesh():
            self.state = decode.set_table(self.state, rows, self.table[at], self.shared[at])

    def _rows_bucket(self, n: int) -> int:
        """The rows a program over n of the slots takes (`decode.set_table`'s, `_prefill`'s before
        the mesh rounds them): a power of two, at most the slots."""
        return min(1 << (n - 1).bit_length(), self.slots)

    def _drop_cancelled(self) -> None:
        for req in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(req)
            self._finish(req, "cancelled")
        for req in [r for r in self.running.values() if r.cancelled]:
            self._finish(req, "cancelled")

    def _sampling(self, reqs: dict[int, EngineRequest], rows: int, masks: bool = True) -> decode.Sampling:
        """How the requests at those rows (of `rows`) draw, each its next token (its key's counter:
        the tokens it has; also after a preemption, whose prefill draws nothing); the other rows
        greedy. A constrained request's row gets the tokens its constraint allows next (unless not
        `masks`: `_fill_masks` does it later)."""
        s = decode.Sampling.rows(rows, self.cfg.vocab_size, {i: r.sampling for i, r in reqs.items()},
                                 {i: len(r.tokens) for i, r in reqs.items()})
        if masks:
            self._fill_masks(s, reqs)
        return s

    def _decode_sampling(self, reqs: dict[int, EngineRequest]) -> decode.Sampling:
        """`_sampling` for the decode step (or verification) over all slots, on the devices, split by
        rows as the slots are. Unless a request is constrained (its mask changes every step), the
        controls are built and put there only when the requests drawing change, and each step
        sends only how many tokens each has drawn, not the controls again (the grammar mask alone
        is V / 8 bytes a slot)."""
        place = functools.partial(jax.tree.map, self.model.place_rows)
        if any(r.constraint is not None for r in reqs.values()):
            return place(self._sampling(reqs, self.slots))
        key = tuple(sorted((i, r.id) for i, r in reqs.items()))
        if self._controls is None or self._controls[0] != key:
            self._controls = key, place(decode.Sampling.rows(self.slots, self.cfg.vocab_size,
                                                             {i: r.sampling for i, r in reqs.items()}))
        drawn = np.zeros(self.slots, np.int32)
        for i, r in reqs.items():
            drawn[i] = len(r.tokens)
        return self._controls[1]._replace(drawn=self.model.place_rows(drawn))

    @staticmethod
    def _fill_masks(s: decode.Sampling, reqs: dict[int, EngineRequest]) -> None:
        for i, r in reqs.items():
            if r.constraint is not None:
                r.constraint.fill(s.controls.mask[i])

    def _prefill(self, chosen: list[tuple[EngineRequest, int]]) -> None:
        R = self.model.batch_rows(self._rows_bucket(len(chosen)))
        T = chunk_bucket(max(n for _, n in chosen), self.prefill_chunk)
        reqs = [r for r, _ in chosen]
        used = {r.slot for r in reqs}
        fillers = [s for s in range(self.slots) if s not in used][: R - len(reqs)]  # held rows (n_valid 0)
        rows = np.array([r.slot for r in reqs] + fillers, np.int32)
        ids, n_valid, start, ends = (np.zeros((R, T), np.int32), np.zeros(R, np.int32), np.full(R, -1, np.int32),
                                     np.zeros(R, bool))
        restore, keep = np.full(R, -1, np.int32), np.full(R, self.snapshots, np.int32)
        for i, (r, n) in enumerate(chosen):
            ids[i, :n] = r.context[r.prefilled: r.prefilled + n]
            n_valid[i], ends[i] = n, r.prefilled + n == len(r.context)
            if r.restore is not None:  # its first chunk, from a snapshot
                restore[i] = r.restore
            elif r.prefilled == r.start:  # its first chunk
                start[i] = r.start
            keep[i] = self._snapshot_place(r, r.prefilled + n)
        # Only the requests whose first token this chunk draws ask their constraint for a mask.
        drawing = {i: r for i, (r, n) in enumerate(chosen) if r.prefilled + n == len(r.context) and r.resume is None}
        sample = self._sampling(drawing, R)
        for i, (r, n) in enumerate(chosen):
            if r.prefilled + n == len(r.context) and r.resume is not None:
                # Back where it was preempted, its row draws the last token it had again, exactly: with
                # speculation that token starts the MTP block's pending row, and its drafts, as before.
                sample.controls.mask[i] = only_token(r.tokens[-1], self.cfg.vocab_size)
        depth = max(layers_to_run(self.cfg, r.span_start, r.prefilled + n) for r, n in chosen)
        with self.model.on_mesh():
            drawn, self.state = decode.prefill(self.params, self.mtp, self.state, rows, ids, n_valid, start, ends,
                                               sample, self.cfg, np.int32(depth), restore=restore, keep=keep)
        drawn = self._fetch(drawn, drawing.values())
        self.counters["prompt_tokens"] += int(n_valid.sum())
        for r, n in chosen:
            self._unpin(r)
            r.prefilled += n
            self._cache_full_blocks(r)
        if self.fork_rows:
            self._fork(list(drawing.values()))
        for i, (r, n) in enumerate(chosen):
            if r.prefilled == len(r.context):
                if r.resume is None:
                    self._emit_drawn(r, drawn, i)
                else:  # back where it was preempted: its last token is the next one to feed
                    self.next_token[r.slot] = r.tokens[-1]

    def _decode(self, generating: list[EngineRequest]) -> None:
        """One token for every generating slot, or with speculation one verification round: 1 to
        k + 1 tokens each."""
        active = np.zeros(self.slots, bool)
        active[[r.slot for r in generating]] = True
        limit = np.zeros(self.slots, np.int32)
        limit[[r.slot for r in generating]] = [r.drafts for r in generating]
        drawn, kept = self._run_decode(self.next_token.copy(), active, limit, {r.slot: r for r in generating})
        drawn = self._fetch(drawn, generating)
        if kept is None:
            for r in generating:
                self._emit_drawn(r, drawn, r.slot)
                self._cache_full_blocks(r)
            return
        kept = np.asarray(kept)
        c = self.counters
        for r in generating:
            j = int(kept[r.slot])
            c[speculative.NUM_DRAFTS] += 1
            c[speculative.NUM_DRAFT_TOKENS] += r.drafts
            c[speculative.NUM_ACCEPTED_TOKENS] += j
            for i in range(j):
                c[speculative.accepted_at(i)] += 1
            for i in range(j + 1):
                self._emit_drawn(r, drawn, r.slot, i)
                if r.done:
                    break
            self._cache_full_blocks(r)

    def _feed(self, running: list[EngineRequest]) -> None:
        """Deterministic mode's step: one token into every running slot through the decode program,
        the next prompt token of a request still prefilling (its first restarts its row), the last
        drawn one of the others; a request whose prompt ends here draws its first token."""
        S = self.slots
        tokens, active, start, prompt = self.next_token.copy(), np.zeros(S, bool), np.full(S, -1, np.int32), \
            np.zeros(S, bool)
        drawing = {}
        for r in running:
            active[r.slot] = True
            if r.prefilled < len(r.context):
                tokens[r.slot], prompt[r.slot] = r.context[r.prefilled], True
                if r.prefilled == r.start:
                    start[r.slot] = r.start
                if r.prefilled + 1 == len(r.context) and r.resume is None:
                    drawing[r.slot] = r
            else:
                drawing[r.slot] = r
        drawn, _ = self._run_decode(tokens, active, np.zeros(S, np.int32), drawing, start, prompt)
        drawn = self._fetch(drawn, drawing.values())
        for r in running:
            if r.prefilled < len(r.context):
                r.prefilled += 1
                self.counters["prompt_tokens"] += 1
                if r.prefilled == len(r.context) and r.resume is not None:
                    self.next_token[r.slot] = r.tokens[-1]  # back where it was preempted
            if r.slot in drawing:
                self._emit_drawn(r, drawn, r.slot)
            if r.slot is not None:
                self._cache_full_blocks(r)

    @staticmethod
    def _fetch(drawn: decode.Drawn, reqs) -> decode.Drawn:
        """A program's Drawn on the host; its log-probabilities only when one of reqs asked."""
        if any(r.sampling.logprobs is not None for r in reqs):
            return decode.Drawn(*(np.asarray(x) for x in drawn))
        return decode.Drawn(np.asarray(drawn.tokens), None, None, None)

    def _run_decode(self, last, active, limit, drawing: dict[int, EngineRequest], start=None, prompt=None) -> tuple:
        """The engine's decode program over all slots, from each slot's last token `last` `[S]`
        (the slots not `active` hold), the requests at `drawing`'s slots drawing their next token:
        one token each (decode.decode; in deterministic mode with the rows starting a prompt,
        `start`, and those fed a prompt token, `prompt`), or with speculation one verification
        round keeping at most limit[s] drafts (decode.verify). When a drawing request has a
        constraint (and no speculation runs), the model's half (decode.decode_logits) is launched
        first and the constraints fill their masks while it runs, then decode.draw samples.
        Returns (Drawn `[S]`, None) or (Drawn `[S, k + 1]`, kept `[S]`); the state is the
        program's."""
        overlap = not self.k and any(r.constraint is not None for r in drawing.values())
        sample = self._sampling(drawing, self.slots, masks=False) if overlap else self._decode_sampling(drawing)
        with self.model.on_mesh():
            if overlap:
                logits, self.state = decode.decode_logits(self.params, self.state, last, active, self.cfg, start,
                                                          prompt)
                self._fill_masks(sample, drawing)  # on the host, while the device runs the model
                return decode.draw(logits, self.state.counts, self.state.prompt, sample), None
            if not self.k:
                tokens, self.state = decode.decode(self.params, self.state, last, active, sample, self.cfg, start,
                                                   prompt)
                return tokens, None
            tokens, kept, self.state = decode.verify(self.params, speculative.BlockDrafts(self.mtp), self.state,
                                                     last, active, limit, sample, self.k, self.cfg)
            return tokens, kept

    def _emit_drawn(self, req: EngineRequest, drawn: decode.Drawn, row: int, i: int | None = None) -> None:
        """`_emit`s the token a program drew for req: row `row` of `drawn` (its i-th with
        speculation), with its log-probabilities when req asked for them."""
        at = (row,) if i is None else (row, i)
        n = req.sampling.logprobs
        lp = None if n is None else TokenLogprobs(float(drawn.logprob[at]), drawn.top_ids[at][:n].tolist(),
                                                  drawn.top_logprobs[at][:n].tolist())
        self._emit(req, int(drawn.tokens[at]), lp)

    def _emit(self, req: EngineRequest, token: int, logprobs: TokenLogprobs | None = None) -> None:
        """Hands a generated token to its request (with its log-probabilities), advances its
        constraint, and ends the request where it stops."""
        if logprobs is not None:
            req.logprobs.append(logprobs)
        if req.constraint is not None:
            req.constraint.accept(token)
        req.tokens.append(token)
        req.token_times.append(time.monotonic())
        self.next_token[req.slot] = token
        self.counters["generation_tokens"] += 1
        if token in req.sampling.stop_token_ids or (req.constraint is not None and req.constraint.done):
            req.finish_reason = "stop"
        elif len(req.tokens) >= req.max_tokens or len(req.prompt) + len(req.tokens) >= self.max_len:
            req.finish_reason = "length"
        if req.on_token is not None:  # finish_reason already set: the callback sees a last token as one
            req.on_token(req, token)
        if req.finish_reason is not None:
            self._finish(req, req.finish_reason)

    def _finish(self, req: EngineRequest, reason: str) -> None:
        req.finish_reason = reason
        self._release(req)
        self.counters[f"finished_{reason}"] += 1
        if req.on_token is not None:
            req.on_token(req, None)

    # ---- driving it ---------------------------------------------------------------------------

    def run_until_idle(self) -> None:
        """Steps until no request is waiting or running."""
        while self.step() or self.waiting:
            pass

    def start(self) -> None:
        """Runs `step` in a background thread until `stop`."""
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="dsv4-engine", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        """Whether the background thread `start` began is running (False before `start`, after
        `stop`, or when a step raised)."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        with self.lock:
            self._stop = True
            self.wake.notify()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        while True:
            with self.lock:
                while not self._stop and not self.waiting and not self.running:
                    self.wake.wait()
                if self._stop:
                    return
            self.step()

    def warmup(self, decode_runs: int = 4, progress: Callable[[int, int, str], None] | None = None) -> int:
        """Compiles every program the engine can run (the decode step, the fork, the block table's
        updates, and the prefill for every rows x chunk bucket) and runs each on random token ids
        in rows that hold (no token counts, so nothing in the cache changes; a fork of padding
        only; a table update of padding rows only; the decode step `decode_runs` times, each with
        other ids); returns how many programs it compiled. `progress(i, n, name)` is called as the
        i-th of the n programs is ready. Running them matters on CPU: there the experts are
        branches of a switch
        (dsv4_jax/model/layer_weights.py), and a program's first run through a branch is slow, a
        cost a request would otherwise pay (docs/serving.md, "Serving benchmark")."""
        # The row buckets (`_rows_bucket`): powers of two below the slots, and all the slots;
        # `_prefill`'s as the mesh rounds them.
        buckets = sorted({self._rows_bucket(1 << i) for i in range((self.slots - 1).bit_length() + 1)})
        rows = sorted({self.model.batch_rows(n) for n in buckets})
        chunks = sorted({chunk_bucket(1 << i, self.prefill_chunk) for i in range(self.prefill_chunk.bit_length())})
        S, V = self.slots, self.cfg.vocab_size
        if self.deterministic:  # no prefill program runs
            rows = chunks = []
        held = (np.zeros(S, bool), np.zeros(S, np.int32))
        feeds = (np.full(S, -1, np.int32), np.zeros(S, bool)) if self.deterministic else (None, None)
        rng = np.random.default_rng(0)

        def decode_steps():
            for _ in range(decode_runs):
                self._run_decode(rng.integers(0, V, S, dtype=np.int32), *held, {}, *feeds)

        def two_halves():  # run for a request whose constraint allows every token
            constrained = EngineRequest(-1, [0], 1, SamplingParams(), constraint=_AnyToken())
            self._run_decode(rng.integers(0, V, S, dtype=np.int32), *held, {0: constrained}, *feeds)

        def penalty_history():
            self.state = decode.set_history(self.state, np.int32(0), np.zeros(V, bool), np.zeros(V, np.int32))

        def no_fork():  # every row padding
            with self.model.on_mesh():
                _, self.state = decode.fork(self.state, *self._no_forks(), self._sampling({}, self.fork_rows))

        def table_rows(n: int):  # every row padding
            def run():
                with self.model.on_mesh():
                    self.state = decode.set_table(self.state, np.full(n, S, np.int32),
                                                  np.zeros((n, self.table.shape[1]), np.int32), np.zeros(n, np.int32))
            return run

        programs = [(f"decode step ({S} slots)", decode_steps)]
        if not self.k:
            programs.append(("decode step in two halves (constrained requests)", two_halves))
        programs.append(("penalty history", penalty_history))
        if self.fork_rows:
            programs.append((f"fork (up to {self.fork_rows} choices)", no_fork))
        if self.paged:
            for n in buckets:
                programs.append((f"block table ({n} row{'s' * (n > 1)})", table_rows(n)))
        total = len(programs) + len(rows) * len(chunks)
        report = progress or (lambda *_: None)
        for i, (name, run) in enumerate(programs, 1):
            run()
            jax.block_until_ready(self.state)
            report(i, total, name)
        with self.model.on_mesh():
            for i, (R, T) in enumerate(itertools.product(rows, chunks), len(programs) + 1):
                _, self.state = decode.prefill(
                    self.params, self.mtp, self.state, np.arange(R, dtype=np.int32),
                    rng.integers(0, V, (R, T), dtype=np.int32), np.zeros(R, np.int32), np.full(R, -1, np.int32),
                    np.zeros(R, bool), self._sampling({}, R), self.cfg, np.int32(self.cfg.num_layers),
                    restore=np.full(R, -1, np.int32), keep=np.full(R, self.snapshots, np.int32))
                jax.block_until_ready(self.state)
                report(i, total, f"prefill ({R} row{'s' * (R > 1)} x {T} tokens)")
        return total

    def stats(self) -> dict:
        """Requests running / waiting, slots in use, the cache's use (tokens held over capacity)
        and the token and request counters."""
        with self.lock:
            running = list(self.running.values())  # one copy: the engine thread frees slots without the lock
            held = sum(r.prefilled + len(r.tokens) for r in running)
            usage = self.pool.used / self.num_blocks if self.paged else held / (self.slots * self.max_len)
            return {"running": len(running), "waiting": len(self.waiting), "slots": self.slots,
                    "slots_used": len(running), "cache_usage": usage, "num_blocks": self.num_blocks,
                    "blocks_used": self.pool.used, "blocks_cached": self.pool.cached, **self.counters}


class StaticEngine(Engine):
    """The baseline continuous batching is measured against: `generate` on static batches, as a
    server without an engine would run it. The waiting requests (up to `slots`) go as one batch
    through `generate.run_request`, and the next batch starts when the whole batch is done: a
    request arriving meanwhile waits for it, and a request gets all its tokens when its batch ends.
    Each row of a batch runs with its request's own token limit, sampling and stop ids, so a
    request gets what `generate` gives it alone. Same interface as Engine (submit, cancel, start /
    stop, stats); no speculation."""

    def _step_params(self):
        return None  # generate splits the weights itself, per batch, as a server calling it does

    def submit(self, prompt, max_tokens: int, **kwargs) -> EngineRequest:
        """Engine.submit, less what `generate` does not run: penalties, logprobs, constraints."""
        neutral = {"logprobs": None, "constraint": None, "presence_penalty": 0, "frequency_penalty": 0,
                   "repetition_penalty": 1}
        used = next((name for name, value in neutral.items() if kwargs.get(name, value) != value), None)
        if used is not None:
            raise RequestError(f"{used}: not served by the static-batch engine", used)
        return super().submit(prompt, max_tokens, **kwargs)

    def _new_state(self) -> None:
        return None  # generate makes its own per batch

    def step(self) -> bool:
        with self.lock:
            self._drop_cancelled()
            batch = []
            while self.waiting and len(batch) < self.slots:
                req = self.waiting.popleft()
                req.slot, req.admitted = self.free.pop(0), time.monotonic()
                self.running[req.slot] = req
                batch.append(req)
        if not batch:
            return False
        # submit checked every request against max_len: the batch of them is a checked Request
        request = Request([r.prompt for r in batch], tuple(r.max_tokens for r in batch),
                          tuple(r.sampling for r in batch), self.max_len)
        out = run_request(self.model, self.cfg, request)
        self.counters["prompt_tokens"] += sum(len(r.prompt) for r in batch)
        for r, tokens in zip(batch, out.rows()):
            r.prefilled = len(r.prompt)
            for t in tokens:  # its last one ends it: its stop id or its limit
                self._emit(r, int(t))
        return True

    def warmup(self, decode_runs: int = 4, progress: Callable[[int, int, str], None] | None = None) -> int:
        """Runs `generate` once for every batch bucket and prefill chunk length it can meet at this
        max_len, on random prompts and for up to `decode_runs` tokens, so that serving compiles
        nothing and no request pays a first run through an expert (see `Engine.warmup`, also for
        `progress`); returns the number of runs."""
        rows = sorted({self.model.batch_rows(batch_bucket(n)) for n in range(1, self.slots + 1)})
        lengths = sorted({chunk_bucket(1 << i) for i in range(PREFILL_CHUNK.bit_length())} - {0})
        runs = [(R, L) for R in rows for L in lengths if L + 1 <= self.max_len]
        report = progress or (lambda *_: None)
        rng = np.random.default_rng(0)
        for i, (R, L) in enumerate(runs, 1):
            prompts = rng.integers(0, self.cfg.vocab_size, (R, L)).tolist()
            tokens = min(decode_runs, self.max_len - L)
            run_request(self.model, self.cfg, validate_request(prompts, self.cfg, tokens, max_len=self.max_len))
            report(i, len(runs), f"generate ({R} row{'s' * (R > 1)}, {L}-token prompts)")
        return len(runs)
