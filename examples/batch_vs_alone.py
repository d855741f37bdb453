"""Does a row of a ragged batch generate what its prompt generates alone? Greedy, on the demo's
tiny random checkpoint (converted to the given dtype), for a batch of prompts of the given
lengths against each prompt alone. Prints JSON: per row, its prompt length and the first
generated token at which the batch and the lone run differ (null: none in `--tokens`).

    python examples/batch_vs_alone.py [--dtype bfloat16|float32] [--lengths 5,2000,700] [--tokens 48]

In float32 every row matches (docs/generate.md, "Per-sequence positions, `generate` and the cache"); in bfloat16 the batch's products sum in
another order before the rounding, and the rows can part.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import dsv4_jax  # noqa: E402
from convert.cli import convert  # noqa: E402
from dsv4_jax.tools.random_checkpoint import write_random_checkpoint  # noqa: E402


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where a and b differ (a length difference counts), else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--lengths", default="5,2000,700", help="prompt lengths, comma-separated")
    ap.add_argument("--tokens", type=int, default=48, help="tokens to generate per prompt")
    args = ap.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    with tempfile.TemporaryDirectory(prefix="dsv4-batch-") as work:
        hf, out = os.path.join(work, "hf"), os.path.join(work, "converted")
        write_random_checkpoint(hf, "tiny", seed=0)
        convert(hf, out, dtype=args.dtype)
        model = dsv4_jax.load(out, dtype=getattr(jnp, args.dtype))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, model.config.vocab_size, n).tolist() for n in lengths]
    batch = dsv4_jax.generate(model, prompts, args.tokens, eos_token_id=None).rows()
    rows = []
    for prompt, got in zip(prompts, batch):
        alone = dsv4_jax.generate(model, [prompt], args.tokens, eos_token_id=None).rows()[0]
        rows.append({"prompt_len": len(prompt), "first_difference": first_difference(got, alone)})
    print(json.dumps({"dtype": args.dtype, "tokens": args.tokens, "rows": rows}))


if __name__ == "__main__":
    main()
