"""What the target and draft workers share: the engine host and sequence table, CUDA graph capture."""
