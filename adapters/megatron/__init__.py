"""The Megatron-core trainer (GPU only; it builds on CPU)."""
