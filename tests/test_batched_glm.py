"""Batched MTP over GLM-5's nextn head (``glm_moe_dsa``: MLA latents and the sparse-attention indexer's keys in one
``CacheList`` per layer, ``rowcache.RowCacheList`` per row): the trained text fixture, rows joining and leaving,
plain and drafting rows in one step, different accepts in one step; every greedy row's tokens equal the plain
batched engine's and its solo plain greedy decode (mlx-lm's own caches) on the CPU. With ``index_topk`` below
the context the indexer selects keys (its sparse path) in the solo decode and in every row alike."""

import json
import shutil

import pytest

from tests.checkpoints import convert_folder
from tests.test_batched import Alternate, assert_not_degenerate, mixed_streams
from mtpconvert.fixture.text import heldout_prompts, text_fixture_path
from mtpconvert.runtime.decoding.batched import run_batch
from mtpconvert.runtime.decoding.load import load
from mtpconvert.runtime.decoding.rowcache import RowCacheList, RowKVCache
from mtpconvert.runtime.decoding.speculative import plain_generate


@pytest.fixture(scope="module")
def glm5(tmp_path_factory):
    """The trained GLM-5 fixture in float32 (mlx's CPU gather_mm), and a copy whose indexer keeps 12 keys."""
    root = tmp_path_factory.mktemp("glm5-batched")
    convert_folder(text_fixture_path("glm5"), root / "dense", dtype="float32")
    shutil.copytree(root / "dense", root / "sparse")
    config = json.loads((root / "sparse" / "config.json").read_text())
    (root / "sparse" / "config.json").write_text(json.dumps(dict(config, index_topk=12)))
    _, prompts, _ = heldout_prompts(text_fixture_path("glm5"), per_file=1, prompt_tokens=24, files=8)
    return root, prompts


def _rows_match(m, prompts, B, depth):
    join_at = [i // 2 for i in range(B)]
    mtp = mixed_streams(prompts, B)
    engine = run_batch(m, mtp, depth, "mtp", join_at=join_at, policy=Alternate())
    assert_not_degenerate(engine)
    plain = mixed_streams(prompts, B)
    run_batch(m, plain, depth, "plain", join_at=join_at)
    for i, (a, b) in enumerate(zip(mtp, plain)):
        assert a.out == b.out, i
        assert a.out == plain_generate(m, a.prompt, len(a.out))[0], i
    return engine


@pytest.mark.parametrize("B, depth", [(4, 1), (8, 2)])
def test_glm5_rows_match_plain_batched_and_solo(glm5, B, depth):
    root, prompts = glm5
    m = load(root / "dense")
    _rows_match(m, prompts, B, depth)
    caches = m.backbone.row_cache(max_pass=depth + 1, rows=3)  # per layer: MLA latents, indexer keys
    assert all(type(c) is RowCacheList and [x.lengths for x in c.caches] == [[0] * 3] * 2 for c in caches)


def test_glm5_sparse_indexer_rows_match_plain_batched_and_solo(glm5):
    root, prompts = glm5
    m = load(root / "sparse")
    assert m.backbone.args.index_topk < len(prompts[0])  # the indexer selects from the first pass on
    _rows_match(m, prompts, 4, 2)


def test_row_cache_list_moves_every_cache_together():
    import mlx.core as mx

    c = RowCacheList(RowKVCache([0, 0]), RowKVCache([0, 0]))
    for x in c.caches:
        x.update_and_fetch(mx.ones((2, 1, 3, 4)), mx.ones((2, 1, 3, 2)))
    c.trim_rows([1, 2])
    assert c.lengths == [2, 1] and [x.lengths for x in c.caches] == [[2, 1], [2, 1]]
    assert c.make_mask(1).shape == (2, 1, 1, 3) and mx.array_equal(c.offset, mx.array([2, 1])).item()
    c.add_empty_row()
    c.filter([2, 0])
    assert [x.lengths for x in c.caches] == [[0, 2], [0, 2]] and len(c.state) == 4
