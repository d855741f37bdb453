"""The static, hashable model configuration and its reader for HF `config.json` files.

`ModelConfig.from_hf` accepts both spellings of a DeepSeek-V4 config:

* the official (legacy) one shipped with the checkpoints: `compress_ratios` (with trailing MTP
  entries), `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling` with `type: yarn`;
* the one transformers writes: `layer_types`, `mlp_layer_types`, `compress_rates`,
  `partial_rotary_factor`, `rope_parameters` with `main` / `compress` sub-dicts.

Every problem is reported as a `ConfigError` naming the offending field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

from .layer_kinds import BY_RATIO, CSA, KINDS, WINDOW

_LAYER_TYPE_TO_RATIO = {k.layer_type: k.ratio for k in KINDS}
_RATIO_ALIASES = {**{k.ratio: k.ratio for k in KINDS}, 1: WINDOW}  # ratio 1: window only, as 0
EXPERT_EXCHANGES = ("auto", "all_gather", "ragged_all_to_all")


class ConfigError(ValueError):
    """A DeepSeek-V4 config that cannot describe a model; the message names the field."""


@dataclasses.dataclass(frozen=True)
class Yarn:
    """YaRN frequency interpolation of the compressed layers' RoPE (no magnitude scaling)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything that fixes the model's shapes and math. Frozen and hashable (a jit static arg)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]  # one per main layer, each 0, 4 or 128
    hash_layers: tuple[bool, ...]  # one per main layer: routed through tid2eid
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    yarn: Yarn | None
    num_nextn_predict_layers: int = 0
    max_position_embeddings: int = 1048576
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    # How the kernels (sparse attention, compressor, hyper-connections, quantized linears, routed
    # experts) run: "pallas" (the kernels; interpreted on CPU), "ref" (plain JAX, differentiable:
    # what fine-tuning needs) or "auto" (kernels on TPU/GPU, plain JAX elsewhere).
    attention_impl: str = "auto"
    # How expert parallelism moves tokens between devices (dsv4_jax/model/moe.py,
    # `routed_experts_on_mesh`): "all_gather" (every device gathers the tokens, the outputs are
    # reduce-scattered), "ragged_all_to_all" (each (token, expert) pair goes to the device holding
    # its expert and back; TPU and GPU only) or "auto" (`moe.expert_exchange`'s rule).
    expert_exchange: str = "auto"
    # The FP8 linears' activations quantized to e4m3 per 128 columns first, as DeepSeek's
    # reference inference does (pallas_kernels/fp8_activations.py; the FP8 tensor cores on CUDA).
    # Off: they multiply the activations as they are by the dequantized weight.
    fp8_activations: bool = False
    # IndexCache (index-cache.md): ratio-4 layers of rank r among ratio-4 layers reuse the last
    # computed top-k when r % index_topk_freq != 0, or where index_topk_pattern (one F/S per
    # ratio-4 layer, first F; layers past its end compute) says S. With
    # index_cache_skip_compressor a reusing layer also skips its indexer's compressor and has
    # no indexer key cache.
    use_index_cache: bool = False
    index_topk_freq: int = 1
    index_topk_pattern: str | None = None
    index_cache_skip_compressor: bool = False
    # Where the arrays live on a device mesh (dsv4_jax/model/sharding.py): a `sharding.Layout`, set by
    # `load(..., mesh=)`; None on one device. Not written to config.json.
    layout: Any = None

    def __post_init__(self):
        _validate(self)

    # ---- derived layout -------------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    @property
    def num_hash_layers(self) -> int:
        return sum(self.hash_layers)

    def layers_of_ratio(self, ratio: int) -> tuple[int, ...]:
        """Ids of the main layers with this compress ratio, in order."""
        return tuple(i for i, r in enumerate(self.compress_ratios) if r == ratio)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self.replace(layout=None))
        del d["layout"]
        d["compress_ratios"] = list(self.compress_ratios)
        d["hash_layers"] = list(self.hash_layers)
        return d

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---- reading HF configs ---------------------------------------------------------------
    @classmethod
    def from_hf(cls, source: str | os.PathLike | Mapping[str, Any]) -> "ModelConfig":
        """Builds the config from a `config.json` path, a checkpoint directory or a dict."""
        if isinstance(source, Mapping):
            raw = dict(source)
        else:
            path = os.fspath(source)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise ConfigError(f"config.json not found: {path}")
            try:
                with open(path) as f:
                    raw = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path} is not valid JSON: {e}") from None
            if not isinstance(raw, dict):
                raise ConfigError(f"{path} must hold a JSON object")
        if "dsv4_jax" in raw:  # written by our converter: our own field names
            return cls.from_dict(raw["dsv4_jax"])
        return _from_hf_dict(raw)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        """Inverse of `to_dict`."""
        d = dict(d)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ConfigError(f"unknown config fields: {unknown}")
        if d.get("yarn") is not None:
            d["yarn"] = Yarn(**d["yarn"])
        d["compress_ratios"] = tuple(d["compress_ratios"])
        d["hash_layers"] = tuple(bool(x) for x in d["hash_layers"])
        return cls(**d)


