"""Benchmarks of omnicupy against FlexAttention, FlashAttention-2 and cuDNN: ``python -m benchmarks.run``."""
