"""GPU kernels (Triton) for the hot paths, each with a plain-torch reference that runs on the CPU.

Nothing here yet: every model path currently runs on plain PyTorch, on the CPU and on GPUs.
"""
