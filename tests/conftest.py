import os
import sys

import jax

# Parity runs in fp32 with full-precision matmuls (tolerances are stated per test).
jax.config.update("jax_default_matmul_precision", "highest")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
