"""Benchmarks: MTP decoding against mlx-lm's plain decoding, one stream or many."""
