"""The draft/verify loop: rollback is exact, greedy output equals plain greedy, sampling keeps the distribution."""

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from tests.checkpoints import convert_folder, without_shift
from mtpconvert.demo import fixture_prompts
from mtpconvert.fixture import fixture_path
from mtpconvert.runtime.smoke.decode import encode_prompts
from mtpconvert.runtime.decoding.load import load
from mtpconvert.runtime.decoding.rollback import rollback
from mtpconvert.runtime.decoding.sampling import Sampling, accept_drafts
from mtpconvert.runtime.decoding.speculative import mtp_generate, plain_generate


def _convert(out, mtp_shift=True, **quant):
    # without the head's shift: a broken head that still runs, so rollback is exercised
    edit = None if mtp_shift else without_shift("mtp.")
    convert_folder(fixture_path("dense"), out, edit=edit, dtype="bfloat16", **quant)
    return out


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    out = _convert(tmp_path_factory.mktemp("rt") / "good", bits=4, group_size=32)
    return out, load(out)


@pytest.fixture(scope="module")
def weak(tmp_path_factory):
    out = _convert(tmp_path_factory.mktemp("rt") / "weak", mtp_shift=False)
    return out, load(out)


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper chi-square quantile (alpha ~ 1e-3 for z = 3.09), Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_stat(counts: np.ndarray, probs: np.ndarray) -> tuple:
    n = counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, "emitted a token the target gives probability 0"
    expected = n * probs[support]
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum() - 1)


# ---------------------------------------------------------------- rollback


def test_rollback_restores_the_exact_state_after_each_kept_prefix(good):
    path, m = good
    m.backbone.enable_rollback()
    ids = encode_prompts(path, fixture_prompts(1))[0]
    extra = [5, 17, 42]
    for keep in (1, 2, 3):
        cache = m.backbone.rollback_cache(max_pass=16)
        m.backbone.forward(mx.array([ids]), cache)
        m.backbone.forward(mx.array([extra]), cache)
        rollback(cache, keep=keep, length=3)
        ref = m.model.make_cache()  # stock caches, fed only the kept tokens
        m.model(mx.array([ids + extra[:keep]]), cache=ref)
        for c, r in zip(cache, ref):
            if isinstance(r, KVCache):
                assert c.offset == r.offset
                n = r.offset  # trimmed caches keep stale rows past offset, unused
                for a, b in zip((c.keys, c.values), (r.keys, r.values)):
                    assert mx.abs(a[..., :n, :] - b[..., :n, :]).max().item() < 0.05
            else:
                assert mx.abs(c[0] - r[0]).max().item() < 0.05
                assert mx.abs(c[1] - r[1]).max().item() < 0.05


def test_rollback_refuses_impossible_keep(good):
    _, m = good
    m.backbone.enable_rollback()
    cache = m.backbone.rollback_cache(max_pass=16)
    m.backbone.forward(mx.array([[1, 2]]), cache)
    with pytest.raises(ValueError):
        rollback(cache, keep=3, length=2)


# ---------------------------------------------------------------- greedy identity


@pytest.mark.parametrize("which", ["good", "weak"])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_greedy_mtp_output_is_plain_greedy(request, which, depth):
    path, m = request.getfixturevalue(which)
    total_rejected = 0
    for ids in encode_prompts(path, fixture_prompts(3)):
        plain, _ = plain_generate(m, ids, 40)
        for hidden in ("post-norm", "pre-norm"):
            spec, st = mtp_generate(m, ids, 40, depth=depth, hidden=hidden, check_offsets=True)
            assert spec == plain, f"{which} depth {depth} {hidden}"
            assert st.emitted == 40 and st.steps >= 40 // (depth + 1)
            total_rejected += sum(st.proposed) - sum(st.accepted)
        assert mtp_generate(m, ids, 40, depth=depth, overlap=True)[0] == plain  # async_eval changes no value
    if which == "weak":
        assert total_rejected > 20  # the identity held through many rollbacks


def test_stats_are_consistent(good):
    path, m = good
    ids = encode_prompts(path, fixture_prompts(1))[0]
    _, st = mtp_generate(m, ids, 33, depth=2)
    assert st.proposed == [st.steps, st.steps]
    assert st.accepted[1] <= st.accepted[0] <= st.steps
    assert st.from_drafts == sum(st.accepted) or st.emitted == 33  # the last step may be cut
    assert 0 < st.draft_share < 1 and st.acceptance > 0.8
    assert st.to_json()["acceptance_by_depth"] == [round(x, 4) for x in st.acceptance_by_depth]


def test_eos_stops_both_decoders(good):
    path, m = good
    ids = encode_prompts(path, fixture_prompts(1))[0]
    plain, _ = plain_generate(m, ids, 40)
    eos = plain[10]
    p, _ = plain_generate(m, ids, 40, eos=[eos])
    s, _ = mtp_generate(m, ids, 40, eos=[eos])
    assert p == s == plain[: plain.index(eos) + 1]


def test_depth_must_be_positive(good):
    _, m = good
    with pytest.raises(ValueError):
        mtp_generate(m, [1, 2, 3], 4, depth=0)


# ---------------------------------------------------------------- sampling


