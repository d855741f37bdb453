"""DeepSeek-V4 inference in JAX: the public API over dsv4_jax.model (the model), .checkpoint
(checkpoints on disk) and .runtime (generate, the engine). The server is dsv4_jax.serving, the
tools (CLIs, benchmarks, plans) dsv4_jax.tools; docs/design.md draws the floors."""

from .checkpoint.loading import load, load_mtp_params
from .model.cache import cache_bytes, init_cache
from .model.config import ConfigError, ModelConfig, Yarn
from .model.deepseek_v4 import DeepseekV4, forward, step
from .model.index_cache import IndexCacheSchedule, index_cache_schedule
from .model.mtp import init_mtp_cache, init_mtp_params, mtp_step
from .model.params import init_params, param_spec
from .runtime.engine import Engine
from .runtime.generate import GenerateOutput, generate

__all__ = ["ConfigError", "DeepseekV4", "Engine", "GenerateOutput", "IndexCacheSchedule", "ModelConfig", "Yarn", "cache_bytes",
           "forward", "generate", "index_cache_schedule", "init_cache", "init_mtp_cache", "init_mtp_params",
           "init_params", "load", "load_mtp_params", "mtp_step", "param_spec", "step"]
