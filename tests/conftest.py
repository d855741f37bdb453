import gc
import os
import sys

import jax
import pytest

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
