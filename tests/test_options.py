"""The option values (mtpconvert/options.py): each refuses a bad value when it is made, naming the option."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mtpconvert.errors import OptionsError
from mtpconvert.options import BenchOptions, ExecuteOptions, HubSource, PublishOptions, RawPolicy


@pytest.mark.parametrize("make, message", [
    (lambda: HubSource("Qwen/Qwen3.5-27B", timeout=0), "--timeout must be a number of seconds above 0"),
    (lambda: RawPolicy(prefetch_shards=0), "--prefetch-shards needs --stream"),
    (lambda: RawPolicy(raw_window_gb=1), "--raw-window needs --stream"),
    (lambda: RawPolicy(stream=True, prefetch_shards=True), "--prefetch-shards must be 0 or more"),
    (lambda: RawPolicy(stream=True, raw_window_gb=-1), "--raw-window must be a number of GB above 0"),
    (lambda: RawPolicy(stream=True, prefetch_shards=1, raw_window_gb=1), "exclude each other"),
    (lambda: PublishOptions("me/not a repo"), "--upload-repo must be a Hub repo id"),
    (lambda: BenchOptions(depths=()), "--depth must be >= 1"),
    (lambda: BenchOptions(max_tokens=0), "--max-tokens must be 1 or more"),
    (lambda: BenchOptions(hiddens=("post-norm", "mid-norm")), "--mtp-hidden must be one of"),
    (lambda: BenchOptions(temperature=-0.1), "--temp must be 0"),
    (lambda: BenchOptions(top_p=1.5), "--top-p must be above 0 and at most 1"),
    (lambda: BenchOptions(top_k=-1), "--top-k must be 0"),
    (lambda: BenchOptions(prompts=["def f():", " "]), "--prompt must not be empty"),
    (lambda: BenchOptions(concurrency=[1, 0]), "--concurrency must list stream counts >= 1"),
    (lambda: BenchOptions(oracle=[1.2]), "--oracle-acceptance takes rates in [0, 1]"),
    (lambda: BenchOptions(oracle=[0.5], temperature=0.7), "needs greedy decoding"),
    (lambda: ExecuteOptions(block_bytes=0), "block_bytes must be 1 or more"),
])
def test_a_bad_option_is_refused_when_its_value_is_made(make, message):
    with pytest.raises(OptionsError, match=re.escape(message)):
        make()


def test_a_hub_source_keeps_its_token_out_of_its_repr():
    source = HubSource("Qwen/Qwen3.5-27B", token="hf_secret", cache_dir="cache", local_dir="")
    assert "hf_secret" not in repr(source) and source.token == "hf_secret"
    assert source.cache_dir == Path("cache") and source.local_dir is None


def test_a_raw_policy_records_only_what_a_plain_pull_would_not():
    """The index records a window or a prefetch depth other than the default; the reproduce command reads it."""
    assert RawPolicy().record() is None and RawPolicy(stream=True).record() is None
    assert RawPolicy(stream=True, prefetch_shards=1).record() is None
    assert RawPolicy(stream=True, prefetch_shards=0).record() == {"prefetch_shards": 0}
    assert RawPolicy(stream=True, raw_window_gb=0.5).record() == {"raw_window_gb": 0.5}
    assert [RawPolicy(stream=True, prefetch_shards=n).shards_held for n in (None, 0, 3)] == [2, 1, 4]
    assert RawPolicy(stream=True, raw_window_gb=0.5).window_bytes == 500_000_000
    assert RawPolicy(stream=True).window_bytes is None


def test_bench_options_hold_their_sequences_as_tuples():
    options = BenchOptions(prompts=["a"], depths=[1, 2], concurrency=[1, 2, 4], oracle=[0.5])
    assert (options.prompts, options.depths, options.concurrency, options.oracle) == (("a",), (1, 2), (1, 2, 4),
                                                                                       (0.5,))
    assert hash(options) == hash(BenchOptions(prompts=("a",), depths=(1, 2), concurrency=(1, 2, 4), oracle=(0.5,)))
