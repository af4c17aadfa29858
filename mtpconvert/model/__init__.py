"""What a Qwen3.5/3.6 checkpoint is: the config spec, the tensor slots, and how source keys map onto them."""
