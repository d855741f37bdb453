"""The model's blocks as Flax NNX modules: what `nnx.display`, `nnx.state` and
`nnx.Optimizer` see.

A block holds its weights as `nnx.Param`s (the hash layers' token -> experts table, an integer
lookup that no gradient reaches, as a `RoutingTable`), under the names of the parameter tree
(dsv4_jax/model/params.py), so that `nnx.to_pure_dict(nnx.state(block))` is that tree: what the
jitted programs take, and what the converter stores with Orbax: the model without its MTP block
in `params/`, the MTP block (`model.mtp`) in `mtp/`. The stacked
blocks (`DecoderLayers`, `CompressedLayers`) hold every layer of theirs in one array per weight,
leading axis the layer; the stack runs as one `lax.scan` over that state
(dsv4_jax/model/deepseek_v4.py), never a Python loop over modules.

    DeepseekV4                                   (dsv4_jax/model/deepseek_v4.py)
      embed, head, norm, hc_head: HyperConnection
      layers: DecoderLayers      attn_norm, ffn_norm, hc_attn / hc_ffn: HyperConnection,
                                 attn: Attention, ffn: MoE                       [L, ...]
      gate_bias, tid2eid: RoutingTable           the routers' per-layer state
      csa: CompressedLayers      compressor: Compressor, indexer: Indexer        [ratio-4 layers]
      hca: CompressedLayers      compressor: Compressor                          [ratio-128 layers]
      mtp: MTPBlock | None       one window-only layer, its input projections and head
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx


class RoutingTable(nnx.Variable):
    """tid2eid `[L_hash, V, k]` int32: the experts each token goes to on a hash-routed layer. A
    lookup, not a trained weight (there is no gradient of an integer), so `nnx.Optimizer(...,
    wrt=nnx.Param)` leaves it as it is."""


class Block(nnx.Module):
    """A block built from its subtree of the parameter tree: the names in `PARTS` become
    sub-blocks of that type, every other leaf a variable (`nnx.Param`; an integer one a
    `RoutingTable`)."""

    PARTS: dict[str, type[Block]] = {}

    def __init__(self, tree: dict):
        for name, value in tree.items():
            if name in self.PARTS:
                setattr(self, name, self.PARTS[name](value))
            elif not isinstance(getattr(value, "dtype", None), np.dtype):
                raise TypeError(f"{type(self).__name__}.{name}: a weight must be an array or a QuantizedWeight, got "
                                f"{type(value).__name__}")
            elif jnp.issubdtype(value.dtype, jnp.integer):
                setattr(self, name, RoutingTable(value))
            else:
                setattr(self, name, nnx.Param(value))

    @property
    def params(self) -> dict:
        """The block's weights as the plain parameter tree (nested dicts of arrays and
        `QuantizedWeight`s): the state the jitted programs take."""
        return nnx.to_pure_dict(nnx.state(self))


class HyperConnection(Block):
    """A hyper-connection site's mixing weights: fn `[.., (2+hc)*hc, hc*D]`, base, scale (the
    head's: fn `[hc, hc*D]`, base `[hc]`, scale `[1]`)."""


class Attention(Block):
    """A layer's attention projections: the query latent (wq_a, q_norm, wq_b), the shared K=V
    (wkv, kv_norm), the grouped output (wo_a, wo_b) and the per-head sinks."""


class MoE(Block):
    """A layer's feed-forward: the router's gate, the routed experts (w1, w2, w3 `[.., E, ...]`)
    and the shared expert (shared_w1, shared_w2, shared_w3). Learned routing's bias and hash
    routing's table sit in the model (gate_bias, tid2eid), stacked over the layers routed that
    way; the MTP block's own bias sits here."""


class DecoderLayers(Block):
    """What every main layer has, stacked over the L layers: the norms, the two
    hyper-connection sites, attention and the MoE."""

    PARTS = {"hc_attn": HyperConnection, "hc_ffn": HyperConnection, "attn": Attention, "ffn": MoE}


class Compressor(Block):
    """A compressor: wkv and wgate project a layer's input into entries pooled over `ratio`
    positions with the learned positional bias ape, then normed (norm)."""


class Indexer(Block):
    """A ratio-4 layer's lightning indexer: its query (wq_b on the query latent), per-head
    weights (weights_proj) and its own compressor of keys."""

    PARTS = {"compressor": Compressor}


class CompressedLayers(Block):
    """The weights only the layers of one compressed kind have, stacked over those layers: the
    compressor, and for ratio 4 the indexer."""

    PARTS = {"compressor": Compressor, "indexer": Indexer}


class MTPBlock(Block):
    """The multi-token-prediction block (dsv4_jax/model/mtp.py): a main layer's weights (one,
    unstacked) plus enorm, hnorm, e_proj, h_proj and its own norm and hyper-connection head."""

    PARTS = {**DecoderLayers.PARTS, "hc_head": HyperConnection}
