"""Dense projections with the reference's dtype rule: the input is cast to the weight's dtype,
products accumulate in fp32, and the output comes back in the weight's dtype."""

from __future__ import annotations

import jax.numpy as jnp


def dense(x: jnp.ndarray, w: jnp.ndarray) -> jnp.ndarray:
    """x `[..., in]`, w `[out, in]` -> `[..., out]` in w's dtype."""
    y = jnp.einsum("...i,oi->...o", x.astype(w.dtype), w, preferred_element_type=jnp.float32)
    return y.astype(w.dtype)
