"""MTP speculative decoding on top of stock mlx-lm's Qwen3.5 models, and what is built on it.

``decoding``: a converted folder loaded with its head, draft/verify with rollback, batched decoding;
``checks``: the smoke checks that gate a conversion; ``measure``: the benchmarks. Imports go one way,
measure -> checks -> decoding, so the decoder never depends on what checks or measures it.
"""
