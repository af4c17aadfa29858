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
3. decide  on device: greedy rows without processors in one batched argmax; others per row, logits
           processors on the row's own history (prompt, emitted tokens, then the drafts before each
           position), then greedy or sampled acceptance (``sampling.accept_drafts``) for drafting
           rows, a plain draw for plain rows. One ``mx.eval`` for the whole batch: the step's only
           host sync.
4. undo    row r keeps a_r + 1 positions: ``rowcache.undo_rows`` trims full-attention rows and
           replays linear attention per row from the pass's saved inputs.

A plain step followed by another plain step over the same rows is pipelined as in mlx-lm's
``BatchGenerator``: the next step's graph is built from this step's lazy tokens and started before
this step's tokens are read (``step(ahead=True)``). Every pass takes one of few shapes (the
caches' key windows, ``head_passes``), since MLX's CUDA backend builds a cuDNN graph per shape;
``calibration.warm_up`` runs each once.

Random draws are keyed by (stream seed, output position, purpose) only, so a row's draws do not
depend on the other rows, on when it joined, or on how the steps were cut.
Rows join (the joining prompts prefilled in one padded pass, caches appended) and leave (caches filtered)
between steps.
``run_batch`` drives the steps; in its "auto" mode ``DraftPolicy`` decides before each step whether
the rows draft, from the step times it has measured at that batch size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from .draft_policy import DraftPolicy
from .load import MTPModel
from .rowcache import RowKVCache, row_caches_like, undo_rows
from .rows import (StepLog, Stream, choose, decide, draw_key, emit, pending_states, processed, processed_positions,
                   simple)
from .sampling import categorical
from .speculative import DecodeStats, linear_states, prepare_speculative

CATCH_UP = 32  # width of each head pass of a catch-up (see ``head_passes``)


