"""The node kernels (Triton) and their launch path: dispatch, combine, the routing histogram, shared helpers."""
