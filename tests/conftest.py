import contextlib
import gc
import os
import random
import sys
import threading
import time

# The tests run on the CPU (the AOT tests compile for TPU / GPU without initialising those
# platforms); without this, an installed libtpu / CUDA plugin logs its failed start-up on every
# process, the CLIs' subprocesses included.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Eight host devices for the mesh tests (fixed when jax starts); single-device code runs on the first.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

# The suite compiles hundreds of small programs and runs each a few times; LLVM's optimization of
# XLA:CPU's code is most of that compile time, so the tests (and the CLIs they start) skip it, and
# they have XLA:CPU emit its fusions with its older elemental emitter, which compiles the tests'
# programs in about half the time of the default MLIR fusion emitters (docs/speed.md, "The test
# suite's compile time"). They trade the CPU code's speed for compile time (every comparison here
# is between programs compiled alike, or within a stated tolerance). The TPU compiler the AOT
# tests drive ignores them; XLA's GPU compiler takes the first two for the Triton kernels' code
# (their registers change), which is why `dsv4_jax.tools.kernel_report` compiles for GPU with
# XLA's defaults stated.
for _flag in ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
              "--xla_cpu_use_fusion_emitters=false"):
    if _flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " " + _flag

import jax  # noqa: E402
import pytest  # noqa: E402

# Parity runs in fp32 with full-precision matmuls (tolerances are stated per test).
jax.config.update("jax_default_matmul_precision", "highest")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """The suite runs in one process: drop each module's compiled programs and arrays when it
    ends, so memory does not grow with the number of test modules."""
    yield
    jax.clear_caches()
    gc.collect()


# What an installed CUDA plugin (the `aot` extra) prints on a machine without CUDA when any jax
# process starts, before our code runs; not ours to silence.
_PLUGIN_NOISE = ("All log messages before absl::InitializeLog() is called", "cudart_stub.cc")


def stderr_lines(text: str) -> list[str]:
    """A subprocess's stderr lines, without the CUDA plugin's start-up lines."""
    return [line for line in text.splitlines() if not any(n in line for n in _PLUGIN_NOISE)]


@contextlib.contextmanager
def serving(service, args):
    """dsv4-serve's app for `service` on uvicorn, configured as the command configures it
    (`serve.uvicorn_config`), in a thread on a free port; yields the port, and at the end shuts
    the server down (its lifespan stops the engine)."""
    import uvicorn

    from dsv4_jax.serving import serve

    sock = serve.listen_socket("127.0.0.1", 0)
    server = uvicorn.Server(serve.uvicorn_config(service, args, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(60)


def text_splits(text: str):
    """A text as a stream might deliver it: whole, character by character, in random token-like
    pieces of 1 to 6 characters, and cut in two at every position."""
    yield [text]
    yield list(text)
    rng = random.Random(len(text))
    for _ in range(5):
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(1, 6)
            pieces.append(text[i: i + n])
            i += n
        yield pieces
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]


# With `--no-loadscope-reorder` (pyproject.toml), xdist's `--dist loadfile` hands a free worker the
# next file in collection order, not the file with the most tests next (which hands out a long file
# of few tests, such as this suite's training tests, near the end): the files whose tests take
# minutes (module fixtures that train, serve or compile whole plans) are collected first, so that
# the last files handed out are short ones and neither worker idles long while the other finishes.
LONG_FILES = ("test_train.py", "test_serve_api.py", "test_plan.py", "test_speculative.py", "test_readme.py",
              "test_prefix_cache.py", "test_serve_hostile.py", "test_convert.py", "test_model_parity.py")


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(LONG_FILES)))  # stable: files keep their order