def _require(raw: Mapping[str, Any], key: str, kind=int, default: Any = dataclasses.MISSING):
    if key not in raw or raw[key] is None:
        if default is dataclasses.MISSING:
            raise ConfigError(f"missing required field `{key}`")
        return default
    value = raw[key]
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"`{key}` must be an integer, got {value!r}")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"`{key}` must be a number, got {value!r}")
        return float(value)
    return value


def _ratio(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value not in _RATIO_ALIASES:
        raise ConfigError(f"`{field}` holds an unknown compress ratio {value!r} (allowed: 0, 1, 4, 128)")
    return _RATIO_ALIASES[value]


def _from_hf_dict(raw: Mapping[str, Any]) -> ModelConfig:
    n = _require(raw, "num_hidden_layers")
    if n < 1:
        raise ConfigError(f"`num_hidden_layers` must be >= 1, got {n}")
    n_mtp = _require(raw, "num_nextn_predict_layers", default=0)
    head_dim = _require(raw, "head_dim")

    # Attention kind per layer.
    if raw.get("layer_types") is not None:
        types = raw["layer_types"]
        if not isinstance(types, list) or len(types) != n:
            raise ConfigError(
                f"`layer_types` must list one entry per layer ({n}), got "
                f"{len(types) if isinstance(types, list) else type(types).__name__}")
        rates = dict(raw.get("compress_rates") or {})
        ratios = []
        for i, t in enumerate(types):
            if t not in _LAYER_TYPE_TO_RATIO:
                raise ConfigError(f"`layer_types[{i}]` is an unknown layer type {t!r}")
            r = rates.get(t, _LAYER_TYPE_TO_RATIO[t]) if t != "sliding_attention" else 0
            ratios.append(_ratio(r, f"compress_rates[{t!r}]"))
    elif raw.get("compress_ratios") is not None:
        cr = raw["compress_ratios"]
        if not isinstance(cr, list) or len(cr) not in (n, n + n_mtp):
            raise ConfigError(
                f"`compress_ratios` must have num_hidden_layers ({n}) or num_hidden_layers + "
                f"num_nextn_predict_layers ({n + n_mtp}) entries, got "
                f"{len(cr) if isinstance(cr, list) else type(cr).__name__}")
        ratios = [_ratio(r, f"compress_ratios[{i}]") for i, r in enumerate(cr)][:n]
    else:
        raise ConfigError("missing `compress_ratios` (official form) or `layer_types` (transformers form)")

    # Hash-routed MoE layers.
    if raw.get("mlp_layer_types") is not None:
        mlp = raw["mlp_layer_types"]
        if not isinstance(mlp, list) or len(mlp) != n:
            raise ConfigError(f"`mlp_layer_types` must list one entry per layer ({n})")
        for i, t in enumerate(mlp):
            if t not in ("hash_moe", "moe"):
                raise ConfigError(f"`mlp_layer_types[{i}]` is an unknown MoE type {t!r}")
        hash_layers = tuple(t == "hash_moe" for t in mlp)
    else:
        n_hash = _require(raw, "num_hash_layers", default=0)
        if not 0 <= n_hash <= n:
            raise ConfigError(f"`num_hash_layers` must be in [0, {n}], got {n_hash}")
        hash_layers = tuple(i < n_hash for i in range(n))

    # RoPE: rotary width, bases, YaRN.
    if raw.get("qk_rope_head_dim") is not None:
        rope_dim = _require(raw, "qk_rope_head_dim")
    elif raw.get("partial_rotary_factor") is not None:
        rope_dim = int(head_dim * _require(raw, "partial_rotary_factor", float))
    else:
        raise ConfigError("missing `qk_rope_head_dim` (or `partial_rotary_factor`)")
    rope_theta = _require(raw, "rope_theta", float, 10000.0)
    compress_theta = _require(raw, "compress_rope_theta", float, 160000.0)
    rp = raw.get("rope_parameters") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        rope_theta = _require(rp["main"], "rope_theta", float, rope_theta)
        compress_theta = _require(rp["compress"], "rope_theta", float, compress_theta)
        scaling = rp["compress"]
    else:
        scaling = raw.get("rope_scaling") or rp or {}
    if not isinstance(scaling, Mapping):
        raise ConfigError(f"`rope_scaling` must be an object, got {scaling!r}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "yarn":
        yarn = Yarn(
            factor=_require(scaling, "factor", float),
            original_max_position_embeddings=_require(scaling, "original_max_position_embeddings"),
            beta_fast=_require(scaling, "beta_fast", float, 32.0),
            beta_slow=_require(scaling, "beta_slow", float, 1.0),
        )
        if scaling.get("mscale") or scaling.get("mscale_all_dim"):
            raise ConfigError("`rope_scaling.mscale` is not part of DeepSeek-V4 (no YaRN magnitude scaling)")
        af = scaling.get("attention_factor")
        if af not in (None, 1, 1.0):
            raise ConfigError(f"`rope_parameters.compress.attention_factor` must be 1.0, got {af!r}")
    elif rope_type == "default":
        yarn = None
    else:
        raise ConfigError(f"`rope_scaling.type` {rope_type!r} is not supported (allowed: yarn, default)")

    if _require(raw, "num_key_value_heads", default=1) != 1:
        raise ConfigError("`num_key_value_heads` must be 1 (DeepSeek-V4 shares one K=V head)")
    if _require(raw, "n_shared_experts", default=1) != 1:
        raise ConfigError("`n_shared_experts` must be 1")
    if raw.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
        raise ConfigError(f"`scoring_func` must be 'sqrtsoftplus', got {raw.get('scoring_func')!r}")
    if raw.get("norm_topk_prob", True) is not True:
        raise ConfigError("`norm_topk_prob` must be true")
    if raw.get("tie_word_embeddings", False):
        raise ConfigError("`tie_word_embeddings` must be false (DeepSeek-V4 has its own head)")
    eos = raw.get("eos_token_id", 1)
    if isinstance(eos, list):
        eos = eos[0] if eos else None

    return ModelConfig(
        vocab_size=_require(raw, "vocab_size"),
        hidden_size=_require(raw, "hidden_size"),
        num_layers=n,
        num_heads=_require(raw, "num_attention_heads"),
        head_dim=head_dim,
        rope_head_dim=rope_dim,
        q_lora_rank=_require(raw, "q_lora_rank"),
        o_groups=_require(raw, "o_groups"),
        o_lora_rank=_require(raw, "o_lora_rank"),
        sliding_window=_require(raw, "sliding_window"),
        compress_ratios=tuple(ratios),
        hash_layers=hash_layers,
        index_n_heads=_require(raw, "index_n_heads"),
        index_head_dim=_require(raw, "index_head_dim"),
        index_topk=_require(raw, "index_topk"),
        n_routed_experts=_require(raw, "n_routed_experts"),
        num_experts_per_tok=_require(raw, "num_experts_per_tok"),
        moe_intermediate_size=_require(raw, "moe_intermediate_size"),
        routed_scaling_factor=_require(raw, "routed_scaling_factor", float, 1.0),
        swiglu_limit=_require(raw, "swiglu_limit", float, 0.0),
        hc_mult=_require(raw, "hc_mult", default=4),
        hc_sinkhorn_iters=_require(raw, "hc_sinkhorn_iters", default=20),
        hc_eps=_require(raw, "hc_eps", float, 1e-6),
        rms_norm_eps=_require(raw, "rms_norm_eps", float, 1e-6),
        rope_theta=rope_theta,
        compress_rope_theta=compress_theta,
        yarn=yarn,
        num_nextn_predict_layers=n_mtp,
        max_position_embeddings=_require(raw, "max_position_embeddings", default=1048576),
        bos_token_id=raw.get("bos_token_id", 0),
        eos_token_id=eos,
        use_index_cache=raw.get("use_index_cache", False),
        index_topk_freq=_require(raw, "index_topk_freq", default=1),
        index_topk_pattern=raw.get("index_topk_pattern"),
        index_cache_skip_compressor=raw.get("index_cache_skip_compressor", False),
    )


def _validate(c: ModelConfig) -> None:
    positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "q_lora_rank",
                "o_groups", "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim",
                "index_topk", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                "hc_mult", "hc_sinkhorn_iters")
    for name in positive:
        v = getattr(c, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"`{name}` must be a positive integer, got {v!r}")
    if len(c.compress_ratios) != c.num_layers:
        raise ConfigError(f"`compress_ratios` has {len(c.compress_ratios)} entries for {c.num_layers} layers")
    bad = [r for r in c.compress_ratios if r not in BY_RATIO]
    if bad:
        raise ConfigError(f"`compress_ratios` holds unknown ratios {bad} (allowed: 0, 4, 128)")
    if len(c.hash_layers) != c.num_layers:
        raise ConfigError(f"`hash_layers` has {len(c.hash_layers)} entries for {c.num_layers} layers")
    if not (0 < c.rope_head_dim <= c.head_dim) or c.rope_head_dim % 2:
        raise ConfigError(
            f"`qk_rope_head_dim` must be even and in (0, head_dim={c.head_dim}], got {c.rope_head_dim}")
    if c.index_head_dim < c.rope_head_dim:
        raise ConfigError(
            f"`index_head_dim` ({c.index_head_dim}) must be >= qk_rope_head_dim ({c.rope_head_dim})")
    if c.num_heads % c.o_groups:
        raise ConfigError(f"`num_attention_heads` ({c.num_heads}) must be divisible by `o_groups` ({c.o_groups})")
    if c.num_experts_per_tok > c.n_routed_experts:
        raise ConfigError(
            f"`num_experts_per_tok` ({c.num_experts_per_tok}) exceeds `n_routed_experts` ({c.n_routed_experts})")
    for name in ("rope_theta", "compress_rope_theta", "rms_norm_eps", "hc_eps", "routed_scaling_factor"):
        v = getattr(c, name)
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ConfigError(f"`{name}` must be a positive number, got {v!r}")
    if not (isinstance(c.swiglu_limit, (int, float)) and c.swiglu_limit >= 0):
        raise ConfigError(f"`swiglu_limit` must be >= 0, got {c.swiglu_limit!r}")
    for name in ("use_index_cache", "index_cache_skip_compressor", "fp8_activations"):
        if not isinstance(getattr(c, name), bool):
            raise ConfigError(f"`{name}` must be true or false, got {getattr(c, name)!r}")
    if isinstance(c.index_topk_freq, bool) or not isinstance(c.index_topk_freq, int) or c.index_topk_freq < 1:
        raise ConfigError(f"`index_topk_freq` must be an integer >= 1, got {c.index_topk_freq!r}")
    if c.index_topk_pattern is not None:
        pat, n4 = c.index_topk_pattern, sum(r == CSA for r in c.compress_ratios)
        if not isinstance(pat, str) or not pat or set(pat) - {"F", "S"}:
            raise ConfigError(f"`index_topk_pattern` must be a non-empty string of F and S, got {pat!r}")
        if pat[0] != "F":
            raise ConfigError(f"`index_topk_pattern` must start with F (the first ratio-4 layer computes), got {pat!r}")
        if len(pat) > n4:
            raise ConfigError(f"`index_topk_pattern` {pat!r} has {len(pat)} entries for {n4} ratio-4 layers")
    if c.attention_impl not in ("pallas", "ref", "auto"):
        raise ConfigError(f"`attention_impl` must be 'pallas', 'ref' or 'auto', got {c.attention_impl!r}")
    if c.expert_exchange not in EXPERT_EXCHANGES:
        raise ConfigError(f"`expert_exchange` must be one of {', '.join(map(repr, EXPERT_EXCHANGES))}, "
                          f"got {c.expert_exchange!r}")
    if c.yarn is not None:
        if c.yarn.factor <= 0 or c.yarn.original_max_position_embeddings < 1:
            raise ConfigError(f"`rope_scaling` has invalid YaRN values {c.yarn}")
