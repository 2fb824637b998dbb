"""Checking tools that need no GPU: run GPU kernels on a CPU OpenCL device, check CUDA with ptxas."""
