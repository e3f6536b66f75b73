"""Kernels: backbone walks, chunked GatedDeltaNet, batch-invariant and quantized matmuls, the custom kernels kept on disk."""
