"""DeepSeek-V4 inference in JAX."""

from .config import ConfigError, ModelConfig, Yarn
from .loading import load
from .model import Model, forward
from .params import init_params, param_spec

__all__ = ["ConfigError", "Model", "ModelConfig", "Yarn", "forward", "init_params", "load", "param_spec"]
