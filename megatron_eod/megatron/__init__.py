"""Stage 4, Megatron integration: everything that touches megatron-core (datasets, CPU compat;
the attention module, RoPE, batch and loss functions and flags arrive with the trainer)."""
