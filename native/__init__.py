"""GPU kernels (Triton) for the hot paths, each with a plain-torch reference that runs on the CPU.

``gguf_matmul``: ``x @ W^T`` with W kept in its GGUF blocks (Q8_0, Q4_K, Q6_K), and ``QuantLinear``.
"""