def _emitted_first(p, q, trials, rule=accept_drafts):
    """Token emitted first by one speculative step with k=1: the draft if kept, else the fallback."""
    counts = np.zeros(p.shape[-1], dtype=np.int64)
    key = mx.random.key(7)
    for _ in range(trials):
        key, k1, k2 = mx.random.split(key, 3)
        d = mx.random.categorical(mx.log(q[0]), key=k1)[None]
        n, nxt = rule(p, q, d, False, k2)
        n = int(n.item())
        counts[int(d.item()) if n >= 1 else int(nxt[0].item())] += 1
    return counts


def test_acceptance_rule_preserves_the_target_distribution():
    rng = np.random.default_rng(0)
    p0 = rng.dirichlet(np.ones(6) * 0.7)
    q0 = rng.dirichlet(np.ones(6) * 0.7)
    p = mx.array(np.stack([p0, rng.dirichlet(np.ones(6))]), dtype=mx.float32)
    q = mx.array(q0[None], dtype=mx.float32)
    counts = _emitted_first(p, q, 3000)
    stat, df = chi2_stat(counts, p0)
    assert stat < chi2_critical(df), (counts, p0)


def test_statistical_check_catches_a_wrong_rule():
    """The same check fails for 'always accept the draft' (emits q, not p): it can fail."""
    rng = np.random.default_rng(0)
    p0, q0 = rng.dirichlet(np.ones(6) * 0.7), rng.dirichlet(np.ones(6) * 0.7)
    p = mx.array(np.stack([p0, p0]), dtype=mx.float32)
    q = mx.array(q0[None], dtype=mx.float32)

    def always_accept(p, q, d, greedy, key):
        return mx.array(1), mx.zeros(2, dtype=mx.int32)

    counts = _emitted_first(p, q, 3000, always_accept)
    stat, df = chi2_stat(counts, np.where(p0 > 0, p0, 0))
    assert stat > chi2_critical(df)


def test_greedy_rule_is_exact_match():
    p = mx.array(np.eye(4, dtype=np.float32)[[2, 1, 3]])
    n, nxt = accept_drafts(p, None, mx.array([2, 0]), True)
    assert int(n.item()) == 1 and nxt.tolist() == [2, 1, 3]


def test_sampling_filters():
    logits = mx.array([[0.0, 1.0, 2.0, 3.0]])
    s = Sampling(temperature=1.0, top_k=2)
    p = s.probs(logits)[0].tolist()
    assert p[0] == p[1] == 0 and p[3] > p[2] > 0
    p = Sampling(temperature=1.0, top_p=0.5).probs(logits)[0].tolist()
    assert p == [0, 0, 0, 1.0]
    with pytest.raises(ValueError):
        Sampling(temperature=-1)


def test_speculative_sampling_matches_plain_sampling_end_to_end(weak):
    """Second generated token (the first a draft can supply): MTP decoding vs the exact marginal."""
    path, m = weak
    ids = encode_prompts(path, fixture_prompts(1))[0]
    s = Sampling(temperature=1.5, top_k=4)
    first = s.probs(m.model(mx.array([ids]))[0, -1])
    support = [int(t) for t in np.nonzero(np.array(first))[0]]
    batch = mx.array([ids + [t] for t in support])
    second = s.probs(m.model(batch)[:, -1])  # [len(support), V]
    marginal = np.array((first[mx.array(support)][:, None] * second).sum(axis=0))

    counts = np.zeros(marginal.shape[0], dtype=np.int64)
    rejected = 0
    for i in range(700):
        out, st = mtp_generate(m, ids, 2, sampling=s, seed=1000 + i)
        counts[out[1]] += 1
        rejected += st.proposed[0] - st.accepted[0]
    stat, df = chi2_stat(counts, marginal / marginal.sum())
    assert rejected > 50, "the test must exercise rejections"
    assert stat < chi2_critical(df), (stat, df)


def test_rollback_refuses_a_pass_longer_than_max_pass(good):
    _, m = good
    m.backbone.enable_rollback()
    cache = m.backbone.rollback_cache(max_pass=2)
    m.backbone.forward(mx.array([[1, 2, 3]]), cache)  # like a prefill: not kept undoable
    rollback(cache, keep=3, length=3)  # keeping everything needs nothing
    with pytest.raises(ValueError, match="max_pass"):
        rollback(cache, keep=2, length=3)


def test_mlx_lm_baseline_matches_plain_loop(tmp_path):
    """The bench baseline is mlx-lm's generate_step: greedy, it decodes what our plain loop decodes;
    sampled, the same seed gives the same tokens (mlx-lm draws from MLX's global seed)."""
    from mtpconvert.runtime.measure.baseline import mlx_lm_generate

    out = tmp_path / "bf16"
    convert_folder(fixture_path("dense"), out, dtype="bfloat16")
    m = load(out)
    ids = encode_prompts(out, fixture_prompts(1))[0]
    tokens, stats = mlx_lm_generate(m, ids, 24)
    assert tokens == plain_generate(m, ids, 24)[0] and stats.emitted == 24 and stats.decode_s > 0
    warm = Sampling(temperature=0.8, top_p=0.9)
    assert mlx_lm_generate(m, ids, 24, warm, seed=3)[0] == mlx_lm_generate(m, ids, 24, warm, seed=3)[0]
