"""Two processes, one model: `dsv4-generate` under JAX's multi-controller runtime on localhost,
each process with 4 host devices, the mesh data=2 x expert=4 spanning both (each process reads
only its devices' shards). Its greedy tokens equal one process's."""

import json
import os
import re
import socket
import subprocess
import sys

import pytest

import dsv4_jax
from convert.cli import main as convert_main
from dsv4_jax.tools.random_checkpoint import write_random_checkpoint


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    hf = write_random_checkpoint(str(tmp_path_factory.mktemp("rc") / "hf"), "tiny")
    out = tmp_path_factory.mktemp("conv") / "native"
    assert convert_main([hf, str(out), "--dtype", "native"]) == 0
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _cli(*args, env=None):
    return subprocess.Popen([sys.executable, "-m", "dsv4_jax.tools.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def test_two_processes_give_one_process_tokens(native):
    prompts = [[3, 4, 5, 6, 7] * 30, [9, 8, 7]]  # 150 tokens: ratio-4 and ratio-128 blocks completed
    want = dsv4_jax.generate(dsv4_jax.load(native), prompts, 8, eos_token_id=None).rows()
    port = _free_port()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    ids = ";".join(",".join(map(str, p)) for p in prompts)
    procs = [_cli("--ckpt", str(native), "--ids", ids, "--max-new-tokens", "8", "--no-eos", "--dtype", "float32",
                  "--mesh", "data=2,expert=4", "--coordinator", f"localhost:{port}", "--num-processes", "2",
                  "--process-id", str(i), "--json", "--compile-cache", "off", env=env) for i in range(2)]
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    report = json.loads(outs[0][0])  # process 0 prints the report alone on stdout
    assert outs[1][0] == ""
    assert report["processes"] == 2 and report["mesh"] == "data=2,expert=4"
    assert [r["ids"] for r in report["rows"]] == want


@pytest.mark.parametrize("args, message", [
    (["--coordinator", "localhost:1234"], r"missing num_processes \(or JAX_NUM_PROCESSES\), process_id"),
    (["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"], "coordinator must be HOST:PORT"),
    (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"], r"process_id must be in \[0, 2\)"),
    (["--mesh", "data=3"], r"mesh \{'data': 3\} needs 3 devices"),
    (["--mesh", "model=8"], "--mesh must be AXIS=SIZE pairs"),
    (["--layout", "tp_attention"], "--layout needs --mesh"),
])
def test_bad_distributed_and_mesh_flags(native, args, message):
    p = _cli("--ckpt", str(native), "--ids", "1,2", "--compile-cache", "off", *args,
             env=dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8"))
    out, err = p.communicate(timeout=300)
    assert p.returncode == 1 and out == ""
    lines = [line for line in err.splitlines() if line.startswith("dsv4-generate:")]
    assert len(lines) == 1 and re.search(message, lines[0]), err[-2000:]
    assert "Traceback" not in err
