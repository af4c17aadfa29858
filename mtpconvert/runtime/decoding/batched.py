"""Batched MTP decoding: B streams in one step, each row drafting or plain.

One step over the rows in the batch (every row has N_r tokens in its caches and its confirmed
token t_r not yet fed):

1. draft   (only when some row drafts) the head reads every row's pending pairs in one padded
           call — rows that run plain this step read theirs too, so the head's cache stays one
           entry per backbone position in every row — and chains k-1 more proposals; the head's
           ``RowKVCache`` then drops each row's padding and, after the step, its k-1 chained entries.
2. verify  one (B, k+1) backbone pass: drafting rows feed [t_r, d_1..d_k]; plain rows feed t_r
           followed by k tokens whose results are dropped. When no row drafts this is the plain
           (B, 1) step, and then the head does not run at all (pending pairs accumulate).
3. decide  per row on device: logits processors on the row's own history (prompt, emitted tokens,
           then the drafts before each position), then greedy or sampled acceptance
           (``sampling.accept_drafts``) for drafting rows, a plain draw for plain rows. One
           ``mx.eval`` for the whole batch: the step's only host sync.
4. undo    row r keeps a_r + 1 positions: ``rowcache.undo_rows`` trims full-attention rows and
           replays linear attention per row from the pass's saved inputs.

Random draws are keyed by (stream seed, output position, purpose) only, so a row's draws do not
depend on the other rows, on when it joined, or on how the steps were cut.
Rows join (prefilled alone, caches appended) and leave (caches filtered) between steps.
``run_batch`` drives the steps; in its "auto" mode ``DraftPolicy`` decides before each step whether
the rows draft, from the step times it has measured at that batch size.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from .load import MTPModel
from .rowcache import RowKVCache, make_row_cache, undo_rows
from .sampling import Sampling, accept_drafts, categorical
from .speculative import DecodeStats, backbone_forward, prepare_speculative

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
    pend_h: Optional[mx.array] = None  # [p, H] backbone states whose next token is known
    pend_t: List[int] = field(default_factory=list)  # those next tokens
    first_token_s: float = 0.0  # perf_counter when the first token was known
    done_s: float = 0.0

    @property
    def done(self) -> bool:
        return len(self.out) >= self.max_tokens or bool(self.out and self.out[-1] in self.eos)

    def history(self) -> List[int]:
        """Every token so far, the confirmed one last: what a processor sees for the next position."""
        return self.prompt + self.out


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


def head_pass_width(pending: int, depth: int) -> int:
    """Padded length of the head's pass over the rows' pending pairs. A normal step has at most
    depth + 1; a catch-up (the first draft after plain steps, or after a join) can have any
    number, and each new shape costs a kernel compile on a GPU backend (~50-100 ms on MLX CUDA,
    tens of plain steps), so catch-ups are padded to a power of two: few shapes, at most 2x the work."""
    if pending <= depth + 1:
        return pending
    return 1 << (pending - 1).bit_length()


class BatchedMTP:
    """The batch: its streams, one set of row caches, and ``step``."""

    def __init__(self, m: MTPModel, depth: int = 1, hidden: str = "post-norm"):
        prepare_speculative(m, depth, hidden)
        self.m, self.depth, self.pick = m, depth, 0 if hidden == "pre-norm" else 1
        self.streams: List[Stream] = []
        self.ids: List[int] = []  # caller's id of each row
        self.cache: Optional[list] = None
        self.head_cache: Optional[List[RowKVCache]] = None
        self.log: List[StepLog] = []
        self.joined = False  # rows joined since the last step

    # ------------------------------------------------------------------ membership

    def add(self, s: Stream, sid: int) -> None:
        self.add_many([s], [sid])

    def add_many(self, streams: Sequence[Stream], sids: Sequence[int]) -> None:
        """Prefill new streams, sample their first tokens, and append their rows to the batch.

        Streams whose prompts have the same length are prefilled together in one (G, P) pass: every
        row at the same length, so it is the stock batched forward with no padding."""
        by_length: dict = {}
        for s, sid in zip(streams, sids):
            by_length.setdefault(len(s.prompt), []).append((s, sid))
        for group in by_length.values():
            self._prefill([s for s, _ in group], [sid for _, sid in group])

    def _prefill(self, streams: List[Stream], sids: List[int]) -> None:
        m = self.m
        t0 = time.perf_counter()
        cache = make_row_cache(m.model, max_pass=self.depth + 1, rows=len(streams))
        prompts = mx.array([s.prompt for s in streams])
        states = backbone_forward(m, prompts, cache)
        last = m.logits(states[1][:, -1])  # [G, V]
        first = mx.concatenate([
            choose(s.sampling, processed(s, last[r:r + 1], prompts[r]), draw_key(s.seed, 0, "verify"))
            for r, s in enumerate(streams)])
        mx.eval(first)
        now = time.perf_counter()
        for r, (s, tok) in enumerate(zip(streams, first.tolist())):
            s.out = [tok]
            s.stats = DecodeStats(depth=self.depth, prompt_tokens=len(s.prompt), proposed=[0] * self.depth,
                                  accepted=[0] * self.depth, prefill_s=now - t0)
            s.pend_h, s.pend_t = states[self.pick][r], s.prompt[1:] + s.out
            s.first_token_s = now
        if self.cache is None:
            self.cache = cache
            self.head_cache = [RowKVCache([]) for _ in m.head.layers]
        else:
            for mine, new in zip(self.cache, cache):
                mine.extend(new)
        for c in self.head_cache:  # empty until the row's first draft reads its pending pairs (the prompt)
            for _ in streams:
                c.add_empty_row()
        self.streams.extend(streams)
        self.ids.extend(sids)
        self.joined = True

    def drop_finished(self) -> List[int]:
        """Remove the streams that are done; return their ids."""
        keep = [i for i, s in enumerate(self.streams) if not s.done]
        gone = [self.ids[i] for i, s in enumerate(self.streams) if s.done]
        for s in self.streams:
            if s.done and not s.done_s:
                s.done_s = time.perf_counter()
        if not keep:
            self.cache = self.head_cache = None
        elif len(keep) < len(self.streams):
            for c in self.cache + self.head_cache:
                c.filter(keep)
        self.streams = [self.streams[i] for i in keep]
        self.ids = [self.ids[i] for i in keep]
        return gone

    # ------------------------------------------------------------------ one step

    def step(self, draft: bool = True) -> StepLog:
        """One batched step; ``draft=False`` runs every row plain (the plain batched engine)."""
        t0 = time.perf_counter()
        m, k, rows = self.m, self.depth, self.streams
        drafting = [draft and s.draft for s in rows]
        any_draft = any(drafting)
        S = k + 1 if any_draft else 1
        confirmed = mx.array([[s.out[-1]] for s in rows])
        head_width = max(len(s.pend_t) for s in rows) if any_draft else 0
        drafts, q = (self._draft(drafting) if any_draft else (None, None))
        verify_in = mx.concatenate([confirmed, drafts], axis=1) if any_draft else confirmed
        states = backbone_forward(m, verify_in, self.cache)
        logits = m.logits(states[1])  # [B, S, V]
        n_acc, next_tokens = [], []
        for r, s in enumerate(rows):
            target = processed_positions(s, logits[r], drafts[r] if any_draft else None)
            a, nxt = decide(s, target, drafts[r] if drafting[r] else None, q[r] if drafting[r] else None)
            n_acc.append(a)
            next_tokens.append(nxt)
        n_acc, next_tokens = mx.stack(n_acc), mx.stack(next_tokens)
        mx.eval(n_acc, next_tokens, drafts if any_draft else n_acc)  # the step's one host sync
        accepted = n_acc.tolist()
        next_list = next_tokens.tolist()
        draft_list = drafts.tolist() if any_draft else None

        keep = [a + 1 for a in accepted]
        undo_rows(self.cache, keep, S)
        if any_draft and k > 1:
            self.head_cache[0].trim_rows([k - 1] * len(rows))
        for r, s in enumerate(rows):
            a = accepted[r]
            new = (draft_list[r][:a] if a else []) + [next_list[r][a]]
            h = states[self.pick][r, :a + 1]
            if any_draft:  # the head read the old pending pairs this step
                s.pend_h, s.pend_t = h, list(new)
            else:
                s.pend_h, s.pend_t = mx.concatenate([s.pend_h, h]), s.pend_t + new
            emit(s, new, a if drafting[r] else -1, k)
        record = StepLog(list(self.ids), [a if d else -1 for a, d in zip(accepted, drafting)], any_draft,
                         time.perf_counter() - t0, after_join=self.joined, head_width=head_width)
        self.joined = self.joined and not any_draft  # until the head has read the new prompts
        self.log.append(record)
        return record

    def _draft(self, drafting: List[bool]):
        """Head pass over every row's pending pairs, then k-1 chained proposals. Returns
        (drafts [B, k], per-row draft distributions [k, V] or None for greedy/plain rows)."""
        m, k, rows = self.m, self.depth, self.streams
        counts = [len(s.pend_t) for s in rows]
        width = head_pass_width(max(counts), k)
        hidden = mx.stack([mx.pad(s.pend_h, [(0, width - n), (0, 0)]) for s, n in zip(rows, counts)])
        nexts = mx.array([s.pend_t + [0] * (width - n) for s, n in zip(rows, counts)])
        x = m.head(hidden, m.embed(nexts), self.head_cache)  # [B, width, H]
        self.head_cache[0].trim_rows([width - n for n in counts])
        last = mx.array([n - 1 for n in counts])[:, None, None]
        x = mx.take_along_axis(x, last, axis=1)  # [B, 1, H]: each row's last pending position
        cols, q_rows = [], [[] for _ in rows]
        for j in range(k):
            if j:
                x = m.head(x, m.embed(cols[-1][:, None]), self.head_cache)
            draft_logits = m.logits(x)[:, -1]  # [B, V]
            col = []
            for r, s in enumerate(rows):
                lg = draft_logits[r:r + 1]
                if s.processors:
                    prior = mx.array(s.history())
                    lg = processed(s, lg, prior if j == 0 else mx.concatenate([prior, mx.stack([c[r] for c in cols])]))
                if s.sampling.greedy or not drafting[r]:
                    col.append(mx.argmax(lg[0], axis=-1))
                else:
                    q_rows[r].append(s.sampling.probs(lg[0]))
                    col.append(categorical(q_rows[r][-1], draw_key(s.seed, len(s.out) + j, "draft")))
            cols.append(mx.stack(col))
        q = [mx.stack(qr) if qr else None for qr in q_rows]
        return mx.stack(cols, axis=1), q


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


class DraftPolicy:
    """Draft a step only when drafting is measured to emit more tokens per second at this batch size.

    Measures, per batch size B, the wall time of a drafting step and of a plain step
    (``StepLog.seconds``: device work plus the host sync and bookkeeping) and the tokens a drafting
    row emits per drafting step (1 + accepted drafts, moving average over all rows). A kind's cost
    is the fastest of its last ``window`` timed steps: a slow outlier is a first-time kernel
    compile (MLX's CUDA backend compiles each new shape) or other load, never the step's own cost,
    and steps whose head read more than one step's pending pairs (after a join, or the first draft
    after a plain stretch, which reads the whole stretch) are not timed at all. With n of B rows
    drafting it predicts (n * tokens_per_row + B - n) / t_draft against B / t_plain and drafts
    when the first is larger. Each kind is timed ``probe_steps`` times at a new B before
    predicting; after that the losing kind is probed for ``probe_steps`` steps so its cost and the
    acceptance stay current, first after ``reprobe`` decisions, then at doubling intervals (up to
    ``max_interval``) while the same kind keeps losing.
    """

    def __init__(self, reprobe: int = 16, max_interval: int = 256, smoothing: float = 0.3, window: int = 8,
                 probe_steps: int = 3):
        self.reprobe, self.max_interval, self.smoothing = reprobe, max_interval, smoothing
        self.window, self.probe_steps = window, probe_steps
        self.timed: Dict[Tuple[int, bool], Deque[float]] = {}
        self.tokens_per_row: Optional[float] = None
        self.decisions = 0
        self.interval = reprobe
        self.next_probe = reprobe
        self.probing = 0  # steps left of the current probe
        self.last_winner: Optional[bool] = None

    def seconds(self, B: int, drafted: bool) -> Optional[float]:
        """The step cost of one kind at batch size B, or None until it was timed ``probe_steps`` times."""
        times = self.timed.get((B, drafted))
        return min(times) if times and len(times) >= min(self.probe_steps, self.window) else None

    def predicted_rates(self, B: int, drafting: int) -> Optional[Tuple[float, float]]:
        """(drafting tok/s, plain tok/s) at batch size B, or None until both kinds were measured."""
        t_draft, t_plain = self.seconds(B, True), self.seconds(B, False)
        if t_draft is None or t_plain is None or self.tokens_per_row is None:
            return None
        return (drafting * self.tokens_per_row + B - drafting) / t_draft, B / t_plain

    def choose(self, engine: BatchedMTP) -> bool:
        B = len(engine.streams)
        drafting = sum(s.draft for s in engine.streams)
        if not drafting:
            return False
        if self.seconds(B, True) is None or self.tokens_per_row is None:
            return True
        if self.seconds(B, False) is None:
            return False
        draft_rate, plain_rate = self.predicted_rates(B, drafting)
        self.decisions += 1
        better = draft_rate > plain_rate
        if better != self.last_winner:  # the winner changed: probe soon again
            self.interval, self.next_probe = self.reprobe, self.decisions + self.reprobe
            self.last_winner = better
        if self.probing:
            self.probing -= 1
            return not better
        if self.decisions >= self.next_probe:
            self.interval = min(2 * self.interval, self.max_interval)
            self.next_probe = self.decisions + self.interval
            self.probing = self.probe_steps - 1
            return not better
        return better

    def observe(self, engine: BatchedMTP, record: StepLog) -> None:
        if record.head_width <= engine.depth + 1 and not record.after_join:
            times = self.timed.setdefault((len(record.streams), record.drafted), deque(maxlen=self.window))
            times.append(record.seconds)
        kept = [a for a in record.accepted if a >= 0]
        if record.drafted and kept:
            new = 1 + sum(kept) / len(kept)
            old = self.tokens_per_row
            self.tokens_per_row = new if old is None else old + self.smoothing * (new - old)


def run_batch(
    m: MTPModel, streams: Sequence[Stream], depth: int = 1, mode: str = "mtp", join_at: Optional[Sequence[int]] = None,
    hidden: str = "post-norm", policy=None,
) -> BatchedMTP:
    """Decode ``streams`` together until all are done. Stream i joins before step ``join_at[i]``
    (default 0) and leaves after the step that finishes it. ``mode``: "mtp" (rows draft as their
    ``draft`` flag says), "plain" (no row drafts: the plain batched engine), "auto" (``policy``
    decides per step). Returns the engine (its ``log``; the streams hold their tokens)."""
    if mode not in ("mtp", "plain", "auto"):
        raise ValueError(f"mode must be mtp, plain or auto, not {mode!r}")
    if mode == "auto" and policy is None:
        policy = DraftPolicy()
    engine = BatchedMTP(m, depth, hidden)
    join_at = list(join_at) if join_at is not None else [0] * len(streams)
    waiting = sorted(range(len(streams)), key=lambda i: join_at[i])
    step = 0
    while waiting or engine.streams:
        joining = []
        while waiting and join_at[waiting[0]] <= step:
            joining.append(waiting.pop(0))
        if joining:
            engine.add_many([streams[i] for i in joining], joining)
            engine.drop_finished()  # max_tokens 1, or EOS as the first token
        if engine.streams:
            draft = mode == "mtp" or (mode == "auto" and policy.choose(engine))
            record = engine.step(draft)
            if policy is not None:
                policy.observe(engine, record)
            engine.drop_finished()
        step += 1
    return engine
