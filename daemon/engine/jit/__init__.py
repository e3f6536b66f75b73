"""JIT: where MLX keeps compiled kernels, and compiling them ahead of the first step (the prebuild's workers)."""
