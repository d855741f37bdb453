"""Training a DeepSeek-V4 from scratch with optax, and the directory a run writes.

    run = Trainer.start(TrainSettings(out="run/", preset="tiny", corpus=[...]))   # or Trainer.resume("run/")
    summary = run.train(progress)                                                  # a dict, JSON-ready

The optimizer is AdamW (weight decay on matrices only) after global-norm clipping, its learning
rate a linear warm-up then a cosine decay to a tenth. The loss is objective.total: the main
cross-entropy, the MTP block's (weight 0.3) and the indexer's KL, the indexer dense for its first
`indexer_warmup` steps, sparse (the config's index_topk) after. After every step the main model's
gate biases move against their experts' load by `balance_rate` (objective.balanced).

OUT, the run's directory, is a checkpoint in the converter's format at every save, loadable by
`dsv4_jax.load` and servable by `dsv4-serve` as it is:

    OUT/config.json                 {"dsv4_jax": the ModelConfig, "trained": {step, tokens, ...}}
    OUT/params/, OUT/mtp/           nnx.state of the model and of its MTP block (Orbax, fp32)
    OUT/tokenizer.json, tokenizer_config.json, generation_config.json   the BPE trained on the corpus
    OUT/train/                      Orbax CheckpointManager: parameters, optimizer state and the
                                    run's settings, for --resume (the last two saves)

On a mesh of several devices the batch is split over the data axis and the parameters are
placed by the model's sharding rules (dsv4_jax/model/sharding.py, layout "dp_attention").
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dsv4_jax.model import sharding
from dsv4_jax.model.config import ConfigError, ModelConfig
from dsv4_jax.model.mtp import init_mtp_params
from dsv4_jax.model.params import init_params
from . import data, objective

# Every feature: window-only layers, ratio-4 layers with their indexer, ratio-128 layers, a hash-
# routed first layer, 4 hyper-connection streams, the MTP block. `tiny` trains in about a minute
# on 2 CPU cores (CI); `small` is the 30-minute run (docs/training.md).
_COMMON = dict(num_layers=4, compress_ratios=(0, 4, 128, 4), hash_layers=(True, False, False, False),
               routed_scaling_factor=1.5, swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
               rms_norm_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0, yarn=None,
               num_nextn_predict_layers=1, max_position_embeddings=65536, bos_token_id=data.BOS_ID,
               eos_token_id=data.EOS_ID)
PRESETS = {
    "tiny": (ModelConfig(**{**_COMMON, **dict(
        vocab_size=512, hidden_size=64, num_heads=2, head_dim=64, rope_head_dim=32, q_lora_rank=32, o_groups=2,
        o_lora_rank=32, sliding_window=32, index_n_heads=2, index_head_dim=32, index_topk=8, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=64)}),
        dict(seq_len=256, batch_size=4, steps=60, lr=3e-3, max_corpus_bytes=1 << 20)),
    "small": (ModelConfig(**{**_COMMON, **dict(
        num_layers=6, compress_ratios=(0, 4, 128, 4, 128, 4), hash_layers=(True,) + (False,) * 5,
        vocab_size=4096, hidden_size=256, num_heads=4, head_dim=128, rope_head_dim=64, q_lora_rank=128,
        o_groups=2, o_lora_rank=128, sliding_window=64, index_n_heads=4, index_head_dim=64, index_topk=16,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=256)}),
        dict(seq_len=512, batch_size=4, steps=450, lr=2e-3, max_corpus_bytes=12 << 20)),
}
MTP_WEIGHT = 0.3  # DeepSeek-V3's lambda for its first 10T tokens
TRAIN_DIR = "train"
SETTINGS = "settings"


class TrainError(ValueError):
    """A run the trainer refuses (settings, config, output directory); the message names it."""


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """What a run trains and how. None fields take the preset's value."""

    out: str
    preset: str = "tiny"
    corpus: tuple[str, ...] = ()  # files or directories; () is data.default_corpus()
    steps: int | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    lr: float | None = None
    max_corpus_bytes: int | None = None
    warmup_steps: int | None = None  # learning-rate warm-up; default 5 % of steps
    indexer_warmup: int | None = None  # dense indexer steps; default 10 % of steps
    eval_windows: int = 64
    save_every: int = 0  # 0: at the end only
    seed: int = 0
    devices: int | None = None  # data parallel over the first N devices; None: all of them
    balance_rate: float = 1e-3  # the gate biases' step against expert load (DeepSeek-V3's gamma); 0: off
    config: dict | None = None  # an HF config.json's dict instead of the preset's model

    def resolved(self) -> "TrainSettings":
        if self.preset not in PRESETS:
            raise TrainError(f"unknown preset {self.preset!r} (choose from {', '.join(PRESETS)})")
        defaults = PRESETS[self.preset][1]
        out = dataclasses.replace(self, **{k: v for k, v in defaults.items() if getattr(self, k) is None})
        steps = out.steps
        out = dataclasses.replace(
            out, warmup_steps=max(1, steps // 20) if out.warmup_steps is None else out.warmup_steps,
            indexer_warmup=steps // 10 if out.indexer_warmup is None else out.indexer_warmup,
            corpus=tuple(out.corpus) or tuple(data.default_corpus()))
        positive = ("steps", "batch_size", "seq_len", "eval_windows") + ("devices",) * (out.devices is not None)
        for name in positive:
            if getattr(out, name) < 1:
                raise TrainError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(out, name)}")
        if not out.lr > 0:
            raise TrainError(f"--lr must be > 0, got {out.lr}")
        if out.save_every < 0:
            raise TrainError(f"--save-every must be >= 0, got {out.save_every}")
        if not out.balance_rate >= 0:
            raise TrainError(f"--balance-rate must be >= 0, got {out.balance_rate}")
        return out

    def model_config(self) -> ModelConfig:
        """The model to train, checked for what the trainer can train."""
        if self.config is None:
            cfg = PRESETS[self.preset][0]
        else:
            try:
                cfg = ModelConfig.from_hf(self.config)
            except ConfigError as e:
                raise TrainError(f"the config cannot describe a model: {e}") from None
        floor = len(data.SPECIALS) + 256
        if cfg.vocab_size < floor:
            raise TrainError(f"the config's vocab_size {cfg.vocab_size} is below {floor}, the byte-level tokenizer's "
                             f"specials and bytes")
        if cfg.num_nextn_predict_layers > 1:
            raise TrainError(f"the trainer trains one MTP block, the config asks for {cfg.num_nextn_predict_layers}")
        return cfg.replace(bos_token_id=data.BOS_ID, eos_token_id=data.EOS_ID, attention_impl="ref")


