"""Batched MTP decoding (runtime/decoding/batched.py): mixed drafting and plain rows in one step.

Every greedy row must decode what the same engine decodes with drafting off for the whole batch
(same streams, same joins), and what the row decodes alone except at logged near-ties. Each test
first checks it is not degenerate: rows accepted different numbers of drafts in one step, a row
ran plain while others drafted, rows joined and left between steps.
"""

import statistics
from typing import List

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_logits_processors

from tests.checkpoints import convert_folder
from mtpconvert.fixture.text import heldout_prompts, text_fixture_path
from mtpconvert.runtime.smoke.decode import divergence
from mtpconvert.runtime.decoding import batched, calibration, draft_policy
from mtpconvert.runtime.decoding.batched import Stream, run_batch
from mtpconvert.runtime.decoding.load import load
from mtpconvert.runtime.decoding.rowcache import RowKVCache
from mtpconvert.runtime.decoding.sampling import Sampling
from mtpconvert.runtime.decoding.speculative import plain_generate
from mtpconvert.runtime.measure.baseline import mlx_lm_generate
from tests.test_runtime import chi2_critical, chi2_stat

TOKENS = 20
NEAR_TIE = 0.05  # top-2 logit margin (bf16 model) below which a different argmax is kernel rounding


def near_tie(d) -> bool:
    """A parting within kernel rounding; a decode that stopped early (no margin) is never one."""
    return d.margin is not None and d.margin < NEAR_TIE


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    out = tmp_path_factory.mktemp("batched") / "dense"
    convert_folder(text_fixture_path("dense"), out, dtype="bfloat16")
    _, prompts, _ = heldout_prompts(text_fixture_path("dense"), per_file=1, prompt_tokens=24, files=8)
    return load(out), prompts


@pytest.fixture(scope="module")
def solo(dense):
    m, prompts = dense
    return [plain_generate(m, p, TOKENS)[0] for p in prompts]


def mixed_streams(prompts, B):
    """B greedy streams, lengths staggered so rows leave at different steps; every third one starts
    plain (``Alternate`` flips it every step)."""
    return [Stream(list(prompts[i]), TOKENS - 2 * (i % 3), draft=i % 3 != 1, seed=i) for i in range(B)]


class Alternate:
    """Between steps, rows with seed % 3 == 1 switch between plain and drafting."""

    def observe(self, engine, record):
        for s in engine.streams:
            if s.seed % 3 == 1:
                s.draft = not s.draft


def assert_not_degenerate(engine):
    drafted = [rec for rec in engine.log if rec.drafted]
    assert any(len({a for a in rec.accepted if a >= 0}) > 1 for rec in drafted), "no step with different accepts"
    assert any(-1 in rec.accepted and max(rec.accepted) >= 0 for rec in drafted), "no plain row beside drafting rows"
    sizes = {len(rec.streams) for rec in engine.log}
    assert len(sizes) > 1, "the batch never changed: no row joined or left between steps"


