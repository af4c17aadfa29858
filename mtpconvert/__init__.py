"""mtpconvert: Qwen3.5 / Qwen3.6 checkpoints to MLX with the MTP head kept."""

__version__ = "0.1.0"
