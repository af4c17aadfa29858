"""Reading and writing checkpoint folders: safetensors headers, tensor reads, shard writes, the output folder."""
