"""Token distributions and the speculative acceptance rule.

``Sampling`` turns logits into the distribution a sampler draws from (temperature, then
top-k, then top-p); temperature 0 means greedy. ``accept_drafts`` is the rule of
Leviathan et al. / Chen et al.: draft i is kept with probability min(1, p_i(d)/q_i(d));
the first rejected position is resampled from max(p_i - q_i, 0)/Z, and when every draft
is kept one bonus token comes from p_k. The emitted tokens are then distributed exactly
as plain sampling from p. Greedy is the special case of one-hot p and q. Everything is
computed on device so one ``mx.eval`` per step decides it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import mlx.core as mx


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"invalid sampling settings {self}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: mx.array) -> mx.array:
        """Distribution over the vocabulary (last axis), float32, after all filters."""
        logits = logits.astype(mx.float32)
        if self.greedy:
            return (mx.arange(logits.shape[-1]) == mx.argmax(logits, axis=-1, keepdims=True)).astype(mx.float32)
        logits = logits / self.temperature
        if self.top_k and self.top_k < logits.shape[-1]:
            kth = mx.sort(logits, axis=-1)[..., -self.top_k][..., None]
            logits = mx.where(logits < kth, -mx.inf, logits)
        p = mx.softmax(logits, axis=-1)
        if self.top_p < 1.0:
            order = mx.argsort(-p, axis=-1)
            sorted_p = mx.take_along_axis(p, order, axis=-1)
            # keep the smallest prefix whose mass reaches top_p (always the top token)
            keep_sorted = (mx.cumsum(sorted_p, axis=-1) - sorted_p) < self.top_p
            keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
            p = mx.where(keep, p, 0.0)
            p = p / p.sum(axis=-1, keepdims=True)
        return p

    def sample(self, logits: mx.array, key: Optional[mx.array] = None) -> mx.array:
        if self.greedy:
            return mx.argmax(logits, axis=-1)
        return categorical(self.probs(logits), key)


def categorical(p: mx.array, key: Optional[mx.array] = None) -> mx.array:
    return mx.random.categorical(mx.log(p), axis=-1, key=key)


def accept_drafts(
    p: mx.array, q: mx.array, drafts: mx.array, greedy: bool, key: Optional[mx.array] = None
) -> Tuple[mx.array, mx.array]:
    """Decide k drafts against the target.

    p: target distributions [k+1, V] (position i verifies draft i; row k gives the bonus);
    q: draft distributions [k, V]; drafts: [k] int. Greedy needs only argmaxes: p may be
    the target logits and q is unused.
    Returns (n_accepted scalar, next_tokens [k+1]) where next_tokens[n_accepted] is the
    token emitted after the accepted drafts (a resample or the bonus).
    """
    k = drafts.shape[0]
    if greedy:
        targets = mx.argmax(p, axis=-1)
        ok = drafts == targets[:k]
        return _leading_true(ok), targets
    k_accept, k_resample = mx.random.split(key) if key is not None else (None, None)
    idx = mx.arange(k)
    p_d = p[idx, drafts]
    q_d = q[idx, drafts]
    u = mx.random.uniform(shape=(k,), key=k_accept)
    ok = u * q_d < p_d  # u < p/q without dividing by a zero q
    residual = mx.maximum(p[:k] - q, 0.0)
    z = residual.sum(axis=-1, keepdims=True)
    residual = mx.where(z > 0, residual / mx.maximum(z, 1e-30), p[:k])
    fallback = mx.concatenate([residual, p[k:]], axis=0)
    return _leading_true(ok), categorical(fallback, k_resample)


def _leading_true(ok: mx.array) -> mx.array:
    return mx.sum(mx.cumprod(ok.astype(mx.int32)))
