"""`mtpconvert bench`: acceptance and speed of MTP decoding against plain decoding.

Both decoders run on the same prompts in the same process after a warm-up, for every
requested (hidden-state convention, depth) pair. Step costs are measured separately so the
speedup can be explained: with plain decode step time T1, a (k+1)-token verify pass
costing beta*T1 and a head step delta_1*T1, MTP decoding emits tokens_per_step tokens per
(beta + k*delta_1)*T1, i.e. speedup ~= tokens_per_step / (beta + delta); for depth 1 this
is the usual (1 + alpha) / (beta + delta).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import mlx.core as mx

from .load import MTPModel, load
from .rollback import enable_rollback, make_rollback_cache, rollback
from .sampling import Sampling
from .smoke import encode_prompts
from .speculative import DecodeStats, backbone_forward, mtp_generate, plain_generate


@dataclass
class StepCosts:
    """Seconds per call, averaged after warm-up, on a cache holding ``context`` tokens."""

    context: int
    decode_1: float  # plain one-token backbone step (stock forward)
    verify: float  # (depth+1)-token backbone pass with state recording, then rollback
    head: float  # one MTP head step (fc + decoder layer + lm_head)
    depth: int

    @property
    def beta(self) -> float:
        return self.verify / self.decode_1

    @property
    def delta(self) -> float:
        return self.depth * self.head / self.decode_1

    def predicted_speedup(self, tokens_per_step: float) -> float:
        return tokens_per_step / (self.beta + self.delta)

    def to_json(self) -> dict:
        return {
            "context": self.context, "depth": self.depth,
            "decode_1_ms": round(1e3 * self.decode_1, 3), "verify_ms": round(1e3 * self.verify, 3),
            "head_ms": round(1e3 * self.head, 3), "beta": round(self.beta, 3), "delta": round(self.delta, 3),
        }


@dataclass
class BenchRow:
    hidden: str
    depth: int
    mtp: DecodeStats
    plain: DecodeStats
    costs: Optional[StepCosts] = None

    @property
    def speedup(self) -> float:
        return self.mtp.decode_tps / self.plain.decode_tps if self.plain.decode_tps else 0.0

    @property
    def overhead(self) -> Optional[float]:
        """Share of an MTP step not spent in the verify pass and head calls (Python, syncs, sampling)."""
        if not self.costs or not self.mtp.steps:
            return None
        step = self.mtp.decode_s / self.mtp.steps
        return max(0.0, 1 - (self.costs.verify + self.depth * self.costs.head) / step)

    def to_json(self) -> dict:
        out = {
            "hidden": self.hidden, "depth": self.depth, "mtp": self.mtp.to_json(), "plain": self.plain.to_json(),
            "speedup": round(self.speedup, 3),
        }
        if self.costs:
            out["costs"] = self.costs.to_json()
            out["predicted_speedup"] = round(self.costs.predicted_speedup(self.mtp.tokens_per_step), 3)
            out["loop_overhead"] = round(self.overhead, 3)
        return out


@dataclass
class BenchResult:
    path: str
    sampling: Sampling
    max_tokens: int
    prompts: int
    rows: List[BenchRow] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "path": self.path,
            "sampling": vars(self.sampling),
            "max_tokens": self.max_tokens,
            "prompts": self.prompts,
            "device": str(mx.default_device()),
            "rows": [r.to_json() for r in self.rows],
        }


def _timed(fn: Callable[[], object], n: int) -> float:
    mx.eval(fn())
    t0 = time.perf_counter()
    for _ in range(n):
        mx.eval(fn())
    return (time.perf_counter() - t0) / n


def measure_step_costs(m: MTPModel, context: Sequence[int], depth: int, n: int = 20) -> StepCosts:
    """Time one decode step, one verify pass (+rollback) and one head step at a fixed context."""
    enable_rollback(m.model)
    ctx = mx.array([list(context)])
    tok = ctx[:, -1:]

    plain_cache = m.model.make_cache()
    mx.eval(m.model(ctx, cache=plain_cache))

    def decode_1():
        out = m.model(tok, cache=plain_cache)
        for c in plain_cache:
            if hasattr(c, "trim"):
                c.trim(1)
        return out  # linear-attention state advances; cost is what matters here

    cache = make_rollback_cache(m.model)
    pre, post = backbone_forward(m, ctx, cache)
    mx.eval(post)
    verify_in = mx.repeat(tok, depth + 1, axis=1)

    def verify():
        states = backbone_forward(m, verify_in, cache)
        logits = m.logits(states[1])
        mx.eval(logits)
        rollback(cache, keep=1, length=depth + 1)
        for c in cache:  # return the kept token too, so the context stays fixed
            if hasattr(c, "trim"):
                c.trim(1)
        return logits

    head_cache = m.head.make_cache()
    mx.eval(m.head(post, m.embed(ctx), head_cache))
    h_last, e_last = post[:, -1:], m.embed(tok)

    def head():
        x = m.head(h_last, e_last, head_cache)
        head_cache[0].trim(1)
        return m.logits(x)

    return StepCosts(len(context), _timed(decode_1, n), _timed(verify, n), _timed(head, n), depth)


def bench(
    path: Path,
    prompts: Optional[Sequence[str]] = None,
    max_tokens: int = 128,
    depths: Sequence[int] = (1,),
    hiddens: Sequence[str] = ("post-norm", "pre-norm"),
    sampling: Sampling = Sampling(),
    seed: int = 0,
    model: Optional[MTPModel] = None,
    on_tokens: Optional[Callable[[int], None]] = None,
) -> BenchResult:
    m = model or load(path)
    encoded = encode_prompts(path, prompts)
    result = BenchResult(str(path), sampling, max_tokens, len(encoded))
    # warm-up: compile kernels and touch the weights once for both decoders
    plain_generate(m, encoded[0], 8, sampling, seed)
    mtp_generate(m, encoded[0], 8, max(depths), sampling, hiddens[0], seed)
    for hidden in hiddens:
        for depth in depths:
            row = BenchRow(hidden, depth, DecodeStats(depth=depth), DecodeStats())
            for i, ids in enumerate(encoded):
                _, ps = plain_generate(m, ids, max_tokens, sampling, seed + i, on_tokens=on_tokens)
                _, ms = mtp_generate(m, ids, max_tokens, depth, sampling, hidden, seed + i, on_tokens=on_tokens)
                row.plain.add(ps)
                row.mtp.add(ms)
            row.costs = measure_step_costs(m, encoded[0], depth)
            result.rows.append(row)
    return result
