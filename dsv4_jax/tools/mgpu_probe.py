"""Probe (run as a script, CPU is enough): how far a Mosaic GPU gather + *wgmma* (tensor-core)
design gets through jax.export for CUDA in jax 0.10.2. Not imported by the package; see README.md,
GPU status. The shipped kernel (sparse_attention_mgpu.py) avoids wgmma; this script is kept to
reproduce why. It checks lowering only: it issues many TMA copies against one barrier created with
num_arrivals=1, which would be wrong at run time (the kernel uses num_arrivals = copies per wait).
Run: python -m dsv4_jax.tools.mgpu_probe plain|swizzled|wgmma|wgmma_unopt"""
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

B, T, H, D, N, K, BK = 1, 1, 64, 512, 1152, 640, 64


def _tr():
    return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def probe(mode: str) -> str:
    swizzled_dst = mode == "swizzled"

    def body(q_gmem, kv_gmem, idx_gmem, o_gmem):
        bt = lax.axis_index("bt")

        def scoped(idx_smem, buf, kbuf, qs, bar):
            plgpu.copy_gmem_to_smem(idx_gmem.at[bt], idx_smem, bar.at[0])
            plgpu.copy_gmem_to_smem(q_gmem.at[bt], qs, bar.at[2])
            plgpu.barrier_wait(bar.at[0])

            def fetch(j, c):  # one TMA per kv row
                row = jnp.maximum(idx_smem[j // 128, j % 128], 0)
                dst = kbuf if swizzled_dst else buf
                src = kv_gmem.at[0, pl.ds(row, 1)]
                if swizzled_dst:
                    src = src.reshape(1, D)
                plgpu.copy_gmem_to_smem(src, dst.at[pl.ds(j, 1)], bar.at[1])
                return c

            lax.fori_loop(0, BK, fetch, 0)
            plgpu.barrier_wait(bar.at[1])
            plgpu.barrier_wait(bar.at[2])
            if mode in ("wgmma", "wgmma_unopt"):  # re-layout plain -> swizzled, then q @ k^T (wgmma)
                if mode == "wgmma":
                    rows = plgpu.layout_cast(buf.reshape(BK, D)[...], plgpu.Layout.WGMMA)
                else:  # a load that may bank-conflict (as the shipped kernel's loads do)
                    rows = plgpu.load(buf.reshape(BK, D), (), layout=plgpu.Layout.WGMMA, optimized=False)
                kbuf[...] = rows
                plgpu.commit_smem()

                def mm(acc_ref):
                    plgpu.wgmma(acc_ref, qs, plgpu.transpose_ref(kbuf, (1, 0)))
                    return acc_ref[...]

                pl.run_state(mm)(plgpu.ACC.init(plgpu.layout_cast(jnp.zeros((H, BK), jnp.float32), plgpu.Layout.WGMMA)))
            o_gmem[bt, pl.ds(0, 1), :] = jnp.zeros((1, D), jnp.bfloat16)

        pl.run_scoped(scoped, plgpu.SMEM((K // 128, 128), jnp.int32), plgpu.SMEM((BK, D // 256, 256), jnp.bfloat16),
                      plgpu.SMEM((BK, D), jnp.bfloat16, transforms=_tr()),
                      plgpu.SMEM((H, D), jnp.bfloat16, transforms=_tr()),
                      plgpu.Barrier(num_arrivals=1, num_barriers=3))

    f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((B * T, H, D), jnp.bfloat16), grid=(B * T,),
                     grid_names=("bt",))
    args = (jax.ShapeDtypeStruct((B * T, H, D), jnp.bfloat16),
            jax.ShapeDtypeStruct((B, N, D // 256, 256), jnp.bfloat16),
            jax.ShapeDtypeStruct((B * T, K // 128, 128), jnp.int32))
    try:
        text = jax.export.export(jax.jit(f), platforms=["cuda"])(*args).mlir_module()
        return f"{mode}: exported, mosaic_gpu custom call: {'mosaic_gpu' in text}"
    except Exception as e:  # noqa: BLE001 - the point is to print the error
        return f"{mode}: {type(e).__name__}: {str(e).splitlines()[0]}"


if __name__ == "__main__":
    for m in sys.argv[1:] or ["plain", "swizzled", "wgmma", "wgmma_unopt"]:
        print(probe(m))