ONES = ("norm", "attn_norm", "ffn_norm", "q_norm", "kv_norm", "enorm", "hnorm", "scale")
ZEROS = ("sink", "base", "ape", "gate_bias")


def _name(path) -> str | None:
    return getattr(path[-1], "key", None)


def init_model(cfg: ModelConfig, seed: int) -> tuple[dict, dict]:
    """(trainable, frozen) parameters for training from scratch: matrices N(0, 0.02), norms and
    hyper-connection scales 1, sinks, `ape`, hyper-connection bases and gate biases 0 (sinks
    start neutral; the bases give the identity-free mixing mHC starts from), tid2eid a random
    table of distinct experts (frozen)."""
    main = init_params(cfg, seed=seed, std=0.02)

    def reset(path, a):
        return jnp.ones_like(a) if _name(path) in ONES else jnp.zeros_like(a) if _name(path) in ZEROS else a

    frozen = {"tid2eid": main.pop("tid2eid")} if "tid2eid" in main else {}
    trainable = {"main": main}
    if cfg.num_nextn_predict_layers:
        trainable["mtp"] = init_mtp_params(cfg, seed=seed + 1, std=0.02)
    return jax.tree_util.tree_map_with_path(reset, trainable), frozen


def optimizer(lr: float, steps: int, warmup: int) -> optax.GradientTransformation:
    """Clipping at global norm 1, then AdamW (b2 0.95, weight decay 0.1 on the projections and
    embeddings, not on norms, scales, sinks, biases or `ape`) on a warm-up plus cosine schedule."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(warmup, steps), max(steps, warmup + 1), lr / 10)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1,
                                   mask=lambda p: jax.tree_util.tree_map_with_path(
                                       lambda path, a: _name(path) not in ONES + ZEROS, p)))


def _sparse(cfg: ModelConfig, seq_len: int, dense: bool) -> ModelConfig:
    """cfg for a step: with `dense` the indexer chooses every visible ratio-4 entry."""
    return cfg.replace(index_topk=max(cfg.index_topk, seq_len // 4)) if dense else cfg


class Trainer:
    """One training run (module doc); `start` a new one or `resume` one from its directory."""

    def __init__(self, settings: TrainSettings, cfg: ModelConfig, tok, corpus: data.Corpus, params, frozen,
                 opt_state, step: int, tokens: int, seconds: float):
        self.settings, self.cfg, self.tok, self.corpus = settings, cfg, tok, corpus
        self.params, self.frozen, self.opt_state = params, frozen, opt_state
        self.step, self.tokens, self.seconds = step, tokens, seconds
        self.opt = optimizer(settings.lr, settings.steps, settings.warmup_steps)
        n = settings.devices or jax.device_count()
        if n > jax.device_count():
            raise TrainError(f"--devices {n}: only {jax.device_count()} devices")
        self.mesh = sharding.make_mesh({"data": n}, jax.devices()[:n]) if n > 1 else None
        if settings.batch_size % n:
            raise TrainError(f"--batch-size {settings.batch_size} must be a multiple of the {n} devices")
        self._place()
        self._programs = {}

    # ---- starting and resuming ---------------------------------------------------------------

    @classmethod
    def start(cls, settings: TrainSettings) -> "Trainer":
        """A new run into settings.out (missing or empty): the tokenizer trained on the corpus, the
        model initialised. Nothing is left in out when this raises."""
        s = settings.resolved()
        cfg = s.model_config()
        created = _claim_out(s.out)
        try:
            texts = data.read_corpus(list(s.corpus), s.max_corpus_bytes)
            tok = data.train_tokenizer(texts.train, cfg.vocab_size)
            corpus = data.build_corpus(texts, tok, s.seq_len, s.batch_size)
            params, frozen = init_model(cfg, s.seed)
            opt_state = optimizer(s.lr, s.steps, s.warmup_steps).init(params)
            data.save_tokenizer(tok, s.out, cfg.max_position_embeddings)
            return cls(s, cfg, tok, corpus, params, frozen, opt_state, 0, 0, 0.0)
        except BaseException:
            _release_out(s.out, created)
            raise

    @classmethod
    def resume(cls, out: str, steps: int | None = None) -> "Trainer":
        """The run in `out` from its last save (steps: a new total, else the run's own)."""
        import orbax.checkpoint as ocp
        from tokenizers import Tokenizer

        manager = _manager(out)
        last = manager.latest_step()
        if last is None:
            raise TrainError(f"{out} has no training checkpoint to resume ({os.path.join(out, TRAIN_DIR)})")
        meta = manager.restore(last, args=ocp.args.Composite(**{SETTINGS: ocp.args.JsonRestore()}))[SETTINGS]
        s = TrainSettings(**{**meta["settings"], "corpus": tuple(meta["settings"]["corpus"]), "out": out})
        if steps is not None:
            s = dataclasses.replace(s, steps=steps)
        s = s.resolved()
        cfg = s.model_config()
        tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
        corpus = data.build_corpus(data.read_corpus(list(s.corpus), s.max_corpus_bytes), tok, s.seq_len,
                                   s.batch_size)

        def fresh():  # what the checkpoint holds, by shape only
            params, frozen = init_model(cfg, s.seed)
            opt_state = optimizer(s.lr, s.steps, s.warmup_steps).init(params)
            return {"params": params, "frozen": frozen, "opt_state": opt_state}

        abstract = jax.eval_shape(fresh)
        state = manager.restore(last, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
        return cls(s, cfg, tok, corpus, state["params"], state["frozen"], state["opt_state"], int(last),
                   int(meta["tokens"]), float(meta["seconds"]))

    # ---- the programs ------------------------------------------------------------------------

    def _place(self) -> None:
        if self.mesh is None:
            return
        layout = sharding.get_layout(None)
        main = sharding.param_shardings({**self.params["main"], **self.frozen}, self.mesh, layout)
        shard = {"main": {k: main[k] for k in self.params["main"]}}
        if "mtp" in self.params:
            shard["mtp"] = sharding.mtp_shardings(self.params["mtp"], self.mesh, layout)
        self.params = jax.device_put(self.params, shard)
        self.frozen = jax.device_put(self.frozen, {k: main[k] for k in self.frozen})
        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        self.opt_state = jax.device_put(self.opt_state, replicated)

    def _windows(self, windows: np.ndarray):
        if self.mesh is None:
            return jnp.asarray(windows)
        spec = sharding.get_layout(None).spec((sharding.BATCH, None), self.mesh)
        return jax.device_put(windows, jax.sharding.NamedSharding(self.mesh, spec))

    def _program(self, name: str, dense: bool):
        """The jitted "train" step (params, frozen, opt_state, windows) -> (params, opt_state,
        losses, expert load) or "eval" (params, frozen, windows) -> (losses, expert load), with
        the indexer dense or sparse."""
        key = (name, dense)
        if key not in self._programs:
            cfg, opt, rate = _sparse(self.cfg, self.settings.seq_len, dense), self.opt, self.settings.balance_rate

            def train_step(params, frozen, opt_state, windows):
                def loss(p):
                    parts, load = objective.losses(p, frozen, windows, cfg)
                    return objective.total(parts, MTP_WEIGHT), (parts, load)

                (_, (parts, load)), grads = jax.value_and_grad(loss, has_aux=True)(params)
                updates, opt_state = opt.update(grads, opt_state, params)
                params = optax.apply_updates(params, updates)
                if rate and "gate_bias" in params["main"]:
                    main = {**params["main"], "gate_bias": objective.balanced(params["main"]["gate_bias"], load, cfg,
                                                                              rate)}
                    params = {**params, "main": main}
                return params, opt_state, parts, load

            def evaluate(params, frozen, windows):
                return objective.losses(params, frozen, windows, cfg)

            if name == "train":
                self._programs[key] = jax.jit(train_step, donate_argnums=(0, 2))
            else:
                self._programs[key] = jax.jit(evaluate)
        return self._programs[key]

    # ---- the loop ----------------------------------------------------------------------------

    def train(self, progress=None) -> dict:
        """Trains up to settings.steps (saving every save_every steps and at the end), then
        evaluates on the held-out windows; returns the summary (`train_loss` None when no step
        was left to run). progress(step, steps, parts,
        tokens_per_second) is called after every step."""
        s = self.settings
        recent = []
        t_run = time.perf_counter()
        while self.step < s.steps:
            windows = self._windows(self.corpus.batch(s.seed, self.step, s.batch_size, s.seq_len))
            t = time.perf_counter()
            self.params, self.opt_state, parts, _ = self._program("train", self.step < s.indexer_warmup)(
                self.params, self.frozen, self.opt_state, windows)
            parts = {k: float(v) for k, v in parts.items()}
            dt = time.perf_counter() - t
            if not np.isfinite(parts["lm"]):
                raise TrainError(f"the loss is {parts['lm']} at step {self.step}: lower --lr")
            self.step += 1
            self.tokens += s.batch_size * s.seq_len
            self.seconds += dt
            recent = (recent + [parts])[-10:]
            if progress is not None:
                progress(self.step, s.steps, parts, s.batch_size * s.seq_len / dt)
            if s.save_every and self.step % s.save_every == 0 and self.step < s.steps:
                self.save()
        wall = time.perf_counter() - t_run
        if recent:  # a resumed run with no steps left is evaluated, not saved again
            self.save()
        held = self.evaluate()
        mean = {k: float(np.mean([r[k] for r in recent])) for k in recent[0]} if recent else {}
        unigram = self.corpus.unigram_loss(self.cfg.vocab_size)
        return {"preset": s.preset, "steps": self.step, "train_loss": mean.get("lm"), "eval_loss": held["lm"],
                "eval_perplexity": float(np.exp(held["lm"])), "unigram_loss": unigram,
                "unigram_perplexity": float(np.exp(unigram)), "eval_mtp_loss": held["mtp"],
                "eval_indexer_kl": held["indexer"],
                "eval_expert_max_violation": [round(float(v), 4) for v in held["expert_max_violation"]],
                "tokens": self.tokens, "seconds": round(self.seconds, 2),
                "tokens_per_second": round(self.tokens / max(self.seconds, 1e-9), 1),
                "this_run_seconds": round(wall, 2), "train_files": self.corpus.files,
                "held_out_files": self.corpus.held_out_files, "held_out_tokens": int(len(self.corpus.held_out)),
                "out": os.path.abspath(s.out)}

    def evaluate(self) -> dict:
        """Mean losses over the held-out windows (sparse indexer), and per learned-routing layer
        the busiest expert's load over an even share, minus 1 (`expert_max_violation`)."""
        s = self.settings
        batches = self.corpus.eval_batches(s.batch_size, s.seq_len, s.eval_windows)
        if not batches:
            raise TrainError("the held-out part of the corpus cannot fill one batch")
        run = self._program("eval", False)
        parts, load = [], 0
        for b in batches:
            losses, batch_load = run(self.params, self.frozen, self._windows(b))
            parts.append(jax.tree.map(float, losses))
            load = load + np.asarray(batch_load)
        return {**{k: float(np.mean([p[k] for p in parts])) for k in parts[0]},
                "expert_max_violation": objective.max_violation(load, self.cfg)}

    # ---- saving ------------------------------------------------------------------------------

    def save(self) -> None:
        """The training checkpoint (OUT/train/) and the servable model (OUT/config.json, params/, mtp/)."""
        import orbax.checkpoint as ocp

        s = self.settings
        meta = {"settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(s).items()
                             if k != "out"},
                "tokens": self.tokens, "seconds": self.seconds}
        manager = _manager(s.out)
        manager.save(self.step, args=ocp.args.Composite(
            state=ocp.args.StandardSave({"params": self.params, "frozen": self.frozen, "opt_state": self.opt_state}),
            **{SETTINGS: ocp.args.JsonSave(meta)}), force=True)
        manager.wait_until_finished()
        manager.close()
        export(s.out, self.cfg, {**self.params["main"], **self.frozen}, self.params.get("mtp"),
               {"step": self.step, "tokens": self.tokens, "preset": s.preset, "corpus": list(s.corpus),
                "max_corpus_bytes": s.max_corpus_bytes, "seq_len": s.seq_len, "seed": s.seed})


def _manager(out: str):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(os.path.abspath(os.path.join(out, TRAIN_DIR)),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))


