"""MTP speculative decoding: draft with the head, verify in one backbone pass, roll back.

One step, with N tokens already in the backbone cache and the confirmed token t_N
not yet fed to it:

1. draft   the head consumes the pending true pairs (h_p, t_{p+1}) — the whole prompt at
           prefill, the a+1 newly confirmed positions after that — and proposes d_1 from
           its last position; depth k chains k-1 more proposals from the head's own state.
           After the first head call its cache offset equals the backbone's (N).
2. verify  the backbone runs [t_N, d_1..d_k] in one pass (k+1 tokens); linear-attention
           layers record their state after each position.
3. decide  ``accept_drafts`` keeps a leading drafts (one ``mx.eval`` per step).
4. undo    linear-attention states return to the state after t_N, d_1..d_a, KV caches
           drop the k-a rejected positions, the head's cache drops its k-1 chained
           (draft-fed) entries; the confirmed positions' hidden states become the next
           step's pending pairs.

One host sync per step (step 3). Every later step's shapes depend on the accept count ``a``,
so its graph cannot be built before that sync; what can overlap is the device running one
stage while Python builds the next: the undo's recompute runs while the next draft's graph is
built, and the drafts run while the verify pass's graph is built (``overlap=True``:
``mx.async_eval`` at those two points; the values computed are the same). Off by default until
measured where graph building costs: on the 2-core CPU it changed nothing beyond the noise
(docs/runtime.md).

Greedy output is token-for-token the plain greedy decode of the same model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import CacheList

from .load import MTPModel
from . import cuda_qmv
from .rollback import RollbackArraysCache
from .sampling import Sampling, accept_drafts, categorical


@dataclass
class DecodeStats:
    """Counters for one or more decodes. ``proposed[i]``/``accepted[i]`` are per depth position."""

    depth: int = 0
    prompt_tokens: int = 0
    emitted: int = 0
    from_drafts: int = 0
    steps: int = 0
    proposed: List[int] = field(default_factory=list)
    accepted: List[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0

    def add(self, other: "DecodeStats") -> None:
        self.depth = max(self.depth, other.depth)
        n = max(len(self.proposed), len(other.proposed))
        pad = lambda xs: xs + [0] * (n - len(xs))  # noqa: E731
        self.proposed = [a + b for a, b in zip(pad(self.proposed), pad(other.proposed))]
        self.accepted = [a + b for a, b in zip(pad(self.accepted), pad(other.accepted))]
        for f in ("prompt_tokens", "emitted", "from_drafts", "steps", "prefill_s", "decode_s"):
            setattr(self, f, getattr(self, f) + getattr(other, f))

    @property
    def acceptance(self) -> float:
        """Accepted drafts / proposed drafts, all depth positions together."""
        return sum(self.accepted) / sum(self.proposed) if sum(self.proposed) else 0.0

    @property
    def acceptance_by_depth(self) -> List[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]

    @property
    def draft_share(self) -> float:
        """Share of emitted tokens that came from accepted drafts (PR #990's "Accept")."""
        return self.from_drafts / self.emitted if self.emitted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return (self.emitted - 1) / self.steps if self.steps else 0.0

    @property
    def decode_tps(self) -> float:
        """Generated tokens per second after prefill (the first token comes from prefill)."""
        return (self.emitted - 1) / self.decode_s if self.decode_s > 0 else 0.0

    def to_json(self) -> dict:
        return {
            "depth": self.depth,
            "prompt_tokens": self.prompt_tokens,
            "emitted": self.emitted,
            "steps": self.steps,
            "acceptance": round(self.acceptance, 4),
            "acceptance_by_depth": [round(x, 4) for x in self.acceptance_by_depth],
            "proposed": self.proposed,
            "accepted": self.accepted,
            "draft_share": round(self.draft_share, 4),
            "tokens_per_step": round(self.tokens_per_step, 3),
            "prefill_s": round(self.prefill_s, 4),
            "decode_s": round(self.decode_s, 4),
            "decode_tok_per_s": round(self.decode_tps, 2),
        }


def cache_offset(cache) -> int:
    """Tokens an attention layer's cache holds (a CacheList, mlx-lm's for GLM-5 or mlx-vlm's for GLM-5.3-Flash:
    its first cache's)."""
    return cache[0].offset if isinstance(cache, CacheList) or not hasattr(cache, "offset") else cache.offset


def linear_states(cache: list) -> List[mx.array]:
    """The linear-attention layers' (conv window, SSM state) arrays: what an undo recomputes."""
    return [x for c in cache if isinstance(c, RollbackArraysCache) for x in (c[0], c[1])]


def _seed_keys(seed: Optional[int]):
    key = mx.random.key(0 if seed is None else seed)
    while True:
        key, sub = mx.random.split(key)
        yield sub


def plain_generate(
    m: MTPModel, prompt: Sequence[int], max_tokens: int, sampling: Sampling = Sampling(),
    seed: Optional[int] = None, eos: Sequence[int] = (), on_tokens: Optional[Callable[[int], None]] = None,
):
    """Baseline: the backbone library's own forward, one token per step, same sampler. Returns (tokens, stats)."""
    keys = _seed_keys(seed)
    stats = DecodeStats(prompt_tokens=len(prompt))
    cache = m.backbone.make_cache()
    t0 = time.perf_counter()
    logits = m.backbone(mx.array([list(prompt)]), cache=cache)[:, -1]
    tok = sampling.sample(logits, next(keys))
    mx.eval(tok)
    out = [int(tok.item())]
    stats.prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    while len(out) < max_tokens and out[-1] not in eos:
        logits = m.backbone(tok[None], cache=cache)[:, -1]
        tok = sampling.sample(logits, next(keys))
        mx.eval(tok)
        out.append(int(tok.item()))
        if on_tokens:
            on_tokens(1)
    stats.decode_s = time.perf_counter() - t0
    stats.emitted = len(out)
    return out, stats


def prepare_speculative(m: MTPModel, depth: int, hidden: str) -> None:
    """Refuse settings no decode can run with, and give the backbone's linear-attention layers
    their recording forward (idempotent)."""
    if depth < 1:
        raise ValueError("depth must be >= 1")
    if hidden not in ("post-norm", "pre-norm"):
        raise ValueError(f"hidden must be post-norm or pre-norm, not {hidden!r}")
    if len(m.head.layers) != 1:
        raise ValueError("speculative decoding supports one MTP layer (every Qwen3.5/3.6 release has one)")
    if hidden == "pre-norm" and not m.family.capabilities.pre_norm_hidden:
        raise ValueError(f"hidden=pre-norm: the {m.family.name} backbone runs as its library's own forward, "
                         "which gives post-norm states only")
    m.backbone.enable_rollback()
    cuda_qmv.auto(m)  # MTPCONVERT_CUDA_QMV=1 on CUDA: multi-row quantized matvec for the verify passes


def mtp_generate(
    m: MTPModel, prompt: Sequence[int], max_tokens: int, depth: int = 1, sampling: Sampling = Sampling(),
    hidden: str = "post-norm", seed: Optional[int] = None, eos: Sequence[int] = (),
    on_tokens: Optional[Callable[[int], None]] = None, check_offsets: bool = False, overlap: bool = False,
    draft_hook: Optional[Callable[[int, mx.array], mx.array]] = None,
):
    """Speculative decode with the MTP head. Returns (tokens, stats); see the module doc.

    ``draft_hook(position, proposed) -> drafted`` (greedy only) may replace each greedy draft, at
    output index ``position``, before it is chained and verified (``measure/oracle.py``)."""
    if draft_hook is not None and not sampling.greedy:
        raise ValueError("draft_hook needs greedy decoding")
    prepare_speculative(m, depth, hidden)
    keys = _seed_keys(seed)
    stats = DecodeStats(depth=depth, prompt_tokens=len(prompt), proposed=[0] * depth, accepted=[0] * depth)
    cache = m.backbone.rollback_cache(max_pass=depth + 1)
    mtp_cache = m.head.make_cache()
    pick = 0 if hidden == "pre-norm" else 1

    t0 = time.perf_counter()
    prompt_arr = mx.array([list(prompt)])
    states = m.backbone.forward(prompt_arr, cache)
    tok = sampling.sample(m.logits(states[1][:, -1]), next(keys))  # [1]
    pend_h = states[pick]  # h_0..h_{P-1}
    pend_t = mx.concatenate([prompt_arr[:, 1:], tok[None]], axis=1)  # t_1..t_P
    mx.eval(tok)
    out = [int(tok.item())]
    stats.prefill_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    while len(out) < max_tokens and out[-1] not in eos:
        # 1. draft
        drafts, q_rows = [], []
        x = m.head(pend_h, m.embed(pend_t), mtp_cache)[:, -1:]
        if check_offsets and cache_offset(mtp_cache[0]) != cache_offset(m.backbone.attention_cache(cache)):
            raise AssertionError(f"MTP cache at {cache_offset(mtp_cache[0])}, backbone at "
                                 f"{cache_offset(m.backbone.attention_cache(cache))}")
        for j in range(depth):
            if j:
                x = m.head(x, m.embed(drafts[-1][None]), mtp_cache)
            q_logits = m.draft_logits(x)[:, -1]
            key = next(keys)
            if sampling.greedy:  # greedy acceptance compares argmaxes; no distributions needed
                drafts.append(mx.argmax(q_logits, axis=-1))
                if draft_hook is not None:
                    drafts[-1] = draft_hook(len(out) + j, drafts[-1])
            else:
                q_rows.append(sampling.probs(q_logits))
                drafts.append(categorical(q_rows[-1], key))
        draft_arr = mx.concatenate(drafts)  # [k]
        if overlap:
            mx.async_eval(draft_arr)
        # 2. verify [t_N, d_1..d_k]
        verify_in = mx.concatenate([tok, draft_arr])[None]
        states = m.backbone.forward(verify_in, cache)
        target = m.logits(states[1])[0]  # [k+1, V]
        # 3. decide
        if sampling.greedy:
            n_acc, next_tokens = accept_drafts(target, None, draft_arr, True)
        else:
            n_acc, next_tokens = accept_drafts(sampling.probs(target), mx.concatenate(q_rows), draft_arr, False, next(keys))
        mx.eval(n_acc, next_tokens, draft_arr)
        a = int(n_acc.item())
        new = draft_arr[:a].tolist() + [int(next_tokens[a].item())]
        # 4. undo the rejected tail and the chained head entries
        m.backbone.rollback(cache, keep=a + 1, length=depth + 1)
        if overlap and a < depth:
            mx.async_eval(linear_states(cache))
        if depth > 1:
            mtp_cache[0].trim(depth - 1)
        tok = mx.array(new[-1:])
        pend_h = states[pick][:, : a + 1]
        pend_t = mx.array([new])

        stats.steps += 1
        for i in range(depth):  # every position proposes each step; i is kept when all before it are
            stats.proposed[i] += 1
            stats.accepted[i] += 1 if i < a else 0
        room = max_tokens - len(out)
        if eos:
            for i, t in enumerate(new):
                if t in eos:
                    new = new[: i + 1]
                    break
        new = new[:room]
        stats.from_drafts += min(a, len(new))
        out.extend(new)
        if on_tokens:
            on_tokens(len(new))
    stats.decode_s = time.perf_counter() - t0
    stats.emitted = len(out)
    return out, stats

