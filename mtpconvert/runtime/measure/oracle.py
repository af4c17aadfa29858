"""Oracle acceptance: measure MTP decoding at a chosen acceptance rate on any model.

``bench --oracle-acceptance P`` replaces each greedy draft the head proposes by the *true* next
greedy token with probability P, and by a token that is certainly wrong otherwise. The head still
runs every step (its proposal stays in the step's graph, so its cost is paid), the verify pass,
the acceptance rule and the undo are the runtime's own: only the drafted token ids change. So a
model with random weights (a 27B-shaped synthetic model) decodes at acceptance ≈ P and its
speedup is a real measurement, not one implied from step costs.

Where the true token comes from: a greedy reference decode of the same prompt, computed before
the timed runs (mlx-lm's ``generate_step``, ``max_tokens + depth`` tokens). The draft at output
position ``i`` (the i-th generated token, 0-based) is replaced by ``reference[i]``. On the CPU
backend greedy MTP output equals plain greedy, so the reference is exact. On a GPU a
``(k+1)``-token verify pass can round a near-tie the other way than a 1-token step, after which
the MTP decode continues from its own (equally greedy) token and the reference no longer is its
future; ``refine`` then replaces the reference with the warm-up MTP decode's own output (under the
same coin flips, so the same accepted pattern and pass shapes) until the two agree or the budget
ends. ``OracleStats`` counts what happened, and the JSON reports how many decodes still parted
from their reference (``reference_misses``): there measured acceptance is below P.

Batched decoding (``KeepOracle``, ``oracle_batch.py``) sets the acceptance itself instead: the
head's draft at output position ``i`` of stream ``s`` is kept when the coin for (s, i) falls below P
and rejected otherwise, in place of its comparison with the verify pass's token; the token after
the kept drafts is the verify pass's own greedy choice. No reference is needed, so no decode can part
from one: ``auto`` mixes 1-token steps and ``(k+1)``-token verify passes in an order its timings
decide, so on a GPU its decode rounds near-ties of a random-weight model differently from any
warm-up's (a replaced draft then measured 0-11% acceptance at 8 streams of the 27B shape, P = 0.8:
docs/cuda.md). The costs
are the runtime's own as before (head, verify pass, undo of each rejection); the emitted tokens are no
longer the plain greedy decode but the kept drafts and the verify pass's tokens after them, which on
a random-weight model costs the same.

The coin for position ``i`` of stream ``s`` is a hash of (seed, s, i), so warm-up and timed runs,
and every decoder, see the same choices. Greedy decoding only (a sampled draft's probability
``q(d)`` would no longer describe the token drafted).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx

LABEL = ("oracle-acceptance P: each greedy draft replaced by the true next greedy token with "
         "probability P, else by a wrong token; the head still runs (its cost is real), acceptance "
         "is set by P, not by the head")
KEEP_LABEL = ("oracle-acceptance P: each greedy draft the head proposes is kept with probability P, else "
              "rejected, in place of its comparison with the verify pass's token; head, verify pass and undo "
              "are the runtime's own (their cost is real), acceptance is set by P, not by the head")


def coin(seed: int, stream: int, position: int) -> float:
    """A uniform draw in [0, 1) that depends only on (seed, stream, position)."""
    digest = hashlib.blake2b(f"oracle/{seed}/{stream}/{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def check_acceptance(p: float) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"oracle acceptance must be in [0, 1], not {p}")


@dataclass
class OracleStats:
    true: int = 0  # drafts replaced by the reference token
    wrong: int = 0  # drafts replaced by a token != the reference token
    beyond: int = 0  # drafts past the reference's end (the head's own proposal is kept)

    def to_json(self) -> dict:
        return {"replaced_true": self.true, "replaced_wrong": self.wrong, "past_reference": self.beyond}


@dataclass
class Oracle:
    """Replace drafts by reference tokens with probability ``p`` (one reference per stream id)."""

    p: float
    vocab: int
    references: Dict[int, List[int]] = field(default_factory=dict)
    seed: int = 0
    stats: OracleStats = field(default_factory=OracleStats)

    def __post_init__(self):
        check_acceptance(self.p)

    def token(self, stream: int, position: int) -> Optional[int]:
        """The token the oracle drafts at output ``position`` of ``stream`` (None: past the reference)."""
        ref = self.references.get(stream)
        if ref is None or position >= len(ref):
            return None
        true = ref[position]
        if coin(self.seed, stream, position) < self.p:
            return true
        return true + 1 if true + 1 < self.vocab else true - 1  # certainly not the greedy token

    def replace(self, stream: int, position: int, proposed: mx.array) -> mx.array:
        """``proposed`` (the head's draft, any shape) with its value swapped for the oracle's.

        ``proposed * 0 + t`` keeps the head's computation in the graph that is evaluated, so the
        head's cost stays in every step (a constant alone would let MLX skip it)."""
        t = self.token(stream, position)
        if t is None:
            self.stats.beyond += 1
            return proposed
        if t == self.references[stream][position]:
            self.stats.true += 1
        else:
            self.stats.wrong += 1
        return proposed * 0 + mx.array(t, dtype=proposed.dtype)

    def for_stream(self, stream: int) -> Callable[[int, mx.array], mx.array]:
        """The single-stream hook ``(position, proposed) -> drafted`` of ``mtp_generate``."""
        return lambda position, proposed: self.replace(stream, position, proposed)

    def refine(self, stream: int, decoded: Sequence[int]) -> bool:
        """After a warm-up decode of ``stream``: if it parted from the reference, make its tokens the
        reference (keeping the old tail past its end). Returns True when it had parted."""
        ref = self.references[stream]
        n = min(len(ref), len(decoded))
        if list(decoded[:n]) == ref[:n]:
            return False
        self.references[stream] = list(decoded[:n]) + ref[n:]
        return True


def parted(reference: Sequence[int], decoded: Sequence[int]) -> bool:
    n = min(len(reference), len(decoded))
    return list(reference[:n]) != list(decoded[:n])


@dataclass
class KeepOracle:
    """Keep each greedy draft of the batched engine with probability ``p`` (``run_batch``'s ``keep_hook``)."""

    p: float
    seed: int = 0
    coins: int = 0  # drafts decided (a draft after a rejected one is decided too, and discarded)
    below: int = 0  # of them, kept

    def __post_init__(self):
        check_acceptance(self.p)

    def keeps(self, stream: int, position: int) -> bool:
        """Whether the draft at output ``position`` of ``stream`` is kept (counted)."""
        keep = coin(self.seed, stream, position) < self.p
        self.coins += 1
        self.below += keep
        return keep

    def to_json(self) -> dict:
        return {"coins": self.coins, "coins_below_p": self.below, "label": KEEP_LABEL}