def export(out: str, cfg: ModelConfig, params: dict, mtp: dict | None, trained: dict) -> None:
    """Writes the model into out as a converted checkpoint: params/ and mtp/ (Orbax, what
    `nnx.state` holds), then config.json (written last: `dsv4_jax.load` needs it)."""
    import orbax.checkpoint as ocp

    tmp = os.path.join(out, ".export.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    host = lambda tree: jax.tree.map(lambda a: np.asarray(a), tree)  # noqa: E731  one host copy, any mesh
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.abspath(os.path.join(tmp, "params")), host(params))
        if mtp is not None:
            ckptr.save(os.path.abspath(os.path.join(tmp, "mtp")), host(mtp))
    config = os.path.join(out, "config.json")
    if os.path.exists(config):
        os.remove(config)
    for part in ("params", "mtp"):
        shutil.rmtree(os.path.join(out, part), ignore_errors=True)
        if os.path.isdir(os.path.join(tmp, part)):
            os.rename(os.path.join(tmp, part), os.path.join(out, part))
    os.rmdir(tmp)
    with open(config + ".tmp", "w") as f:
        json.dump({"dsv4_jax": cfg.replace(attention_impl="auto").to_dict(), "trained": trained, "dtype": "float32"},
                  f, indent=2)
    os.replace(config + ".tmp", config)


