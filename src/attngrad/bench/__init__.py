"""attngrad bench: ours beside PyTorch, measured in one process (time) and fresh ones (memory)."""
