"""Batched MTP decoding of Nemotron-H (runtime/decoding/batched.py through the family's adapter), on the trained
fixture ``text-nemotronh-mtp`` (Super's blocks and head "*E") converted at float32 (the CPU's gather_mm is
float32-only): the per-row Mamba2 undo leaves each row's conv window and SSM state as mlx-lm's stock forward over only
that row's kept tokens does, and every greedy row of the batched engine (drafting and plain rows in one step, rows
joining at different steps with prompts of different lengths, leaving as they finish) decodes the plain batched
engine's tokens and its solo plain greedy tokens."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache

from tests.checkpoints import convert_folder
from tests.test_batched import Alternate, assert_not_degenerate, mixed_streams
from mtpconvert.fixture.text import heldout_prompts, text_fixture_path
from mtpconvert.runtime.decoding.batched import run_batch
from mtpconvert.runtime.decoding.load import load
from mtpconvert.runtime.decoding.rowcache import RowKVCache, undo_rows
from mtpconvert.runtime.decoding.speculative import plain_generate

FIXTURE = "text-nemotronh-mtp"
B = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("nemotron-batched") / "f32"
    convert_folder(text_fixture_path(FIXTURE), out, dtype="float32")
    return load(out)


@pytest.fixture(scope="module")
def prompts():
    _, ids, _ = heldout_prompts(text_fixture_path(FIXTURE), per_file=1, prompt_tokens=24, files=B)
    assert len({len(p) for p in ids}) > 1  # rows of different lengths in the attention caches
    return ids


def test_per_row_mamba_rollback_equals_a_stock_forward_over_each_rows_kept_tokens(model, prompts):
    """Rows prefilled alone and appended (as rows join), one verify pass of S tokens per row, then each row keeps its
    own prefix: every Mamba2 block's conv window and SSM state per row are those of mlx-lm's stock forward over that
    row's prompt and kept tokens, and every attention cache holds exactly that many positions of the row."""
    m = model
    m.backbone.enable_rollback()
    S = 3
    cache = None
    for p in prompts:
        rows = m.backbone.row_cache(max_pass=S, rows=1)
        m.backbone.forward(mx.array([p]), rows)
        if cache is None:
            cache = rows
        else:
            for mine, new in zip(cache, rows):
                mine.extend(new)
    fed = [[p[-1], p[0], p[1]] for p in prompts]  # different tokens in every row
    m.backbone.forward(mx.array(fed), cache)
    keep = [1, 3, 2, 1]  # different cuts, one row keeping the whole pass
    undo_rows(cache, keep, S)
    mamba = [c for c in cache if isinstance(c, ArraysCache)]
    attention = [c for c in cache if isinstance(c, RowKVCache)]
    assert len(mamba) == m.backbone.model.args.hybrid_override_pattern.count("M") > 0 and attention
    for r, (p, f, k) in enumerate(zip(prompts, fed, keep)):
        ref = m.backbone.make_cache()  # the library's own caches and its stock forward, the row alone
        m.backbone(mx.array([p]), cache=ref)
        m.backbone(mx.array([f[:k]]), cache=ref)
        ref_mamba = [c for c in ref if isinstance(c, ArraysCache)]
        for c, want in zip(mamba, ref_mamba):
            # the same inputs and the same scan: measured bit for bit on the CPU (states ~1e-2)
            assert mx.array_equal(c[0][r], want[0][0]).item()
            np.testing.assert_allclose(np.array(c[1][r]), np.array(want[1][0]), atol=1e-7, rtol=0)
        assert all(c.lengths[r] == len(p) + k for c in attention)


@pytest.mark.parametrize("depth", [1, 2])
def test_batched_rows_match_plain_batched_and_solo(model, prompts, depth):
    m = model
    join_at = [0, 0, 1, 3]
    mtp = mixed_streams(prompts, B)
    engine = run_batch(m, mtp, depth, "mtp", join_at=join_at, policy=Alternate())
    assert_not_degenerate(engine)
    plain = mixed_streams(prompts, B)
    plain_engine = run_batch(m, plain, depth, "plain", join_at=join_at)
    assert not any(rec.drafted for rec in plain_engine.log)
    for a, b in zip(mtp, plain):
        assert a.out == b.out
        assert a.out == plain_generate(m, a.prompt, len(a.out))[0]
