"""The model: its configuration, parameters and cache, the layers and their stack, the MTP block,
and how each array lies on a device mesh. Imports nothing above it but pallas_kernels."""