def assert_batched_rows_equal_solo(m, prompts: List[List[int]], monkeypatch) -> None:
    """Rows of ``prompts`` (6: different lengths) joining two per step and leaving, plain and drafting rows in one
    step, depth 1 and 2: every greedy row's tokens equal the plain batched engine's and its solo plain greedy decode.
    Each row's draft is replaced, at 70% of its positions, by the token its solo decode emits there (the head still
    runs, so its cache is what it always is): rows then keep different numbers of drafts in one step."""
    import random

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


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("B", [2, 4, 8])
def test_greedy_rows_match_plain_batched_and_solo(dense, solo, B, depth):
    m, prompts = dense
    join_at = [i // 2 for i in range(B)]  # two rows join before each of the first steps
    mtp = mixed_streams(prompts, B)
    engine = run_batch(m, mtp, depth, "mtp", join_at=join_at, policy=Alternate())
    assert_not_degenerate(engine)
    plain = mixed_streams(prompts, B)
    plain_engine = run_batch(m, plain, depth, "plain", join_at=join_at)
    assert not any(rec.drafted for rec in plain_engine.log)
    for i, (a, b) in enumerate(zip(mtp, plain)):
        assert a.out == b.out, (i, divergence(m, i, a.prompt, b.out, a.out))
        d = divergence(m, i, a.prompt, solo[i][: len(a.out)], a.out)
        if d is not None:  # logged, and allowed only at a near-tie of the solo decode
            print(f"row {i} (B={B}, k={depth}) differs from solo: {d.to_json()}")
            assert near_tie(d), d.to_json()


def test_moe_rows_match_plain_batched_and_solo(tmp_path):
    """The MoE text fixture (float32 experts: mlx's CPU gather_mm), B = 4, k = 2."""
    out = tmp_path / "moe"
    convert_folder(text_fixture_path("moe"), out, dtype="float32")
    m = load(out)
    _, prompts, _ = heldout_prompts(text_fixture_path("moe"), per_file=1, prompt_tokens=24, files=4)
    join_at = [0, 0, 1, 1]
    mtp = mixed_streams(prompts, 4)
    engine = run_batch(m, mtp, 2, "mtp", join_at=join_at, policy=Alternate())
    assert_not_degenerate(engine)
    plain = mixed_streams(prompts, 4)
    run_batch(m, plain, 2, "plain", join_at=join_at)
    for i, (a, b) in enumerate(zip(mtp, plain)):
        assert a.out == b.out, (i, divergence(m, i, a.prompt, b.out, a.out))
        reference = plain_generate(m, a.prompt, len(a.out))[0]
        d = divergence(m, i, a.prompt, reference, a.out)
        if d is not None:
            print(f"moe row {i} differs from solo: {d.to_json()}")
            assert near_tie(d), d.to_json()


def test_plain_rows_read_pending_pairs_in_later_drafts(dense, solo):
    """A row that runs plain for some steps and then drafts: its head catches up on the pending pairs
    (acceptance as high as a row that drafted throughout is not required, exactness is)."""
    m, prompts = dense
    streams = [Stream(list(p), TOKENS, seed=i) for i, p in enumerate(prompts[:3])]
    engine = batched.BatchedMTP(m, depth=2)
    for i, s in enumerate(streams):
        engine.add(s, i)
    for n in range(40):
        if not engine.streams:
            break
        engine.step(draft=n % 3 == 2)  # two plain steps, then one drafting step
        engine.drop_finished()
    assert any(rec.drafted and max(rec.accepted) > 0 for rec in engine.log)
    for i, s in enumerate(streams):
        assert s.out == solo[i], divergence(m, i, s.prompt, solo[i], s.out)


def test_long_catch_up_runs_in_fixed_width_passes(dense):
    """Rows that ran plain for 40+ steps (pending pairs of different counts, up to 3 passes of
    CATCH_UP) then draft: each row's head cache ends at its backbone length, drafts are accepted,
    and every row still decodes its solo tokens."""
    m, prompts = dense
    n = 60
    streams = [Stream(list(prompts[i]), n, seed=i) for i in range(3)]
    engine = batched.BatchedMTP(m, depth=2)
    engine.add_many(streams[:2], [0, 1])
    for step in range(44):
        if step == 6:
            engine.add(streams[2], 2)  # joins late: fewer pending pairs than the others
        engine.step(draft=False)
    counts = [len(s.pend_t) for s in engine.streams]
    assert max(counts) > 2 * batched.CATCH_UP and len(set(counts)) > 1
    assert batched.head_passes(max(counts), 2) == (3, batched.CATCH_UP)
    fa = m.backbone.text.model.fa_idx
    while engine.streams:
        engine.step(draft=True)
        pending = [len(s.pend_t) for s in engine.streams]  # the head has read every pair but these
        assert engine.head_cache[0].lengths == [L - p for L, p in zip(engine.cache[fa].lengths, pending)]
        engine.drop_finished()
    assert sum(a for rec in engine.log if rec.drafted for a in rec.accepted) > 10
    for i, s in enumerate(streams):
        assert s.out == plain_generate(m, s.prompt, n)[0], i


def test_padded_prefill_leaves_each_row_as_its_own_prefill(tmp_path):
    """Prompts of three lengths prefilled in one padded pass (float32): every row's first token, attention
    keys and linear-attention conv window and state equal those of the row prefilled alone."""
    out = tmp_path / "dense32"
    convert_folder(text_fixture_path("dense"), out, dtype="float32")
    m = load(out)
    _, prompts, _ = heldout_prompts(text_fixture_path("dense"), per_file=1, prompt_tokens=24, files=8)
    chosen = sorted({len(p): p for p in prompts}.values(), key=len)[:3]
    assert len({len(p) for p in chosen}) == 3
    together = batched.BatchedMTP(m, depth=1)
    together.add_many([Stream(list(p), 4) for p in chosen], [0, 1, 2])
    for r, p in enumerate(chosen):
        alone = batched.BatchedMTP(m, depth=1)
        alone.add(Stream(list(p), 4), 0)
        assert together.streams[r].out == alone.streams[0].out, r
        for mine, ref in zip(together.cache, alone.cache):
            if isinstance(mine, RowKVCache):
                n = len(p)
                assert mine.lengths[r] == ref.lengths[0] == n
                np.testing.assert_allclose(np.array(mine.keys[r, :, :n]), np.array(ref.keys[0, :, :n]),
                                           rtol=1e-5, atol=1e-5)
            else:  # the linear-attention layers: conv window, then recurrent state, of the row's last prompt token
                for x, y in zip((mine[0], mine[1]), (ref[0], ref[1])):
                    np.testing.assert_allclose(np.array(x[r]), np.array(y[0]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("depth", [1, 2])
def test_warm_up_visits_every_pass_shape(dense, depth):
    """``warm_up`` runs, per batch size 1 .. rows, a catch-up (head passes of CATCH_UP), a normal
    drafting step (head pass of depth + 1), and a pipelined plain step: every shape a decode meets."""
    m, _ = dense
    log = calibration.warm_up(m, depth, 3)
    for B in (1, 2, 3):
        steps = [r for r in log if len(r.streams) == B]
        assert any(r.drafted and r.head_width > batched.CATCH_UP for r in steps)  # 2 catch-up passes
        assert any(r.drafted and r.head_width <= depth + 1 for r in steps)
        assert any(r.drafted and depth + 1 < r.head_width <= batched.CATCH_UP for r in steps)  # after plain steps
        assert any(not r.drafted and r.built_next for r in steps)
    # a row leaves while a plain step is built ahead: the rows left step plain from it, then draft
    left = [i for i, (a, b) in enumerate(zip(log, log[1:])) if len(b.streams) == len(a.streams) - 1]
    assert len(left) == 2 and all(log[i].built_next and log[i + 1].built_before and log[i + 2].drafted for i in left)


def test_warm_up_reaches_every_attention_window_of_the_context(dense):
    """Past the first attention window a catch-up's head passes read a wider key window: ``warm_up`` with a
    context of 300 keys also catches up over a prompt past 256 keys, so its last passes read 512."""
    m, _ = dense
    assert calibration.warm_prompts(0) == calibration.warm_prompts(256) == [batched.CATCH_UP + 1]
    assert calibration.warm_prompts(300) == [batched.CATCH_UP + 1, 257]
    assert calibration.warm_prompts(700) == [batched.CATCH_UP + 1, 257, 513]
    log = calibration.warm_up(m, 1, 1, context=300)
    assert max(r.head_width for r in log) > 256
    assert any(not r.drafted and r.built_next for r in log[len(calibration.WARM_STEPS):])


def _unpipelined(m, streams, depth=1):
    """The plain batched engine stepping one graph at a time (no step built ahead)."""
    engine = batched.BatchedMTP(m, depth)
    engine.add_many(streams, list(range(len(streams))))
    while engine.streams:
        engine.step(draft=False)
        engine.drop_finished()
    return engine


def test_pipelined_plain_steps_equal_unpipelined(dense, solo):
    """run_batch's plain engine builds each step from the last one's lazy tokens before reading them
    (as mlx-lm's BatchGenerator does). Greedy rows (one stopped by an EOS mid-run, others of different
    lengths, so rows leave while a step is built ahead) decode their solo tokens; sampled rows under a
    repetition penalty decode what the same rows decode one graph at a time, which they would not if a
    step built ahead drew at the wrong position or missed the pending token in its history."""
    m, prompts = dense
    eos = solo[2][7]
    procs = lambda: make_logits_processors(repetition_penalty=1.6, repetition_context_size=6)  # noqa: E731

    def streams():
        return ([Stream(list(prompts[i]), TOKENS - 3 * i, seed=i, eos=[eos] if i == 2 else []) for i in range(4)]
                + [Stream(list(prompts[i]), TOKENS, sampling=Sampling(1.0, top_k=8), seed=10 + i,
                          processors=procs() if i % 2 else ()) for i in range(4, 7)])

    piped = streams()
    engine = run_batch(m, piped, 1, "plain")
    assert sum(r.built_before for r in engine.log) > len(engine.log) // 2  # it did pipeline
    assert len({len(r.streams) for r in engine.log}) > 2  # rows left while steps were built ahead
    alone = streams()
    _unpipelined(m, alone)
    for i, (a, b) in enumerate(zip(piped, alone)):
        assert a.out == b.out, i
        if i < 4:
            expect = solo[i][: solo[i].index(eos) + 1] if i == 2 else solo[i][: TOKENS - 3 * i]
            assert a.out == expect, i
    assert piped[2].out[-1] == eos and len(piped[2].out) < TOKENS - 6


def test_auto_mode_pipelines_plain_stretches(dense, solo):
    """In auto mode a plain step whose successor the policy also runs plain is built ahead; drafting
    steps and steps before a join are not. Greedy rows still decode their solo tokens."""
    m, prompts = dense

    class Every4th(draft_policy.DraftPolicy):  # drafts every 4th decision
        n = 0

        def choose(self, engine):
            self.n += 1
            return self.n % 4 == 0

    streams = [Stream(list(p), TOKENS, seed=i) for i, p in enumerate(prompts[:4])]
    engine = run_batch(m, streams, 2, "auto", join_at=[0, 0, 5, 5], policy=Every4th())
    for s, ref in zip(streams, solo):
        assert s.out == ref
    log = engine.log
    assert any(r.built_next for r in log) and any(r.drafted for r in log)
    for prev, rec in zip(log, log[1:]):
        assert rec.built_before == prev.built_next
        assert not (prev.built_next and rec.drafted)
        if len(rec.streams) > len(prev.streams):  # rows joined: nothing was built ahead of them
            assert not rec.built_before
    steady = [r for r in log if not r.drafted and r.steady]
    assert steady and all(r.seconds > 0 for r in steady)


def test_row_kv_cache_masks_per_row():
    """Rows at lengths 2 and 4 after per-row trims: each query sees exactly its row's keys. A pass of
    several tokens reads a window padded to the buffer step (its shapes change once per step tokens:
    MLX CUDA builds a cuDNN graph per attention shape); a one-token pass reads max length + 1."""
    c = RowKVCache([0, 0])
    kv = mx.arange(2 * 1 * 5 * 1, dtype=mx.float32).reshape(2, 1, 5, 1)
    keys, _ = c.update_and_fetch(kv, kv)
    assert keys.shape == (2, 1, RowKVCache.step, 1)
    c.trim_rows([3, 1])
    assert c.lengths == [2, 4] and c.offset.tolist() == [2, 4]
    mask = c.make_mask(2)  # [2, 1, 2, step]
    assert mask.shape == (2, 1, 2, RowKVCache.step) and not mask[..., 6:].any().item()
    assert mask[0, 0, :, :6].tolist() == [[True] * 3 + [False] * 3, [True] * 4 + [False] * 2]
    assert mask[1, 0, :, :6].tolist() == [[True] * 5 + [False], [True] * 6]
    assert c.make_mask(1).shape == (2, 1, 1, 5) and RowKVCache([3, 3]).make_mask(1) is None
    new = mx.full((2, 1, 2, 1), -1.0)
    keys, _ = c.update_and_fetch(new, new)
    assert keys.shape[2] == RowKVCache.step
    assert keys[0, 0, :4, 0].tolist() == [0, 1, -1, -1] and keys[1, 0, :6, 0].tolist() == [5, 6, 7, 8, -1, -1]
    assert c.update_and_fetch(new[:, :, :1], new[:, :, :1])[0].shape[2] == 7
    with pytest.raises(ValueError, match="cannot trim"):
        c.trim_rows([6, 0])


def test_row_kv_cache_window_doubles():
    """The padded window of a multi-token pass is ``step`` times the power of two that reaches its end,
    and the buffer grows to hold it: the passes of a whole decode meet log2(context / step) + 1 shapes."""
    c = RowKVCache([0])
    c.step = 8
    x = mx.zeros((1, 1, 3, 1))
    shapes = []
    for _ in range(9):  # ends 3, 6, ..., 27
        assert c.make_mask(3).shape[-1] == c.window(c.lengths[0] + 3)
        shapes.append(c.update_and_fetch(x, x)[0].shape[2])
    assert shapes == [8, 8, 16, 16, 16, 32, 32, 32, 32] and c.keys.shape[2] == 32


# ---------------------------------------------------------------- logits processors


def _penalised(prompts, B):
    procs = lambda: make_logits_processors(repetition_penalty=1.6, repetition_context_size=6)  # noqa: E731
    return [Stream(list(prompts[i]), TOKENS, draft=i != 1, seed=i, processors=procs()) for i in range(B)]


@pytest.mark.parametrize("double_count", [False, True], ids=["per-row-history", "confirmed-token-twice"])
def test_repetition_penalty_sees_each_rows_true_history(dense, monkeypatch, double_count):
    """Greedy rows under a repetition penalty decode what mlx-lm's generate_step decodes with the same
    processor. The same check with the confirmed token counted twice (the published bug) must fail:
    the check can catch it."""
    m, prompts = dense
    if double_count:
        monkeypatch.setattr(Stream, "history", lambda s: s.prompt + s.out + s.out[-1:])
    B = 4
    streams = _penalised(prompts, B)
    engine = run_batch(m, streams, 2, "mtp")
    assert any(max(rec.accepted) > 0 and -1 in rec.accepted for rec in engine.log)
    mismatches = []
    for s in streams:
        procs = make_logits_processors(repetition_penalty=1.6, repetition_context_size=6)
        reference, _ = mlx_lm_generate(m, s.prompt, TOKENS, logits_processors=procs)
        d = divergence(m, 0, s.prompt, reference, s.out, procs)
        if d is not None:
            mismatches.append(d)
    if double_count:
        assert any(not near_tie(d) for d in mismatches), "double counting went unnoticed"
    else:
        assert all(near_tie(d) for d in mismatches), [d.to_json() for d in mismatches]
        penalised_differs = [s.out != p for s, p in zip(streams, solo_plain(m, prompts, B))]
        assert any(penalised_differs), "the penalty changed nothing: the test would prove nothing"


def solo_plain(m, prompts, B):
    return [plain_generate(m, p, TOKENS)[0] for p in prompts[:B]]


# ---------------------------------------------------------------- sampled rows


def second_token_marginal(m, prompt, s: Sampling) -> np.ndarray:
    first = s.probs(m.model(mx.array([prompt]))[0, -1])
    support = [int(t) for t in np.nonzero(np.array(first))[0]]
    second = s.probs(m.model(mx.array([prompt + [t] for t in support]))[:, -1])
    marginal = np.array((first[mx.array(support)][:, None] * second).sum(axis=0))
    return marginal / marginal.sum()


@pytest.mark.slow  # ~40 s: a sampling distribution over many rows (make test-all)
def test_sampled_rows_keep_their_distribution_beside_greedy_and_plain_rows(dense):
    """Per row setting: the second token (the first a draft can supply) of batched decodes follows the
    exact marginal, for two sampled drafting settings, one sampled plain row and a greedy row side by
    side. Each round is one batch of 4 x 16 rows (every row its own seed, so its own trial)."""
    m, prompts = dense
    settings = [Sampling(1.5, top_k=4), Sampling(0.0), Sampling(1.0, top_k=3), Sampling(1.2, top_k=4)]
    drafts = [True, True, True, False]
    short = [list(prompts[i][:8]) for i in range(len(settings))]  # one prompt length: one prefill pass
    marginals = [None if s.greedy else second_token_marginal(m, short[i], s) for i, s in enumerate(settings)]
    counts = [np.zeros(len(x) if x is not None else 1, dtype=np.int64) for x in marginals]
    rejected = [0] * len(settings)
    greedy_seen = set()
    per_round, rounds = 16, 20
    for t in range(rounds):
        streams = [Stream(short[i], 2, sampling=s, draft=drafts[i], seed=1000 * t + 10 * j + i)
                   for j in range(per_round) for i, s in enumerate(settings)]
        engine = run_batch(m, streams, 1, "mtp")
        assert len(engine.log) == 1 and len(engine.log[0].streams) == len(streams)
        for n, st in enumerate(streams):
            i = n % len(settings)
            if marginals[i] is None:
                greedy_seen.add(tuple(st.out))
            else:
                counts[i][st.out[1]] += 1
            rejected[i] += st.stats.proposed[0] - st.stats.accepted[0]
    assert len(greedy_seen) == 1, "the greedy row changed with its neighbours' draws"
    for i, marginal in enumerate(marginals):
        if marginal is None:
            continue
        if drafts[i]:
            assert rejected[i] > 40, f"setting {i}: the test must exercise rejections"
        stat, df = chi2_stat(counts[i], marginal)
        assert stat < chi2_critical(df), (i, stat, df)


def test_draws_depend_only_on_row_and_position(dense):
    """A sampled row decodes the same tokens alone and in a batch, joining early or late."""
    m, prompts = dense
    s = Sampling(1.0, top_k=8)
    alone = [Stream(list(prompts[0]), TOKENS, sampling=s, seed=7)]
    run_batch(m, alone, 2, "mtp")
    others = [Stream(list(p), TOKENS, seed=i) for i, p in enumerate(prompts[1:4])]
    mixed = others + [Stream(list(prompts[0]), TOKENS, sampling=s, seed=7)]
    run_batch(m, mixed, 2, "mtp", join_at=[0, 0, 0, 3])
    assert mixed[-1].out == alone[0].out


# ---------------------------------------------------------------- bench --concurrency


def test_bench_concurrency_json_and_bad_input(tmp_path):
    """`bench --concurrency` carries per-level rows for every decoder in --json; bad levels exit 2
    with a message and no traceback."""
    from typer.testing import CliRunner

    from mtpconvert.cli import app
    from mtpconvert.fixture import fixture_path

    out = tmp_path / "tiny"
    convert_folder(fixture_path("dense"), out, dtype="bfloat16")
    runner = CliRunner()
    result = runner.invoke(app, ["bench", str(out), "--concurrency", "1,2", "--max-tokens", "6", "--json"])
    assert result.exit_code == 0, result.output
    import json

    report = json.loads(result.stdout)
    assert report["baseline"] == "mlx_lm.generate.BatchGenerator"
    assert [r["concurrency"] for r in report["rows"]] == [1, 2]
    for row in report["rows"]:
        assert set(row["decoders"]) == {"batchgen", "plain", "mtp", "auto"}
        assert row["decoders"]["mtp"]["generated"] == 5 * row["concurrency"]
        assert len(row["decoders"]["mtp"]["acceptance_by_stream"]) == row["concurrency"]
        assert row["greedy_identical_to_plain_engine"] == {"batchgen": True, "mtp": True, "auto": True}
    assert set(report["crossover"]) == {"1"}
    for bad in ("0", "1,x", ","):
        result = runner.invoke(app, ["bench", str(out), "--concurrency", bad])
        assert result.exit_code == 2 and "--concurrency" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("n", [2, 4, 6])
def test_bench_rounds_are_balanced(n):
    """Over n rounds each decoder runs first once and right after every other decoder once (a rotation
    keeps each behind the same one); the paired ratio compares with the fixed choice of best median."""
    from mtpconvert.runtime.measure.batch_bench import paired_ratio, round_order

    orders = [round_order(n, i) for i in range(n)]
    assert all(sorted(o) == list(range(n)) for o in orders)
    assert sorted(o[0] for o in orders) == list(range(n))
    follows = [(a, b) for o in orders for a, b in zip(o, o[1:])]
    assert sorted(follows) == [(a, b) for a in range(n) for b in range(n) if a != b]
    # b has the best median (11 against 10.5): auto is compared with b's runs, not with a's 20 in round 0
    assert paired_ratio([10, 10], {"a": [20, 1], "b": [11, 11]}) == pytest.approx(10 / 11)


def fake_engine(rows: int, depth: int = 1):
    """What ``DraftPolicy`` reads of an engine: its depth and its rows."""
    from types import SimpleNamespace

    return SimpleNamespace(depth=depth, streams=[Stream([1], 10) for _ in range(rows)])


def simulate_policy(policy, draft_seconds, steps, plain_seconds=0.010, catch_up_per_step=0.002, B=4):
    """A policy deciding ``steps`` steps of a fake 4-row batch: each drafting row emits 1.75 tokens; the
    first step of each kind is 20x slower (a kernel compile); a drafting step after n plain steps also
    pays the head's catch-up over them (n * ``catch_up_per_step``; not a step cost, so not timed).
    Returns the choices and, per step, (seconds, tokens)."""
    from mtpconvert.runtime.decoding.batched import StepLog

    engine = fake_engine(B)
    chosen, cost, plain_run = [], [], 0
    for _ in range(steps):
        d = policy.choose(engine)
        seconds = draft_seconds if d else plain_seconds
        if d not in chosen:
            seconds *= 20
        width = 2
        if d and plain_run:
            seconds += plain_run * catch_up_per_step
            width = plain_run + 2
        plain_run = 0 if d else plain_run + 1
        for s in engine.streams:  # the pairs the head reads at the next drafting step
            s.pend_t = [0] * (plain_run + 2)
        chosen.append(d)
        accepted = [1, 0, 1, 1] if d else [-1] * B
        cost.append((seconds, B + (3 if d else 0)))
        policy.observe(engine, StepLog(list(range(B)), accepted, d, seconds, head_width=width if d else 0))
    return chosen, cost


@pytest.mark.parametrize("draft_seconds,expect_drafting", [(0.019, False), (0.012, True)])
def test_draft_policy_follows_measured_rates(draft_seconds, expect_drafting):
    """4 rows, plain step 10 ms, 1.75 tokens per drafting row: a 19 ms drafting step loses (368 vs 400
    tok/s; with every draft kept it would win, 421), a 12 ms one wins (583 vs 400), although the first step of each kind is 20x slower. The
    losing kind is still probed, in runs of 3 steps, and exploring costs at most about the budget:
    the first timings of the loser count as a probe (at its timed cost), so the first probe waits until
    budget x the time on the winner covers them; after them the loser's steps lose (against the winner's
    rate, for the same tokens) no more than budget x the time on the winner plus one probe."""
    from mtpconvert.runtime.decoding.batched import DraftPolicy

    policy = DraftPolicy(budget=0.05)
    chosen, cost = simulate_policy(policy, draft_seconds, 1500, catch_up_per_step=0.0002)
    assert chosen[:6] == [True] * 3 + [False] * 3  # each kind timed 3 times first
    minority = [i for i, d in enumerate(chosen[6:], 6) if d != expect_drafting]
    probes = [minority[i:i + 3] for i in range(0, len(minority), 3)]
    assert len(probes) >= 2 and all(p == list(range(p[0], p[0] + 3)) for p in probes), minority
    rate = max(1.75 * 4 / draft_seconds, 4 / 0.010)
    first_loss = 3 * (draft_seconds - 7 / rate if not expect_drafting else 0.010 - 4 / rate)
    before_first_probe = sum(cost[i][0] for i in range(6, minority[0]))
    assert policy.budget * before_first_probe >= first_loss
    loss = [max(cost[i][0] - cost[i][1] / rate, 0) for i in minority]
    on_winner = sum(cost[i][0] for i in range(6, len(chosen)) if chosen[i] == expect_drafting)
    assert sum(loss) <= policy.budget * on_winner + max(sum(loss[i:i + 3]) for i in range(0, len(loss), 3))


@pytest.mark.parametrize("draft_seconds,expect_drafting", [(0.05, False), (0.012, True)])
def test_draft_policy_keeps_its_choice_when_rows_leave(draft_seconds, expect_drafting):
    """Timed at 4 rows, the policy goes on with the winner at 3, 2 and 1 rows (rows leaving one by one at a
    batch's end) without timing the loser there: its cost is estimated through the kinds' ratio at 4 rows.
    (Budgeted probes are spaced out of this test's reach.)"""
    from mtpconvert.runtime.decoding.batched import DraftPolicy, StepLog

    policy = DraftPolicy(budget=0.05, min_interval=10 ** 6)
    simulate_policy(policy, draft_seconds, 40)
    for B in (3, 2, 1):
        engine = fake_engine(B)
        for _ in range(10):
            d = policy.choose(engine)
            assert d == expect_drafting, B
            policy.observe(engine, StepLog(list(range(B)), [1] * B if d else [-1] * B, d,
                                           (draft_seconds if d else 0.010) * B / 4, head_width=2 if d else 0))
        assert policy.seconds(B, not expect_drafting) is None  # the loser was never run at B


def test_draft_policy_does_not_take_a_slowdown_of_the_machine_for_the_kind_it_runs():
    """Plain wins (10 ms against a 19 ms drafting step at 1.75 tokens a row: 400 against 368 tok/s). Then the
    machine slows by 1.5x for 8 steps: the plain steps' cost rises to 15 ms, which against the drafting step as
    timed before would make drafting win (368 against 267 tok/s); the drafting step is taken to be slower by as
    much, so the policy stays plain. When the machine recovers, so do both costs."""
    from mtpconvert.runtime.decoding.batched import DraftPolicy, StepLog

    policy = DraftPolicy(budget=0.05, min_interval=10 ** 6)  # no budgeted probe within the test
    simulate_policy(policy, 0.019, 30)
    engine = fake_engine(4)
    for speed in [1.0] * 10 + [1.5] * 8 + [1.0] * 10:
        assert policy.choose(engine) is False, speed
        policy.observe(engine, StepLog(list(range(4)), [-1] * 4, False, 0.010 * speed, built_before=True,
                                       built_next=True))
        draft, plain = policy.costs(4)
        assert draft / plain == pytest.approx(1.9, rel=0.01)


def _noisy_runs(t_plain: float, t_draft: float, runs: int = 100, rows: int = 4, tokens: int = 47) -> list:
    """Share of drafted steps in each timed run of a policy warmed by one untimed run, as the bench does it:
    constant step costs, each row's draft kept with probability 0.8 (the oracle bench's P), a drafting
    step after a plain stretch paying the head's catch-up over it."""
    import random

    from mtpconvert.runtime.decoding.batched import DraftPolicy, StepLog

    engine = fake_engine(rows)
    def decode(policy, rng):
        chosen, emitted, plain_run, previous_plain = [], 0, 0, False
        while emitted < tokens * rows:
            first = not chosen
            if policy.choose(engine):
                kept = [int(rng.random() < 0.8) for _ in range(rows)]
                record = StepLog(list(range(rows)), kept, True, t_draft + 0.004 * plain_run,
                                 head_width=40 if first else plain_run + 2, after_join=first)
                emitted, plain_run, previous_plain = emitted + rows + sum(kept), 0, False
            else:
                record = StepLog(list(range(rows)), [-1] * rows, False, t_plain, after_join=first,
                                 built_before=previous_plain, built_next=True)
                emitted, plain_run, previous_plain = emitted + rows, plain_run + 1, True
            policy.observe(engine, record)
            chosen.append(record.drafted)
        return sum(chosen) / len(chosen)

    rng, shares = random.Random(0), []
    for _ in range(runs):
        policy = DraftPolicy()
        decode(policy, rng)
        shares.append(decode(policy, rng))
    return shares


def test_draft_policy_sees_a_small_drafting_edge_through_acceptance_noise():
    """At model scale on a GPU drafting pays by 5-10% (27B-shaped, H200: 4 rows, plain 63 ms, drafting
    107 ms, acceptance 0.8: 6% ahead). Estimated from a few rows' single steps, the acceptance is too noisy
    to see that; over the last 64 drafting row-steps most short runs draft. At a 6% deficit none does."""
    ahead = _noisy_runs(0.063, 0.107)
    assert sum(share > 0.5 for share in ahead) >= 70, sorted(ahead)
    behind = _noisy_runs(0.063, 0.063 * 1.8 / 0.94)
    assert not any(share > 0.5 for share in behind), sorted(behind)


def test_draft_policy_charges_the_way_back_from_a_probe_to_the_budget():
    """Drafting wins (12 ms steps against 10 ms plain, 1.75 tokens per row); after a plain probe the
    first drafting step catches the head up over the probe's steps (4 ms each). That step's extra over
    a drafting step is part of what the probe cost, so probe steps and catch-ups together stay within
    budget x the time on the winner, plus one probe with its catch-up."""
    from mtpconvert.runtime.decoding.batched import DraftPolicy

    policy = DraftPolicy(budget=0.03)
    chosen, cost = simulate_policy(policy, 0.012, 4000, catch_up_per_step=0.004)
    rate = 1.75 * 4 / 0.012
    probes, loss, on_winner = [], 0.0, 0.0
    for i in range(7, len(chosen)):
        if not chosen[i]:  # a probe step: what it lost against drafting for its tokens
            if chosen[i - 1]:
                probes.append(0.0)
            probes[-1] += cost[i][0] - cost[i][1] / rate
        elif not chosen[i - 1]:  # the way back: the catch-up's extra over a drafting step
            probes[-1] += cost[i][0] - 0.012
            on_winner += 0.012
        else:
            on_winner += cost[i][0]
    assert len(probes) >= 3
    assert sum(probes) <= policy.budget * on_winner + max(probes), (sum(probes), policy.budget * on_winner)


def test_draft_policy_charges_a_switch_but_not_a_join():
    """The first drafting step after a plain one costs the budget its extra over a drafting step; the
    same step after rows joined reads their prompts, which no choice of kind would have avoided."""
    from mtpconvert.runtime.decoding.batched import DraftPolicy, StepLog

    engine = fake_engine(4)
    for after_join, charged in ((False, 0.038), (True, 0.0)):
        policy = DraftPolicy()
        for _ in range(3):
            policy.observe(engine, StepLog(list(range(4)), [1, 1, 1, 0], True, 0.012, head_width=2))
            policy.observe(engine, StepLog(list(range(4)), [-1] * 4, False, 0.010))
        before = policy.probe_loss
        policy.observe(engine, StepLog(list(range(4)), [1, 1, 1, 0], True, 0.050, head_width=40, after_join=after_join))
        assert policy.probe_loss - before == pytest.approx(charged)


def _probe_losses(chosen, cost, rate):
    """Per probe after the first timings (a run of the loser, drafting here): what its steps lost against
    plain for their tokens, catch-up included; and the seconds spent on plain."""
    probes, on_plain = [], 0.0
    for i in range(6, len(chosen)):
        if chosen[i]:
            if not chosen[i - 1]:
                probes.append(0.0)
            probes[-1] += cost[i][0] - cost[i][1] / rate
        else:
            on_plain += cost[i][0]
    return probes, on_plain


@pytest.mark.parametrize("catch_up_per_step", [0.0001, 0.0008])
def test_draft_policy_predicts_a_probes_catch_up(catch_up_per_step):
    """Plain wins (19 ms drafting steps, 10 ms plain). A drafting probe pays the head's catch-up over the
    plain stretch before it, which grows with the stretch: the policy predicts it from the catch-ups it
    measured. At 1% of a plain step per pair (under the 3% budget) probes go on and, the first aside,
    lose no more than budget x the time on plain; at 8% no stretch pays for its own catch-up and no
    drafting probe follows the first (charging only the last probe's loss, the intervals grew 2.7x a
    probe and each probe lost 8% of the stretch before it)."""
    from mtpconvert.runtime.decoding.batched import DraftPolicy

    policy = DraftPolicy(budget=0.03)
    chosen, cost = simulate_policy(policy, 0.019, 8000, catch_up_per_step=catch_up_per_step)
    probes, on_plain = _probe_losses(chosen, cost, 4 / 0.010)
    assert policy.catch_up and statistics.median(policy.catch_up) == pytest.approx(catch_up_per_step / 0.010, rel=0.05)
    if catch_up_per_step < policy.budget * 0.010:
        assert len(probes) >= 5, probes
        assert sum(probes[1:]) <= policy.budget * on_plain, (probes, on_plain)
    else:
        assert len(probes) == 1, probes


def test_draft_policy_does_not_probe_drafting_that_cannot_win():
    """A 50 ms drafting step against 10 ms plain at 4 rows loses even with every draft kept (160 vs 400
    tok/s at depth 1): after the first timings no drafting probe is spent on it, however cheap."""
    from mtpconvert.runtime.decoding.batched import DraftPolicy

    chosen, _ = simulate_policy(DraftPolicy(budget=0.03), 0.05, 3000, catch_up_per_step=0.0)
    assert chosen[:6] == [True] * 3 + [False] * 3 and not any(chosen[6:])
    chosen, _ = simulate_policy(DraftPolicy(budget=0.03), 0.019, 3000, catch_up_per_step=0.0)
    assert any(chosen[6:])  # 19 ms could win with every draft kept (421 tok/s): probed


def test_draft_policy_learns_the_catch_up_per_pair_from_long_catch_ups_only():
    """A catch-up over a few pairs (the way back from a 3-step plain probe) is mostly the head pass's fixed
    cost (on the H200 0.1-0.4 plain steps a pair, against 0.02 over 47 pairs): taken per pair it would
    stop every later drafting probe. Only catch-ups over at least ``min_interval`` pairs are learnt from,
    a joined row's prompt among them; the next probe is charged for every pair the rows have pending."""
    from mtpconvert.runtime.decoding.batched import DraftPolicy, StepLog

    engine = fake_engine(4)
    policy = DraftPolicy()
    for _ in range(3):
        policy.observe(engine, StepLog(list(range(4)), [1, 1, 1, 0], True, 0.012, head_width=2))
        policy.observe(engine, StepLog(list(range(4)), [-1] * 4, False, 0.010))
    policy.observe(engine, StepLog(list(range(4)), [1, 1, 1, 0], True, 0.016, head_width=5))
    assert not policy.catch_up
    policy.observe(engine, StepLog(list(range(4)), [1, 1, 1, 0], True, 0.022, head_width=52, after_join=True))
    assert list(policy.catch_up) == [pytest.approx(0.01 / 50 / 0.010)]
    for s in engine.streams:  # a row joined with a 40-token prompt: the next drafting step reads it all
        s.pend_t = [0] * 40
    expected = policy.probe_loss - policy.probe_catch_up + 0.02 * 0.010 * 38
    assert policy.next_probe_loss(engine, False, policy.costs(4)) == pytest.approx(expected)


def test_draft_policy_costs_a_kind_by_its_median_step():
    """Drafting steps that alternate 3 and 5 ms cost 4 ms a step: at 1.75 tokens per row that is 1,750
    tok/s against 2,000 for 2 ms plain steps, so plain wins; costed by its fastest step (3 ms) drafting
    would look faster (2,333 tok/s)."""
    from mtpconvert.runtime.decoding.batched import DraftPolicy, StepLog

    engine = fake_engine(4)
    policy = DraftPolicy()
    for t in (0.003, 0.005) * 4:
        policy.observe(engine, StepLog(list(range(4)), [1, 1, 1, 0], True, t, head_width=2))
    for _ in range(3):
        policy.observe(engine, StepLog(list(range(4)), [-1] * 4, False, 0.002))
    assert policy.seconds(4, True) == pytest.approx(0.004)
    draft_rate, plain_rate = policy.predicted_rates(4, 4)
    assert draft_rate == pytest.approx(1750) and plain_rate == pytest.approx(2000)
    assert sum(policy.choose(engine) for _ in range(40)) <= 3  # a probe at most


def test_draft_policy_does_not_time_a_catch_up_step():
    """The first drafting step after plain steps reads the whole plain stretch: slow, and not a step cost."""
    from mtpconvert.runtime.decoding.batched import DraftPolicy, StepLog

    engine = fake_engine(2, depth=2)
    policy = DraftPolicy()
    policy.observe(engine, StepLog([0, 1], [0, 1], True, 0.5, head_width=40))
    assert policy.timed.get((2, True)) is None
    policy.observe(engine, StepLog([0, 1], [0, 1], True, 0.01, head_width=3))
    assert list(policy.timed[(2, True)]) == [0.01]
