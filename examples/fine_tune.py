"""Fine-tuning a checkpoint with optax through Flax NNX: load, train a few steps on new text, save,
load again.

    python examples/fine_tune.py CKPT --text FILE [FILE ...] --out DIR [--steps 4] [--lr 3e-4]

CKPT is a directory `dsv4_jax.load` reads with its tokenizer (a `dsv4-train` run, or a converted
checkpoint). The model is the `nnx.Module` load returns; `nnx.Optimizer(model, optax.adamw(...),
wrt=nnx.Param)` updates its parameters in place (the hash layers' routing table is not a Param),
on the losses the trainer uses (dsv4_jax/training/objective.py: next-token cross-entropy, the MTP
block's, the indexer's KL). DIR gets the tuned model with CKPT's tokenizer. Prints one JSON line:
the loss on the text before and after, and whether the saved model, loaded again, gives the tuned
model's logits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

import dsv4_jax  # noqa: E402
from dsv4_jax.training import objective  # noqa: E402
from dsv4_jax.training.trainer import MTP_WEIGHT, save_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt")
    ap.add_argument("--text", nargs="+", required=True, help="text files to tune on")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seq-len", type=int, default=128)
    args = ap.parse_args()

    model = dsv4_jax.load(args.ckpt, mtp=True)
    cfg = model.config.replace(attention_impl="ref")  # the kernels have no reverse mode
    tok = Tokenizer.from_file(os.path.join(args.ckpt, "tokenizer.json"))
    ids = np.concatenate([tok.encode(open(f, encoding="utf-8", errors="replace").read()).ids for f in args.text])
    n = (len(ids) - 1) // args.seq_len
    if n < 1:
        sys.exit(f"fine_tune: the text has {len(ids)} tokens, fewer than one window of {args.seq_len + 1}")
    windows = jnp.asarray(np.stack([ids[i * args.seq_len:(i + 1) * args.seq_len + 1] for i in range(min(n, 4))]))

    def loss_fn(model):
        main = dict(model.params)
        frozen = {"tid2eid": main.pop("tid2eid")} if "tid2eid" in main else {}
        trainable = {"main": main} if model.mtp is None else {"main": main, "mtp": model.mtp.params}
        return objective.total(objective.losses(trainable, frozen, windows, cfg)[0], MTP_WEIGHT)

    @nnx.jit
    def train_step(model, optimizer):
        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.Param))(model)
        optimizer.update(model, grads)
        return loss

    optimizer = nnx.Optimizer(model, optax.adamw(args.lr), wrt=nnx.Param)
    losses = [float(train_step(model, optimizer)) for _ in range(args.steps)]
    after = float(nnx.jit(loss_fn)(model))
    save_model(model, args.out, args.ckpt, {"fine_tuned_from": os.path.abspath(args.ckpt), "steps": args.steps})
    again = dsv4_jax.load(args.out, mtp=True)
    probe = np.asarray(windows[:1, :32])
    same = np.allclose(np.asarray(again(probe)), np.asarray(model(probe)), atol=1e-5)
    print(json.dumps({"loss_before": losses[0], "loss_after": after, "steps": args.steps, "out": args.out,
                      "reloaded_equal": bool(same)}))


if __name__ == "__main__":
    main()
