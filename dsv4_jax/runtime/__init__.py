"""Running the model: sampling, `generate`, speculative decoding with the MTP block, the
continuous-batching `Engine`, multi-host start-up, the compilation cache and the command-line
options the tools share. Built on dsv4_jax.model and dsv4_jax.checkpoint."""
