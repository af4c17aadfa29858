"""Oracle acceptance (runtime/measure/oracle.py, `bench --oracle-acceptance P`).

Single stream: the oracle replaces each greedy draft by the true next greedy token with probability
P, else by a wrong one: P = 1 must accept every draft, P = 0 none, and whatever P the emitted tokens
stay the plain greedy decode (only the drafted ids change, never the target's decision). Batched:
each draft is kept with probability P in place of its comparison. Every table row and JSON row
carries the label.
"""

import json

import mlx.core as mx
import pytest

from tests.checkpoints import convert_folder
from mtpconvert.fixture.text import heldout_prompts, text_fixture_path
from mtpconvert.runtime.decoding.batched import Stream, run_batch
from mtpconvert.runtime.decoding.load import load
from mtpconvert.runtime.decoding.sampling import Sampling
from mtpconvert.runtime.decoding.speculative import mtp_generate, plain_generate
from mtpconvert.runtime.measure.bench import bench
from mtpconvert.runtime.measure.oracle import KEEP_LABEL, LABEL, KeepOracle, Oracle, coin
from mtpconvert.runtime.measure.oracle_batch import bench_concurrency_oracle

TOKENS = 16


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    out = tmp_path_factory.mktemp("oracle") / "dense"
    convert_folder(text_fixture_path("dense"), out, dtype="bfloat16")
    _, prompts, _ = heldout_prompts(text_fixture_path("dense"), per_file=1, prompt_tokens=24, files=3)
    m = load(out)
    refs = [plain_generate(m, p, TOKENS + 3)[0] for p in prompts]
    return out, m, prompts, refs


def test_coin_is_deterministic_and_uniform():
    draws = [coin(0, 1, i) for i in range(4000)]
    assert draws == [coin(0, 1, i) for i in range(4000)]
    assert abs(sum(d < 0.3 for d in draws) / len(draws) - 0.3) < 0.03
    assert draws != [coin(1, 1, i) for i in range(4000)]


def test_wrong_token_is_never_the_reference():
    o = Oracle(0.0, vocab=10, references={0: [0, 5, 9]})
    assert [o.token(0, i) for i in range(3)] == [1, 6, 8]
    assert o.token(0, 3) is None and o.token(1, 0) is None
    with pytest.raises(ValueError):
        Oracle(1.5, vocab=10)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("p", [0.0, 0.5, 1.0])
def test_single_stream_acceptance_follows_p_and_output_stays_greedy(dense, depth, p):
    _, m, prompts, refs = dense
    accepted = proposed = 0
    for i, (ids, ref) in enumerate(zip(prompts, refs)):
        o = Oracle(p, m.backbone.vocab_size, {i: ref})
        tokens, st = mtp_generate(m, ids, TOKENS, depth, draft_hook=o.for_stream(i), check_offsets=True)
        assert tokens == ref[:TOKENS]  # the emitted tokens are plain greedy whatever the drafts
        accepted += sum(st.accepted)
        proposed += sum(st.proposed)
        if p == 1.0:  # every draft is the true token: every step keeps all k drafts
            assert st.accepted == st.proposed and st.tokens_per_step == pytest.approx(depth + 1, abs=0.35)
        if p == 0.0:
            assert sum(st.accepted) == 0 and st.steps == TOKENS - 1
        assert o.stats.beyond == 0 or p < 1  # the reference covers every drafted position
    if p == 0.5:  # depth 1: ~half the drafts; depth 2: the second only after a kept first
        assert 0.15 < accepted / proposed < 0.75


def test_head_still_runs_under_the_oracle(dense, monkeypatch):
    """The replaced draft keeps the head's proposal in the evaluated graph: the head is called and its
    output is an input of the drafted token."""
    _, m, prompts, refs = dense
    calls = []
    orig = type(m.head).__call__
    monkeypatch.setattr(type(m.head), "__call__", lambda self, *a, **k: calls.append(1) or orig(self, *a, **k))
    o = Oracle(1.0, m.backbone.vocab_size, {0: refs[0]})
    proposed = mx.array([3])
    drafted = o.replace(0, 0, proposed)
    assert drafted.item() == refs[0][0]
    tokens, st = mtp_generate(m, prompts[0], 8, 1, draft_hook=o.for_stream(0))
    assert len(calls) == st.steps  # one head call per step (depth 1)


