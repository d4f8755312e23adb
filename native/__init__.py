"""GPU kernels (Triton) for the hot paths, each with a plain-torch reference that runs on the CPU.

- tree_delta_rule: the tree-aware Gated DeltaNet conv and delta rule (references in
  splitspec.models.delta_rule, which dispatches to these on CUDA).
"""