def head_passes(pending: int, depth: int) -> Tuple[int, int]:
    """(passes, width) of the head's read of the rows' pending pairs. MLX's CUDA backend builds a
    cuDNN graph for every new shape of an attention over several queries and of a convolution
    (45-260 ms each, tens of plain steps), so the head meets two widths only: a normal step (at most
    depth + 1 pending pairs per row) is one pass of depth + 1, padded; a catch-up (the first draft
    after plain steps, or after a join: any number) runs as passes of ``CATCH_UP``, the last padded."""
    if pending <= depth + 1:
        return 1, depth + 1
    return -(-pending // CATCH_UP), CATCH_UP


class BatchedMTP:
    """The batch: its streams, one set of row caches, and ``step``."""

    def __init__(self, m: MTPModel, depth: int = 1, hidden: str = "post-norm", keep_hook=None):
        if not m.family.capabilities.batched:
            raise ValueError(f"batched MTP does not run the {m.family.name} family ({m.family.head.forward} head): "
                             f"it decodes one stream at a time")
        prepare_speculative(m, depth, hidden)
        self.m, self.depth, self.pick = m, depth, 0 if hidden == "pre-norm" else 1
        # keep_hook(stream id, output position) -> bool: whether a greedy row's draft at that position is
        # kept, in place of its comparison with the verify pass's token (measure/oracle.py's KeepOracle)
        self.keep_hook = keep_hook
        self.streams: List[Stream] = []
        self.ids: List[int] = []  # caller's id of each row
        self.cache: Optional[list] = None
        self.head_cache: Optional[List[RowKVCache]] = None
        self.log: List[StepLog] = []
        self.joined = False  # rows joined since the last step
        self.ahead: Optional[PlainStep] = None  # the next plain step, built before this one's tokens were read
        self.last_end = 0.0  # perf_counter when the last step returned

    # ------------------------------------------------------------------ membership

    def add(self, s: Stream, sid: int) -> None:
        self.add_many([s], [sid])

    def add_many(self, streams: Sequence[Stream], sids: Sequence[int]) -> None:
        """Prefill new streams, sample their first tokens, and append their rows to the batch.

        The prompts go through the backbone in one (G, P) pass, as BatchGenerator prefills a batch: a
        prompt shorter than the longest is padded after its end, which no earlier position attends to,
        and each row's padding is then undone as a rejected draft is (``undo_rows``: attention rows
        trimmed, a recurrent layer's state replayed to the row's last prompt token). On a launch-bound
        device one pass per prompt length cost what tens of decode steps do. A backbone whose recurrent
        caches would keep a state per padded position (``Backbone.pads_prefill``) prefills one prompt
        length at a time."""
        if self.m.backbone.pads_prefill:
            self._prefill(list(streams), list(sids))
            return
        by_length: dict = {}
        for s, sid in zip(streams, sids):
            by_length.setdefault(len(s.prompt), []).append((s, sid))
        for group in by_length.values():
            self._prefill([s for s, _ in group], [sid for _, sid in group])

    def _prefill(self, streams: List[Stream], sids: List[int]) -> None:
        if self.ahead is not None:
            raise RuntimeError("a plain step was built ahead for the current rows: run it before rows join")
        m = self.m
        t0 = time.perf_counter()
        lengths = [len(s.prompt) for s in streams]
        longest = max(lengths)
        padded = min(lengths) < longest
        # a padded pass is undone like a verify pass, so its recurrent layers record it
        cache = m.backbone.row_cache(max_pass=max(self.depth + 1, longest if padded else 0), rows=len(streams))
        prompts = mx.array([s.prompt + [0] * (longest - n) for s, n in zip(streams, lengths)])
        states = m.backbone.forward(prompts, cache)
        if padded:
            undo_rows(cache, lengths, longest)
            at = mx.array([n - 1 for n in lengths]).reshape((-1,) + (1,) * (states[1].ndim - 1))
            last = mx.take_along_axis(states[1], at, axis=1)[:, 0]
        else:
            last = states[1][:, -1]
        last = m.logits(last)  # [G, V]
        first = mx.concatenate([
            choose(s.sampling, processed(s, last[r:r + 1], prompts[r, :lengths[r]]), draw_key(s.seed, 0, "verify"))
            for r, s in enumerate(streams)])
        mx.eval(first)
        now = time.perf_counter()
        for r, (s, tok) in enumerate(zip(streams, first.tolist())):
            s.out = [tok]
            s.stats = DecodeStats(depth=self.depth, prompt_tokens=len(s.prompt), proposed=[0] * self.depth,
                                  accepted=[0] * self.depth, prefill_s=now - t0)
            s.pend_h, s.pend_t = [(states[self.pick], r, len(s.prompt))], s.prompt[1:] + s.out
            s.first_token_s = now
        if self.cache is None:
            self.cache = cache
            # the head's attention kind, per row: twins of mlx-lm's caches, or the head's own per-row kind
            row_cache = getattr(m.head, "row_cache", None)
            self.head_cache = row_cache(0) if row_cache else row_caches_like(m.head.make_cache(), 0)
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
            self.cache = self.head_cache = self.ahead = None
        elif len(keep) < len(self.streams):
            for c in self.cache + self.head_cache:
                c.filter(keep)
            if self.ahead is not None:
                self.ahead = self.ahead.rows(keep)
        self.streams = [self.streams[i] for i in keep]
        self.ids = [self.ids[i] for i in keep]
        return gone

    # ------------------------------------------------------------------ one step

    def step(self, draft: bool = True, ahead: bool = False) -> StepLog:
        """One batched step; ``draft=False`` runs every row plain (the plain batched engine).

        ``ahead=True`` on a plain step: the next step will be plain too, over the same rows (only
        rows that finish may leave before it), so its graph is built from this step's tokens while
        they are still lazy and started before this step's are read (``mx.async_eval``), as mlx-lm's
        ``BatchGenerator`` does: the device never waits for the host's bookkeeping. The next call
        must then be a plain step."""
        t0 = time.perf_counter()
        rows = self.streams
        drafting = [draft and s.draft for s in rows]
        built_before = self.ahead is not None
        if built_before:
            if any(drafting):
                raise RuntimeError("a plain step was built ahead: the next step must be plain")
            current, self.ahead, t0 = self.ahead, None, self.last_end
        elif any(drafting):
            return self._drafting_step(drafting, t0)
        else:
            current = self._plain_graph(mx.array([[s.out[-1]] for s in rows]), 0)
            if ahead:
                mx.async_eval(current.tokens)
        if ahead:
            self.ahead = self._plain_graph(current.tokens[:, None], 1)
            mx.async_eval(self.ahead.tokens)
        tokens = current.tokens.tolist()  # the step's one host sync
        for r, (s, t) in enumerate(zip(rows, tokens)):
            s.pend_h.append((current.h, r, 1))
            s.pend_t.append(t)
            emit(s, [t], -1, self.depth)
        record = self._record([-1] * len(rows), False, t0, 0)
        record.built_before, record.built_next = built_before, ahead
        return record

    def _plain_graph(self, fed: mx.array, after: int) -> "PlainStep":
        """The lazy graph of a plain step feeding ``fed`` [B, 1]: each row's next token and the fed
        position's state. ``after`` = 1 when ``fed`` is the lazy output of a step whose tokens are not
        in the streams yet (histories and draw positions then count it)."""
        m, rows = self.m, self.streams
        states = m.backbone.forward(fed, self.cache)
        logits = m.logits(states[1][:, 0])  # [B, V]
        if all(simple(s) for s in rows):  # greedy, no processors: one argmax for the batch
            tokens = mx.argmax(logits, axis=-1)
        else:
            tokens = []
            for r, s in enumerate(rows):
                history = mx.array(s.history()) if s.processors else None
                if after and s.processors:
                    history = mx.concatenate([history, fed[r, :1].astype(history.dtype)])
                key = draw_key(s.seed, len(s.out) + after, "verify")
                tokens.append(choose(s.sampling, processed(s, logits[r:r + 1], history), key))
            tokens = mx.concatenate(tokens)
        return PlainStep(tokens, states[self.pick][:, :1])

    def _drafting_step(self, drafting: List[bool], t0: float) -> StepLog:
        m, k, rows = self.m, self.depth, self.streams
        S = k + 1
        confirmed = mx.array([[s.out[-1]] for s in rows])
        head_width = max(len(s.pend_t) for s in rows)
        drafts, q = self._draft(drafting)
        mx.async_eval(drafts)  # the device runs the head while the verify pass's graph is built
        states = m.backbone.forward(mx.concatenate([confirmed, drafts], axis=1), self.cache)
        logits = m.logits(states[1])  # [B, S, V]
        if all(simple(s) for s in rows):  # greedy, no processors: the decision is batched
            next_tokens = mx.argmax(logits, axis=-1)  # [B, S]
            if self.keep_hook is None:
                ok = (drafts == next_tokens[:, :k]) & mx.array(drafting)[:, None]
            else:
                ok = mx.array([[drafting[r] and bool(self.keep_hook(self.ids[r], len(s.out) + j)) for j in range(k)]
                               for r, s in enumerate(rows)])
            n_acc = mx.sum(mx.cumprod(ok.astype(mx.int32), axis=1), axis=1)
        elif self.keep_hook is not None:
            raise ValueError("keep_hook decides greedy rows without logits processors only")
        else:
            n_acc, next_tokens = [], []
            for r, s in enumerate(rows):
                target = processed_positions(s, logits[r], drafts[r])
                a, nxt = decide(s, target, drafts[r] if drafting[r] else None, q[r] if drafting[r] else None)
                n_acc.append(a)
                next_tokens.append(nxt)
            n_acc, next_tokens = mx.stack(n_acc), mx.stack(next_tokens)
        mx.eval(n_acc, next_tokens, drafts)  # the step's one host sync
        accepted = n_acc.tolist()
        next_list = next_tokens.tolist()
        draft_list = drafts.tolist()

        keep = [a + 1 for a in accepted]
        undo_rows(self.cache, keep, S)
        if min(keep) < S:  # the linear layers' replay runs while the bookkeeping and the next graph are built
            mx.async_eval(linear_states(self.cache))
        if k > 1:
            self.head_cache[0].trim_rows([k - 1] * len(rows))
        for r, s in enumerate(rows):  # the head read the old pending pairs this step
            a = accepted[r]
            new = draft_list[r][:a] + [next_list[r][a]]
            s.pend_h, s.pend_t = [(states[self.pick], r, a + 1)], list(new)
            emit(s, new, a if drafting[r] else -1, k)
        return self._record([a if d else -1 for a, d in zip(accepted, drafting)], True, t0, head_width)

    def _record(self, accepted: List[int], drafted: bool, t0: float, head_width: int) -> StepLog:
        self.last_end = time.perf_counter()
        record = StepLog(list(self.ids), accepted, drafted, self.last_end - t0, after_join=self.joined,
                         head_width=head_width)
        self.joined = self.joined and not drafted  # until the head has read the new prompts
        self.log.append(record)
        return record

    def _draft(self, drafting: List[bool]):
        """Head pass over every row's pending pairs, then k-1 chained proposals. Returns
        (drafts [B, k], per-row draft distributions [k, V] or None for greedy/plain rows)."""
        m, k, rows = self.m, self.depth, self.streams
        counts = [len(s.pend_t) for s in rows]
        passes, width = head_passes(max(counts), k)
        total = passes * width
        pending = [pending_states(s) for s in rows]
        # a state per position: [n, H], or [n, streams, H] where the backbone keeps several (hyper-connections)
        hidden = mx.stack([mx.pad(h, [(0, total - n)] + [(0, 0)] * (h.ndim - 1)) if n < total else h
                           for h, n in zip(pending, counts)])
        nexts = mx.array([s.pend_t + [0] * (total - n) for s, n in zip(rows, counts)])
        outs = []
        for i in range(passes):  # each pass writes `width` positions per row, then drops the row's padding
            cut = slice(i * width, (i + 1) * width)
            outs.append(m.head(hidden[:, cut], m.embed(nexts[:, cut]), self.head_cache))  # [B, width, H]
            self.head_cache[0].trim_rows([width - min(max(n - i * width, 0), width) for n in counts])
        x = outs[0] if passes == 1 else mx.concatenate(outs, axis=1)
        if min(counts) < total:
            last = mx.array([n - 1 for n in counts]).reshape((-1,) + (1,) * (x.ndim - 1))
            x = mx.take_along_axis(x, last, axis=1)  # [B, 1, ...]: each row's last pending position
        else:
            x = x[:, -1:]
        batched = all(simple(s) for s in rows)
        cols, q_rows = [], [[] for _ in rows]
        for j in range(k):
            if j:
                x = m.head(x, m.embed(cols[-1][:, None]), self.head_cache)
            draft_logits = m.draft_logits(x)[:, -1]  # [B, V]
            if batched:
                cols.append(mx.argmax(draft_logits, axis=-1))
                continue
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


@dataclass
class PlainStep:
    """A plain step's lazy results: each row's next token [B] and the fed position's state [B, 1, H]."""

    tokens: mx.array
    h: mx.array

    def rows(self, keep: Sequence[int]) -> "PlainStep":
        idx = mx.array(list(keep))
        return PlainStep(self.tokens[idx], self.h[idx])


def run_batch(
    m: MTPModel, streams: Sequence[Stream], depth: int = 1, mode: str = "mtp", join_at: Optional[Sequence[int]] = None,
    hidden: str = "post-norm", policy=None, keep_hook=None, stream=None,
) -> BatchedMTP:
    """Decode ``streams`` together until all are done. Stream i joins before step ``join_at[i]``
    (default 0) and leaves after the step that finishes it. ``mode``: "mtp" (rows draft as their
    ``draft`` flag says), "plain" (no row drafts: the plain batched engine), "auto" (``policy``
    decides per step). ``keep_hook``: see ``BatchedMTP``. ``stream``: the MLX stream the decode runs on
    (default mlx-lm's ``generation_stream``, BatchGenerator's). Returns the engine (its ``log``; the streams
    hold their tokens)."""
    if mode not in ("mtp", "plain", "auto"):
        raise ValueError(f"mode must be mtp, plain or auto, not {mode!r}")
    if mode == "auto" and policy is None:
        policy = DraftPolicy()
    engine = BatchedMTP(m, depth, hidden, keep_hook=keep_hook)
    join_at = list(join_at) if join_at is not None else [0] * len(streams)
    with mx.stream(stream if stream is not None else decode_stream()):
        _drive(engine, streams, join_at, mode, policy)
    return engine


def decode_stream():
    """The MLX stream batched decoding runs on: mlx-lm's ``generation_stream``, the one BatchGenerator runs on."""
    from mlx_lm.generate import generation_stream

    return generation_stream


def _drive(engine: BatchedMTP, streams: Sequence[Stream], join_at: List[int], mode: str, policy) -> None:
    waiting = sorted(range(len(streams)), key=lambda i: join_at[i])
    step, decided = 0, None  # decided: the policy's choice for this step, made during the last one
    while waiting or engine.streams:
        joining = []
        while waiting and join_at[waiting[0]] <= step:
            joining.append(waiting.pop(0))
        if joining:
            engine.add_many([streams[i] for i in joining], joining)
            engine.drop_finished()  # max_tokens 1, or EOS as the first token
        if engine.streams:
            if mode == "auto":
                draft = policy.choose(engine) if decided is None else decided
            else:
                draft = mode == "mtp"
            # a plain step followed by another plain step over the same rows builds that one before
            # reading its own tokens (``BatchedMTP.step``'s ahead): in auto mode the policy decides
            # the next step now, one step's observation earlier than it otherwise would
            ahead, decided = False, None
            if not draft and not (waiting and join_at[waiting[0]] <= step + 1) and any(
                    len(s.out) + 1 < s.max_tokens for s in engine.streams):
                if mode == "auto":
                    decided = policy.choose(engine)
                ahead = mode == "plain" or (mode == "auto" and not decided)
            record = engine.step(draft, ahead=ahead)
            if policy is not None:
                policy.observe(engine, record)
            engine.drop_finished()
            if not engine.streams:
                decided = None
        step += 1
