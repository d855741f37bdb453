"""Ahead-of-time compilation for TPU and NVIDIA GPU targets on a machine that has neither.

The real backend compilers run without an accelerator: libtpu compiles for a TPU topology, and
XLA's CUDA plugin (with ptxas) for GPUs described by an XLA `GpuTargetConfigProto`. A program is
compiled from abstract inputs (`jax.ShapeDtypeStruct`) placed on the target's compile-only
devices, and XLA reports its memory per device and its cost. Needs the `aot` extra
(`pip install -e ".[aot]"`); ../shared/docs/aot-compile.md has the background.

Targets by name (`TARGETS`; their devices' memory, bandwidth and peak flops: `DEVICES`):
    v5p-8     TPU v5p, 4 chips in one host ("v5p:2x2x1")
    v6e-8     TPU v6e, 8 chips in one host ("v6e:2x4")
    tpu7x-8   TPU v7x (Ironwood), 4 chips in one host, 8 devices: each chip's two TensorCores
              are a device each ("tpu7x:2x2x1")
    h100x1    one H100 SXM 80 GB          (gpu_targets/h100_sxm.txtpb)
    h100x8    8 H100 SXM 80 GB in one host
    h200x8    8 H200 SXM 141 GB in one host (gpu_targets/h200_sxm.txtpb)

    devices = topology("v5p-8")                   # compile-only devices
    result = compile_for("h100x1", jax.jit(f), x_spec, y_spec)
    result.compiled.as_text(), result.memory, result.cost
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import math
import os
import re
from typing import Any, NamedTuple

# Both variables are read when JAX first discovers its plugins (its first use of a backend), so
# they are set on import, before that. The CUDA plugin checks the installed CUDA runtime
# libraries before it registers itself, and without them it does not register; compiling needs
# no runtime (only ptxas), so the check is skipped.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
# libtpu takes a machine-wide lock (/tmp/libtpu_lockfile) that guards the TPU chips, so a second
# process loading it fails ("Internal error when accessing libtpu multi-process lockfile"), e.g.
# a test run and the report it starts, or two runs on one machine. Compiling touches no chip.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
from jax._src import lib as _jax_lib  # noqa: E402  (where JAX found its CUDA tools: no public entry point)
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding  # noqa: E402


def _put_ptxas_first_on_path() -> None:
    """XLA runs the ptxas in JAX's CUDA path (the aot extra's nvidia-cuda-nvcc-cu12), but Mosaic
    GPU runs the first `ptxas` on PATH, else /usr/local/cuda's: on this machine image that was
    CUDA 13.0's while XLA used 12.9's. With the package's directory (it holds only ptxas) first on
    PATH both use the pinned one, whatever the machine has."""
    if _jax_lib.cuda_path and os.path.isfile(os.path.join(_jax_lib.cuda_path, "bin", "ptxas")):
        bin_dir = os.path.join(_jax_lib.cuda_path, "bin")
        path = os.environ.get("PATH", "")
        if path.split(os.pathsep)[0] != bin_dir:
            os.environ["PATH"] = bin_dir + os.pathsep + path


_put_ptxas_first_on_path()


@dataclasses.dataclass(frozen=True)
class Device:
    """One device's published figures (the roofline's data, dsv4_jax/tools/plan.py): HBM bytes, HBM
    bandwidth (bytes/s), peak dense bf16 flops/s and, where its matrix units take FP8 operands,
    peak dense FP8 flops/s, with where they come from. A GPU's memory and bandwidth are those its
    target config (gpu_targets/*.txtpb) gives the compiler."""

    kind: str
    memory_bytes: int
    hbm_bandwidth: float
    peak_bf16_flops: float
    source: str
    peak_fp8_flops: float | None = None


DEVICES = {d.kind: d for d in (
    Device("TPU v5p", 95 * 10**9, 2765e9, 459e12,
           "cloud.google.com/tpu/docs/v5p: 459 TFLOPs bf16 per chip, HBM2e 95 GB at 2765 GBps"),
    Device("TPU v6e", 32 * 10**9, 1638e9, 918e12,
           "cloud.google.com/tpu/docs/v6e: 918 TFLOPs bf16 per chip, HBM 32 GB at 1638 GBps"),
    # A TPU v7x chip is two devices (one per TensorCore), each with half the chip's HBM and flops.
    Device("TPU v7x", 192 * 2**30 // 2, 7.37e12 / 2, 2307e12 / 2,
           "cloud.google.com/tpu/docs/tpu7x: 2307 TFLOPs bf16 (4614 fp8) and 192 GiB HBM per chip, "
           "two TensorCores per chip; 7.37 TB/s HBM per chip from Google's Ironwood announcement (jax's "
           "pallas tpu_info: 7.40e12 B/s, 2.31e15 bf16 flop/s, 206e9 bytes); halved per device",
           peak_fp8_flops=4614e12 / 2),
    Device("H100 SXM", 84929347584, 3.35232e12, 989.4e12,
           "NVIDIA H100 datasheet (SXM): bf16 tensor core 1979 TFLOPS with sparsity, 989 dense; fp8 3958 "
           "with sparsity, 1979 dense; 80 GB HBM3 at 3.35 TB/s (memory as gpu_targets/h100_sxm.txtpb gives it)",
           peak_fp8_flops=1978.9e12),
    Device("H200 SXM", 150754820096, 4.8e12, 989.4e12,
           "NVIDIA H200 datasheet (SXM): bf16 tensor core 1979 TFLOPS with sparsity, 989 dense; fp8 3958 "
           "with sparsity, 1979 dense; 141 GB HBM3e at 4.8 TB/s (memory as gpu_targets/h200_sxm.txtpb gives it)",
           peak_fp8_flops=1978.9e12),
)}


@dataclasses.dataclass(frozen=True)
class Target:
    """A compile target: platform "tpu" or "cuda", the topology string the compiler takes, the
    number of devices it has, for TPU the chips per host, for CUDA the device's config file, and
    the kind of device (`DEVICES`)."""

    name: str
    platform: str
    topology: str
    devices: int
    device: str
    chips_per_host: tuple[int, int, int] | None = None
    gpu: str | None = None

    @property
    def spec(self) -> Device:
        return DEVICES[self.device]


TARGETS = {t.name: t for t in (
    Target("v5p-8", "tpu", "v5p:2x2x1", 4, "TPU v5p", chips_per_host=(2, 2, 1)),
    Target("v6e-8", "tpu", "v6e:2x4", 8, "TPU v6e", chips_per_host=(2, 4, 1)),
    Target("tpu7x-8", "tpu", "tpu7x:2x2x1", 8, "TPU v7x", chips_per_host=(2, 2, 1)),
    Target("h100x1", "cuda", "1x1x1", 1, "H100 SXM", gpu="h100_sxm"),
    Target("h100x8", "cuda", "1x1x8", 8, "H100 SXM", gpu="h100_sxm"),
    Target("h200x8", "cuda", "1x1x8", 8, "H200 SXM", gpu="h200_sxm"),
)}


def target(name: str) -> Target:
    if name not in TARGETS:
        raise ValueError(f"unknown compile target {name!r}; known: {', '.join(TARGETS)}")
    return TARGETS[name]


def gpu_target_config(gpu: str) -> str:
    """The XLA GpuTargetConfigProto (text format) of a GPU: gpu_targets/<gpu>.txtpb."""
    path = importlib.resources.files("dsv4_jax.tools") / "gpu_targets" / f"{gpu}.txtpb"
    if not path.is_file():
        raise ValueError(f"no GPU target config {gpu!r} (dsv4_jax/tools/gpu_targets/{gpu}.txtpb)")
    return path.read_text()


@functools.cache
def topology(name: str) -> tuple:
    """The compile-only devices of target `name` (they go into a `Mesh` like real devices)."""
    t = target(name)
    if t.platform == "tpu":
        desc = topologies.get_topology_desc(topology_name=t.topology, platform="tpu",
                                            chips_per_host_bounds=t.chips_per_host)
    else:
        try:
            desc = topologies.get_topology_desc(topology_name=t.name, platform="cuda",
                                                target_config=gpu_target_config(t.gpu), topology=t.topology)
        except NotImplementedError as e:
            raise RuntimeError(
                "JAX's CUDA plugin is not registered: install the `aot` extra, and import dsv4_jax.tools.aot "
                "before JAX first uses a backend (or set JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1)") from e
    devices = tuple(desc.devices)
    if len(devices) != t.devices:
        raise RuntimeError(f"target {name}: the compiler gave {len(devices)} devices, expected {t.devices}")
    return devices


def mesh(name: str, axes: dict[str, int]) -> Mesh:
    """A mesh over all devices of target `name`, axes {name: size} (sizes multiply to the device
    count), laid out by `jax.make_mesh` for the devices' physical order."""
    devices = topology(name)
    if math.prod(axes.values()) != len(devices):
        raise ValueError(f"mesh axes {axes} need {math.prod(axes.values())} devices; {name} has {len(devices)}")
    return jax.make_mesh(tuple(axes.values()), tuple(axes), devices=devices)


class Result(NamedTuple):
    compiled: Any  # jax.stages.Compiled
    memory: dict  # bytes per device: argument, output, alias, temp, generated_code
    cost: dict  # XLA's cost analysis per device: "flops", "bytes accessed", ...


def compile_for(name: str, jitted, *args, mesh: Mesh | None = None, compiler_options: dict | None = None) -> Result:
    """Compiles `jitted` (a `jax.jit` function) for target `name` and returns it with its memory
    and cost analysis.

    args: the call's arguments; their `jax.ShapeDtypeStruct` leaves are the abstract inputs
    (any other leaf, e.g. a static argument, is passed as is). A struct that carries a sharding
    keeps it; one without goes to the target's first device (mesh None) or is replicated over
    `mesh`. compiler_options: passed to `.compile()` (XLA flags for this compile, e.g.
    {"xla_dump_to": dir}). Compiler errors propagate (they are the point)."""
    t = target(name)
    default = SingleDeviceSharding(topology(name)[0]) if mesh is None else NamedSharding(mesh, PartitionSpec())

    def place(leaf):
        if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is None:
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=default)
        return leaf

    placed = jax.tree.map(place, args, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    compiled = jitted.lower(*placed).compile(compiler_options)
    return Result(compiled, memory_of(compiled), cost_of(compiled, t.platform))


def memory_of(compiled) -> dict:
    m = compiled.memory_analysis()
    return {"argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
            "alias_bytes": m.alias_size_in_bytes, "temp_bytes": m.temp_size_in_bytes,
            "generated_code_bytes": m.generated_code_size_in_bytes}


def cost_of(compiled, platform: str) -> dict:
    """XLA's cost analysis of the compiled program. The TPU compiler gives it; for CUDA the
    compiled executable gives none, so XLA's HLO cost analysis runs over its optimized module
    (with the CPU client; a custom call, e.g. a Mosaic kernel, counts as nothing there)."""
    if platform == "tpu":
        cost = compiled.cost_analysis()
    else:
        from jax._src.lib import _jax  # the HLO cost analysis has no public entry point

        module = compiled.runtime_executable().hlo_modules()[0]
        cost = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
    return {k: float(v) for k, v in dict(cost).items()}


# The custom calls a Pallas kernel compiles to: Mosaic TPU; Mosaic GPU and Pallas-Triton (XLA's
# Triton call) on CUDA.
TRITON_CALL = "__gpu$xla.gpu.triton"
KERNEL_CUSTOM_CALLS = {"tpu": ("tpu_custom_call",), "cuda": ("mosaic_gpu", "mosaic_gpu_v2", TRITON_CALL)}


def kernel_calls(compiled, platform: str) -> list[str]:
    """The Pallas kernels in a compiled program: for each kernel's custom call (TPU:
    tpu_custom_call; CUDA: the Mosaic GPU or Triton call), the kernel's name (the pallas_call
    `name` / the Mosaic GPU `kernel_name`, from the call's op_name), in program order."""
    targets = KERNEL_CUSTOM_CALLS[platform]
    names = []
    for line in compiled.as_text().splitlines():
        call = re.search(r'custom_call_target="([^"]+)"', line)
        if call and call.group(1) in targets:
            op = re.search(r'op_name="([^"]*)"', line)
            names.append(kernel_name(op.group(1)) if op else "?")
    return names


def kernel_name(op_name: str) -> str:
    """The kernel's name in an op_name such as "jit(f)/cond/branch_0_fun/dsv4_compress/pallas_call"."""
    parts = op_name.split("/")
    return parts[-2] if len(parts) > 1 else parts[-1]
