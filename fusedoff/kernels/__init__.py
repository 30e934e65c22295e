"""Python-side kernels: the pure-PyTorch reference (also the 'torch' backend) and Triton."""
