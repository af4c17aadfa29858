"""What mlx-vlm's speculative cache transaction does with a ragged commit (rows keeping different counts of a pass) on
a family's own caches after a real prefill (``ragged_commit``: the mechanism a refused family would need, checked on
the model)."""

from __future__ import annotations

from typing import List, Sequence

import mlx.core as mx


def leaves(caches: Sequence) -> list:
    from mlx_vlm.speculative.cache_state import iter_leaf_caches

    return list(iter_leaf_caches(caches))


def kinds(caches: Sequence) -> set:
    return {type(c).__name__ for c in leaves(caches)}


def ragged_commit(m, kind: str, prompt_rows: List[List[int]], keep: Sequence[int], fed: List[List[int]]):
    """Prefill ``prompt_rows`` (equal lengths) with the backbone's own caches, run a pass of ``fed`` under a transaction
    over the leaf caches of ``kind`` only, and commit ``keep`` (one count per row). Returns (those leaves, the
    exception the commit raised or None)."""
    from mlx_vlm.speculative.cache_state import start_speculative_cache

    caches = m.backbone.make_cache()
    m.backbone.forward(mx.array(prompt_rows), caches)
    chosen = [c for c in leaves(caches) if type(c).__name__ == kind]
    transaction = start_speculative_cache(chosen, len(fed[0]))
    mx.eval(m.backbone.forward(mx.array(fed), caches)[1])
    try:
        transaction.commit(list(keep))
    except (ValueError, RuntimeError) as e:
        return chosen, e
    return chosen, None
