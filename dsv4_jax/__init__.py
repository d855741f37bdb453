"""DeepSeek-V4 inference in JAX."""

from .cache import cache_bytes, init_cache
from .config import ConfigError, ModelConfig, Yarn
from .engine import Engine
from .generate import GenerateOutput, generate
from .index_cache import IndexCacheSchedule, index_cache_schedule
from .loading import load, load_mtp_params
from .model import Model, forward, step
from .mtp import init_mtp_cache, init_mtp_params, mtp_step
from .params import init_params, param_spec

__all__ = ["ConfigError", "Engine", "GenerateOutput", "IndexCacheSchedule", "Model", "ModelConfig", "Yarn", "cache_bytes",
           "forward", "generate", "index_cache_schedule", "init_cache", "init_mtp_cache", "init_mtp_params",
           "init_params", "load", "load_mtp_params", "mtp_step", "param_spec", "step"]
