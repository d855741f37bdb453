"""The routed experts' token exchange under expert parallelism, measured on host devices: the
all-gather of tokens + reduce-scatter of outputs the model uses (`moe.routed_experts_on_mesh`)
against an all-to-all of the rows each device's experts need, in one run. Prints JSON.

    python examples/moe_exchange.py [--devices 8] [--tokens 8,512] [--hidden 4096] [--top-k 6]
        [--experts 256] [--repeats 20]

Each of `--devices` devices holds `tokens` rows of width `--hidden` and their top-k experts
(random, of `--experts`, split evenly over the devices). Every variant returns, on each token's
device, the sum over its k experts of what the expert's device computed for it (here the row
times a per-expert scale, so that only the exchange costs), and all three give the same result
(checked):

* `all_gather_reduce_scatter`: every device gathers all rows and their choices, computes its
  experts' pairs, and a reduce-scatter sums the partial outputs back onto the tokens' devices.
* `all_to_all`: each device sends every destination the rows of the pairs whose expert lives
  there, in a buffer sized for the worst case (all of its pairs to one device: `tokens x k`
  rows per destination, since an exact answer may drop none), and the outputs come back the
  same way. `jax.lax.all_to_all` needs equal sizes, hence the padding.
* `ragged_all_to_all`: the same without the padding (`jax.lax.ragged_all_to_all`): compiled, and
  run where the backend implements it (XLA:CPU does not: the error is reported).

Timed: the median of `--repeats` runs of each compiled program, interleaved round by round.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    n = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--devices=")), None)
    if n is None and "--devices" in sys.argv:
        n = sys.argv[sys.argv.index("--devices") + 1]
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={n or 8}").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402


def variants(n_dev: int, T: int, k: int, E: int):
    """The three exchanges as per-device functions (x `[T, D]`, experts int32 `[T, k]`,
    scale fp32 `[E / n_dev]`) -> `[T, D]`, to run under shard_map over the axis "expert"."""
    per_dev = E // n_dev
    C = T * k  # the all-to-all's rows per destination: the worst case, so that nothing is dropped

    def all_gather_reduce_scatter(x, experts, scale):
        xs = jax.lax.all_gather(x, "expert", axis=0, tiled=True)  # [n T, D]
        es = jax.lax.all_gather(experts, "expert", axis=0, tiled=True)  # [n T, k]
        mine = es // per_dev == jax.lax.axis_index("expert")
        w = jnp.sum(jnp.where(mine, scale[es % per_dev], 0.0), axis=1)  # [n T]
        return jax.lax.psum_scatter(xs * w[:, None], "expert", scatter_dimension=0, tiled=True)

    def _pack(experts):
        """Each pair's destination device and its row in that device's send block."""
        dest = (experts // per_dev).reshape(-1)  # [T k]
        order = jnp.argsort(dest, stable=True)
        counts = jnp.bincount(dest, length=n_dev)
        starts = jnp.cumsum(counts) - counts
        slot = jnp.empty_like(dest).at[order].set(jnp.arange(T * k) - starts[dest[order]])
        return dest, slot, counts, starts, order

    def all_to_all(x, experts, scale):
        D = x.shape[1]
        dest, slot, counts, _, _ = _pack(experts)
        rows = jnp.repeat(x, k, axis=0)  # [T k, D], pair p = token p // k
        send = jnp.zeros((n_dev, C, D), x.dtype).at[dest, slot].set(rows)
        send_e = jnp.zeros((n_dev, C), jnp.int32).at[dest, slot].set(experts.reshape(-1) % per_dev)
        recv = jax.lax.all_to_all(send, "expert", 0, 0, tiled=True)  # [n, C, D]: block j from device j
        recv_e = jax.lax.all_to_all(send_e, "expert", 0, 0, tiled=True)
        out = recv * scale[recv_e][..., None]  # padding rows are zero
        back = jax.lax.all_to_all(out, "expert", 0, 0, tiled=True)
        return back[dest, slot].reshape(T, k, D).sum(1)

    def ragged(x, experts, scale):
        D = x.shape[1]
        dest, slot, counts, starts, order = _pack(experts)
        rows = jnp.repeat(x, k, axis=0)[order]  # pairs grouped by destination
        e_sorted = (experts.reshape(-1) % per_dev)[order]
        # every device's counts, to know where its rows land on each receiver
        all_counts = jax.lax.all_gather(counts, "expert")  # [n (sender), n (receiver)]
        me = jax.lax.axis_index("expert")
        recv_sizes = all_counts[:, me]
        out_offsets = (jnp.cumsum(all_counts, axis=0) - all_counts)[me]  # where my rows go on each receiver
        cap = n_dev * C
        recv = jax.lax.ragged_all_to_all(rows, jnp.zeros((cap, D), x.dtype), starts, counts, out_offsets,
                                         recv_sizes, axis_name="expert")
        recv_e = jax.lax.ragged_all_to_all(e_sorted.astype(jnp.float32), jnp.zeros((cap,), jnp.float32), starts,
                                           counts, out_offsets, recv_sizes, axis_name="expert").astype(jnp.int32)
        out = recv * scale[recv_e][:, None]
        in_offsets = jnp.cumsum(recv_sizes) - recv_sizes
        back_offsets = (jnp.cumsum(all_counts, axis=1) - all_counts)[:, me]
        back = jax.lax.ragged_all_to_all(out, jnp.zeros((T * k, D), x.dtype), in_offsets, recv_sizes,
                                         back_offsets, counts, axis_name="expert")
        return jnp.zeros((T * k, D), x.dtype).at[order].set(back).reshape(T, k, D).sum(1)

    return {"all_gather_reduce_scatter": all_gather_reduce_scatter, "all_to_all": all_to_all,
            "ragged_all_to_all": ragged}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--tokens", default="8,512", help="rows per device, comma-separated")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    n, D, k, E = args.devices, args.hidden, args.top_k, args.experts
    mesh = jax.make_mesh((n,), ("expert",))
    rng = np.random.default_rng(0)
    out = {"devices": n, "hidden": D, "top_k": k, "experts": E, "backend": jax.default_backend(),
           "jax": jax.__version__, "runs": {}}
    for T in (int(t) for t in args.tokens.split(",")):
        x = jax.device_put(rng.standard_normal((n * T, D), np.float32), NamedSharding(mesh, P("expert")))
        experts = np.stack([rng.choice(E, k, replace=False) for _ in range(n * T)]).astype(np.int32)
        experts = jax.device_put(experts, NamedSharding(mesh, P("expert")))
        scale = jax.device_put(rng.standard_normal(E).astype(np.float32), NamedSharding(mesh, P("expert")))
        want = np.asarray(x) * np.asarray(scale)[np.asarray(experts)].sum(1, keepdims=True)
        programs, run = {}, {}
        for name, fn in variants(n, T, k, E).items():
            f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("expert"),) * 3, out_specs=P("expert")))
            try:
                programs[name] = f.lower(x, experts, scale).compile()
                got = np.asarray(programs[name](x, experts, scale))
                run[name] = {"max_abs_error": float(np.abs(got - want).max())}
            except Exception as e:  # the backend's own words: what stands in the way here
                programs.pop(name, None)
                run[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        times = {name: [] for name in programs}
        for _ in range(args.repeats):
            for name, prog in programs.items():
                t0 = time.perf_counter()
                jax.block_until_ready(prog(x, experts, scale))
                times[name].append(time.perf_counter() - t0)
        for name, ts in times.items():
            run[name]["ms"] = round(1e3 * float(np.median(ts)), 3)
        base = run["all_gather_reduce_scatter"].get("ms")
        for name in programs:
            run[name]["ratio_to_all_gather_reduce_scatter"] = round(run[name]["ms"] / base, 3)
        run["bytes_sent_per_device"] = {  # fp32 rows leaving a device, there and back
            "all_gather_reduce_scatter": 2 * (n - 1) * T * D * 4,
            "all_to_all": 2 * (n - 1) * T * k * D * 4,
            "ragged_all_to_all (expected)": round(2 * (n - 1) / n * T * k * D * 4),
        }
        out["runs"][f"tokens_per_device={T}"] = run
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
