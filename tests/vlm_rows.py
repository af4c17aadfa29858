"""Batched decoding of the families whose backbone only mlx-vlm loads: greedy rows against solo greedy
(``assert_batched_rows_equal_solo``), and what mlx-vlm's speculative cache transaction does with a ragged commit
(rows keeping different counts of a pass) on a family's own caches after a real prefill (``ragged_commit``: the
mechanism a refused family would need, checked on the model)."""

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


def assert_batched_rows_equal_solo(m, prompts: List[List[int]], monkeypatch) -> None:
    """Rows of ``prompts`` (6: different lengths) joining two per step and leaving, plain and drafting rows in one
    step, depth 1 and 2: every greedy row's tokens equal the plain batched engine's and its solo plain greedy decode.
    Each row's draft is replaced, at 70% of its positions, by the token its solo decode emits there (the head still
    runs, so its cache is what it always is): rows then keep different numbers of drafts in one step."""
    import random

    from mtpconvert.runtime.decoding import batched
    from mtpconvert.runtime.decoding.batched import run_batch
    from mtpconvert.runtime.decoding.speculative import plain_generate
    from tests.test_batched import Alternate, assert_not_degenerate, mixed_streams

    solo = [plain_generate(m, p, 30)[0] for p in prompts]
    head_draft = batched.BatchedMTP._draft

    def draft_solo_tokens(engine, drafting):
        drafts, q = head_draft(engine, drafting)
        rows = drafts.tolist()
        for r, s in enumerate(engine.streams):
            for j in range(engine.depth):
                at = len(s.out) + j
                if at < len(solo[s.seed]) and random.Random(f"{s.seed}/{at}").random() < 0.7:
                    rows[r][j] = solo[s.seed][at]
        return mx.array(rows), q

    monkeypatch.setattr(batched.BatchedMTP, "_draft", draft_solo_tokens)
    for depth in (1, 2):
        join_at = [i // 2 for i in range(len(prompts))]
        mtp = mixed_streams(prompts, len(prompts))
        assert_not_degenerate(run_batch(m, mtp, depth, "mtp", join_at=join_at, policy=Alternate()))
        plain = mixed_streams(prompts, len(prompts))
        run_batch(m, plain, depth, "plain", join_at=join_at)
        for i, (a, b) in enumerate(zip(mtp, plain)):
            assert a.out == b.out == solo[i][: len(a.out)], (depth, i)