def save_model(model, out: str, tokenizer_from: str, trained: dict) -> None:
    """Writes a `DeepseekV4` (its MTP block too, when it has one) into out, a new or previous
    output directory, as a converted checkpoint with the tokenizer files of tokenizer_from: what
    `dsv4_jax.load` reads back (a fine-tuned model, examples/fine_tune.py)."""
    from dsv4_jax.checkpoint import hf_files

    os.makedirs(out, exist_ok=True)
    export(out, model.config, model.params, None if model.mtp is None else model.mtp.params, trained)
    if os.path.realpath(tokenizer_from) != os.path.realpath(out):
        hf_files.copy_files(tokenizer_from, out, [f for f in hf_files.FILES
                                                  if os.path.isfile(os.path.join(tokenizer_from, f))])


def _claim_out(out: str) -> list[str]:
    """Makes out (missing or empty) ready for a new run; returns the directories created."""
    out = os.path.abspath(out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise TrainError(f"{out} exists and is not a directory")
    if os.path.isdir(out) and os.listdir(out):
        raise TrainError(f"{out} is not empty (--resume continues the run in it)")
    created, probe = [], out
    while not os.path.exists(probe):
        created.append(probe)
        probe = os.path.dirname(probe)
    try:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, ".write-test"), "w"):
            pass
        os.remove(os.path.join(out, ".write-test"))
    except OSError as e:
        _release_out(out, created)
        raise TrainError(f"cannot write the output directory {out}: {e.strerror}") from None
    return created


def _release_out(out: str, created: list[str]) -> None:
    """Removes what a failed start wrote into out, and the directories it created."""
    out = os.path.abspath(out)
    if os.path.isdir(out):
        for entry in os.listdir(out):
            p = os.path.join(out, entry)
            shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.remove(p)
    for d in created:
        try:
            os.rmdir(d)
        except OSError:
            break
