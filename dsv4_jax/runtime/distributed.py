"""Many processes, one model: JAX's multi-controller runtime (`jax.distributed`).

Every process runs the same program; `jax.devices()` then lists the devices of all of them, a
mesh spans them (`dsv4_jax.model.sharding.make_mesh`), `load(..., mesh=)` reads on each process only
the shards of its own devices, and a jitted program runs on all of them at once. Call
`initialize` before anything else touches JAX, in every process, with the same coordinator and
process count and each its own id (or set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
JAX_PROCESS_ID; on TPU pods, Slurm or Open MPI, `initialize(auto=True)` lets JAX find them).
"""

from __future__ import annotations

import contextlib
import os
import sys

ENV = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES", "process_id": "JAX_PROCESS_ID"}


def _settings(coordinator, num_processes, process_id) -> dict:
    """The three settings from the arguments, else the environment; checked."""
    given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    out = {}
    for name, value in given.items():
        if value is None and os.environ.get(ENV[name]):
            value = os.environ[ENV[name]]
        out[name] = value
    if all(v is None for v in out.values()):
        return {}
    missing = [f"{k} (or {ENV[k]})" for k, v in out.items() if v is None]
    if missing:
        raise ValueError(f"multi-process run: missing {', '.join(missing)}")
    host, _, port = str(out["coordinator"]).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"coordinator must be HOST:PORT, got {out['coordinator']!r}")
    for name in ("num_processes", "process_id"):
        try:
            out[name] = int(out[name])
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be an integer, got {out[name]!r}") from None
    if out["num_processes"] < 1:
        raise ValueError(f"num_processes must be >= 1, got {out['num_processes']}")
    if not 0 <= out["process_id"] < out["num_processes"]:
        raise ValueError(f"process_id must be in [0, {out['num_processes']}), got {out['process_id']}")
    return out


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               auto: bool = False) -> bool:
    """Joins this process to the others (`jax.distributed.initialize`); returns whether it did.

    coordinator "HOST:PORT" (process 0's address and a free port), num_processes, process_id
    (0 .. num_processes - 1): from the arguments, else from the environment variables in `ENV`.
    With none of them, nothing happens unless `auto` (JAX's own detection of TPU pods, Slurm,
    Open MPI). Host (CPU) devices exchange data through gloo."""
    settings = _settings(coordinator, num_processes, process_id)
    if not settings and not auto:
        return False
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if settings:
        jax.distributed.initialize(settings["coordinator"], settings["num_processes"], settings["process_id"])
    else:
        jax.distributed.initialize()
    return True


def add_arguments(parser) -> None:
    """The multi-process flags of the CLIs."""
    g = parser.add_argument_group("multi-process (one process per host; every process runs the same command)")
    g.add_argument("--coordinator", help=f"HOST:PORT of process 0 (or ${ENV['coordinator']})")
    g.add_argument("--num-processes", type=int, help=f"number of processes (or ${ENV['num_processes']})")
    g.add_argument("--process-id", type=int, help=f"this process's id, 0 .. N-1 (or ${ENV['process_id']})")


def from_arguments(args) -> bool:
    """`initialize` with the CLI flags `add_arguments` declares."""
    return initialize(args.coordinator, args.num_processes, args.process_id)


@contextlib.contextmanager
def stdout_to_stderr():
    """Sends what is written to file descriptor 1 to 2 while inside: the host collectives' library
    (gloo) prints its connection lines on stdout, where a CLI's output (e.g. --json) must stand
    alone."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
