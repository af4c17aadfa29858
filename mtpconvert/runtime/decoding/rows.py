"""One stream of the batched engine and its per-row decisions (``batched.BatchedMTP`` runs the steps).

A ``Stream`` is the request (prompt, sampling, seed, logits processors, EOS) and its decode state; each
step's tokens for a row are decided here, on device (``decide``), and appended (``emit``). Random draws
are keyed by (stream seed, output position, purpose) only (``draw_key``), so a row's draws do not depend
on the other rows, on when it joined, or on how the steps were cut.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import mlx.core as mx

from .sampling import Sampling, accept_drafts
from .speculative import DecodeStats

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]  # mlx-lm's: (history tokens, logits [1, V])


def draw_key(seed: int, position: int, purpose: str) -> mx.array:
    """The PRNG key of one draw: a function of (stream seed, output position, purpose) only."""
    digest = hashlib.blake2b(f"{seed}/{position}/{purpose}".encode(), digest_size=8).digest()
    return mx.random.key(int.from_bytes(digest, "little") >> 1)


@dataclass
class Stream:
    """One sequence: the request, then its decode state. ``draft=False`` keeps the row plain."""

    prompt: List[int]
    max_tokens: int
    sampling: Sampling = Sampling()
    seed: int = 0
    draft: bool = True
    processors: Sequence[LogitsProcessor] = ()
    eos: Sequence[int] = ()
    out: List[int] = field(default_factory=list)
    accepted: List[int] = field(default_factory=list)  # per step this row took part in: drafts kept, -1 = plain
    stats: DecodeStats = field(default_factory=DecodeStats)
    # the backbone states whose next token is known, as pieces (a pass's states [B, S, H], row, first n positions),
    # sliced only when the head reads them (``pending_states``): a step adds no per-row array op
    pend_h: list = field(default_factory=list)
    pend_t: List[int] = field(default_factory=list)  # those next tokens
    first_token_s: float = 0.0  # perf_counter when the first token was known
    done_s: float = 0.0

    @property
    def done(self) -> bool:
        return len(self.out) >= self.max_tokens or bool(self.out and self.out[-1] in self.eos)

    def history(self) -> List[int]:
        """Every token so far, the confirmed one last: what a processor sees for the next position."""
        return self.prompt + self.out


def pending_states(s: Stream) -> mx.array:
    """The stream's pending backbone states as one array [n, H]."""
    pieces = [states[row, :n] for states, row, n in s.pend_h]
    return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces)


def processed(s: Stream, logits: mx.array, history: mx.array) -> mx.array:
    """Logits [1, V] after the stream's processors, for the position right after ``history``."""
    for proc in s.processors:
        logits = proc(history, logits)
    return logits


def processed_positions(s: Stream, logits: mx.array, drafts: Optional[mx.array]) -> mx.array:
    """Verify logits [S, V] after the processors: position i sees the history plus drafts d_1..d_i.

    (The confirmed token is already the history's last entry; the verify input [t, d_1..] must not
    add it again.)"""
    if not s.processors:
        return logits
    base = mx.array(s.history())
    rows = [processed(s, logits[i:i + 1], base if i == 0 else mx.concatenate([base, drafts[:i]]))
            for i in range(logits.shape[0])]
    return mx.concatenate(rows)


@dataclass
class StepLog:
    """One step: which streams were in the batch and what each did (-1 = plain)."""

    streams: List[int]
    accepted: List[int]
    drafted: bool
    seconds: float
    after_join: bool = False  # rows joined just before: the head read whole prompts this step
    head_width: int = 0  # the most pending pairs one row's head read this step (0: the head did not run)
    built_before: bool = False  # a plain step built ahead during the last step (``seconds`` counts from its end)
    built_next: bool = False  # this step built the next one ahead

    @property
    def steady(self) -> bool:
        """Its time is one step's: not the first step of a pipelined stretch (which builds two graphs) or
        its last (whose graph was built and run during the step before)."""
        return self.built_before == self.built_next


def simple(s: Stream) -> bool:
    """A greedy row without logits processors: its decisions are argmaxes, batched with its neighbours'."""
    return s.sampling.greedy and not s.processors


def choose(sampling: Sampling, logits: mx.array, key: mx.array) -> mx.array:
    return sampling.sample(logits, key)


def decide(s: Stream, target: mx.array, drafts: Optional[mx.array], q: Optional[mx.array]):
    """(drafts kept, tokens [S]) for one row; tokens[kept] is the token emitted after the kept drafts.

    A plain row keeps none and draws from position 0. Keys depend on (stream, output position)."""
    key = draw_key(s.seed, len(s.out), "verify")
    if drafts is None:  # draw at position 0 only: the same draw whatever the pass length
        token = choose(s.sampling, target[:1], key)
        return mx.array(0), mx.concatenate([token, mx.zeros(target.shape[0] - 1, token.dtype)])
    if s.sampling.greedy:
        return accept_drafts(target, None, drafts, True)
    return accept_drafts(s.sampling.probs(target), q, drafts, False, key)


def emit(s: Stream, new: List[int], a: int, depth: int) -> None:
    """Append a step's tokens to the stream (cut at EOS and max_tokens) and count them."""
    s.accepted.append(a)
    st = s.stats
    st.steps += 1
    if a >= 0:
        for i in range(depth):
            st.proposed[i] += 1
            st.accepted[i] += 1 if i < a else 0
    for i, t in enumerate(new):
        if t in s.eos:
            new = new[: i + 1]
            break
    new = new[: s.max_tokens - len(s.out)]
    st.from_drafts += min(max(a, 0), len(new))
    s.out.extend(new)
    st.emitted = len(s.out)
