"""Kernels: backbone walks, chunked GatedDeltaNet, batch-invariant and quantized matmuls, the backend's switches."""
