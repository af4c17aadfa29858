"""MTP speculative decoding on top of stock mlx-lm's Qwen3.5 models."""