def test_batched_keep_oracle_keeps_drafts_by_coin(dense):
    """The batched oracle keeps a draft when its coin is below P: the drafts kept per step are the
    leading kept coins of that step's drafts, asked at the step's output positions; P = 0 gives the
    plain greedy decode and P = 1 keeps every draft."""
    _, m, prompts, refs = dense
    for p in (0.0, 0.5, 1.0):
        o = KeepOracle(p, seed=3)
        asked = []
        def keep(stream, position):
            asked.append((stream, position, o.keeps(stream, position)))
            return asked[-1][2]
        streams = [Stream(list(prompts[i]), TOKENS, seed=i) for i in range(3)]
        run_batch(m, streams, 2, "mtp", keep_hook=keep)
        for i, s in enumerate(streams):
            mine = [kept for stream, _, kept in asked if stream == i]
            steps = [mine[j:j + 2] for j in range(0, len(mine), 2)]
            assert len(steps) == sum(a >= 0 for a in s.accepted)
            assert [a for a in s.accepted if a >= 0] == [(d[0] + (d[0] and d[1])) for d in steps]
            position, firsts = 1, []  # a step's first draft sits at the output position after its confirmed token
            for a in s.accepted:
                firsts += [position] if a >= 0 else []
                position += max(a, 0) + 1
            assert [pos for stream, pos, _ in asked if stream == i][::2] == firsts
            if p == 0.0:
                assert s.out == refs[i][:TOKENS]
            if p == 1.0:
                assert all(a == 2 for a in s.accepted)
        assert o.coins == len(asked) and o.below == sum(k for *_, k in asked)
    with pytest.raises(ValueError, match="keep_hook"):
        run_batch(m, [Stream(list(prompts[0]), 4, sampling=Sampling(0.7))], 1, "mtp", keep_hook=lambda s, i: True)


def test_bench_rows_and_json_carry_the_label(dense):
    path, m, prompts, _ = dense
    res = bench(path, max_tokens=TOKENS, depths=(1,), hiddens=("post-norm",), model=m, prompt_ids=prompts[:2],
                oracle=(0.0, 1.0))
    j = json.loads(json.dumps(res.to_json()))
    assert j["oracle_acceptance"] == [0.0, 1.0] and j["oracle_label"] == LABEL
    assert [r["oracle_acceptance"] for r in j["rows"]] == [0.0, 1.0]
    for r in j["rows"]:
        assert r["oracle"]["label"] == LABEL and r["oracle"]["reference_misses"] == 0
        assert r["greedy_identical_to_mlx_lm"] is True
        assert r["mtp"]["acceptance"] == r["oracle_acceptance"]
        assert {"beta", "delta"} <= set(r["costs"]) and "predicted_speedup" in r
    plain = bench(path, max_tokens=8, depths=(1,), hiddens=("post-norm",), model=m, prompt_ids=prompts[:1])
    assert "oracle_acceptance" not in plain.to_json() and "oracle" not in plain.to_json()["rows"][0]


def test_oracle_needs_greedy(dense):

    path, m, prompts, refs = dense
    with pytest.raises(ValueError):
        bench(path, max_tokens=4, model=m, prompt_ids=prompts[:1], sampling=Sampling(0.7), oracle=(0.5,))
    with pytest.raises(ValueError):
        mtp_generate(m, prompts[0], 4, 1, Sampling(0.7), draft_hook=lambda i, t: t)


def test_batched_oracle_bench_json(dense):
    path, m, prompts, _ = dense
    done = []
    res = bench_concurrency_oracle(m, str(path), prompts[:2], [1, 2], oracle=(1.0,), max_tokens=10, depths=(1,),
                                   on_row=done.append)
    assert done == res.rows  # each row handed over as it ends
    j = json.loads(json.dumps(res.to_json()))
    assert j["oracle_label"] == KEEP_LABEL and j["oracle_acceptance"] == [1.0]
    assert [(r["concurrency"], r["oracle_acceptance"]) for r in j["rows"]] == [(1, 1.0), (2, 1.0)]
    for r in j["rows"]:
        assert r["oracle"]["label"] == KEEP_LABEL and r["oracle"]["coins"] == r["oracle"]["coins_below_p"] > 0
        assert r["decoders"]["mtp"]["acceptance_by_stream"] == [1.0] * r["concurrency"]
        assert r["costs"]["rows"] == r["concurrency"] and "predicted_speedup" in r
        auto = r["decoders"]["auto"]
        assert auto["generated"] == r["decoders"]["plain"]["generated"] and 0 <= auto["drafted_steps"] <= auto["steps"]
        assert r["auto_vs_best"] > 0 and r["speedup_auto"] > 0 and "policy_step_ms" in auto
        assert r["greedy_plain_engine_identical_to_batchgen"] is True


def test_cli_oracle_acceptance_json_and_table(dense):
    from typer.testing import CliRunner

    from mtpconvert.cli.main import app

    path, _, _, _ = dense
    runner = CliRunner()
    res = runner.invoke(app, ["bench", str(path), "-p", "def f(x):", "--max-tokens", "6", "--mtp-hidden", "post-norm",
                              "--oracle-acceptance", "1", "--json"])
    assert res.exit_code == 0, res.output
    j = json.loads(res.stdout)
    assert j["oracle_label"] == LABEL and j["rows"][0]["oracle_acceptance"] == 1.0
    assert j["rows"][0]["mtp"]["acceptance"] == 1.0
    res = runner.invoke(app, ["bench", str(path), "-p", "def f(x):", "--max-tokens", "6", "--mtp-hidden", "post-norm",
                              "--oracle-acceptance", "0.5"])
    assert res.exit_code == 0, res.output
    assert "ORACLE-ACCEPTANCE" in res.stdout and "oracle P" in res.stdout
    res = runner.invoke(app, ["bench", str(path), "-p", "def f(x):", "--oracle-acceptance", "0.5", "--temp", "0.7"])
    assert res.exit_code != 0
