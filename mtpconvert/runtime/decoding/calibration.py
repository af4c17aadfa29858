"""Before a batch decodes: every pass shape run once (``warm_up``), and both kinds of step timed at each batch
size (``calibrate``), so that ``DraftPolicy``'s first decisions use measured costs rather than probes.

A backend that compiles per shape (MLX CUDA: a cuDNN graph per attention and per convolution shape, a kernel
per custom-kernel shape) would otherwise compile inside the decode whatever shape its trajectory meets first:
an ``auto`` decode, whose trajectory differs from any warm-up's, meets new ones as rows leave. Calibrating
runs the warm-up's shapes and then times, per batch size, stretches of pipelined plain steps and of drafting
steps, in which rows keep different numbers of drafts (a keep pattern, not the head's: the rows are the same
synthetic prompt, and the undo's per-row replay is part of a drafting step's cost).
"""

from __future__ import annotations

import time
from typing import List, Optional, Sequence

import mlx.core as mx

from .batched import CATCH_UP, BatchedMTP, decode_stream
from .draft_policy import Calibration
from .load import MTPModel
from .rowcache import RowKVCache
from .rows import StepLog, Stream

# per batch size: the head's catch-up passes (2 x CATCH_UP), its normal pass and chained drafts, the verify
# pass, a pipelined plain stretch (its first and last step), drafting again (a catch-up over the stretch)
WARM_STEPS = ((True, False), (True, False), (False, True), (False, False), (True, False), (True, False))


def _keep_pattern(sid: int, position: int) -> bool:
    """Rows keep drafts at alternate positions, neighbours out of phase: different accepts in every step."""
    return (sid + position) % 3 != 0


def _engine(m: MTPModel, depth: int, B: int, hidden: str, keep_hook=None, prompt_tokens: int = CATCH_UP + 1
            ) -> BatchedMTP:
    engine = BatchedMTP(m, depth, hidden, keep_hook=keep_hook)
    prompt = [1 + i % CATCH_UP for i in range(prompt_tokens)]  # the first draft catches up over 2 passes or more
    engine.add_many([Stream(list(prompt), 1 << 30, seed=r) for r in range(B)], list(range(B)))
    return engine


def warm_prompts(context: int) -> List[int]:
    """Prompt lengths whose ``WARM_STEPS`` meet every multi-token pass shape of a decode reaching ``context``
    keys: the first attention window's, then one per doubling of the window (``RowKVCache.window``) that a
    catch-up can reach, a prompt just past half of it, so the catch-up's last passes, the normal drafting
    step and the verify pass all read that window. Without them a drafting step after a plain stretch that
    crossed a window compiles inside the decode (on the H200 a catch-up past 256 keys took 3.8 s)."""
    lengths, window = [CATCH_UP + 1], 2 * RowKVCache.step
    while window // 2 < context:
        lengths.append(window // 2 + 1)
        window *= 2
    return lengths


def _visit(m: MTPModel, depth: int, B: int, hidden: str, prompt_tokens: int, leave: bool = False) -> BatchedMTP:
    """``WARM_STEPS`` over B rows; with ``leave`` (and B > 1) a row then leaves while the next plain step is built
    ahead, and the B - 1 rows left step plain and drafting: the gathers of the caches and of the step built ahead,
    which no decode of B rows that all end together runs (on the H200 the first auto decode whose row left early
    stalled 4 s at that step, once per machine)."""
    engine = _engine(m, depth, B, hidden, _keep_pattern, prompt_tokens)
    for draft, ahead in WARM_STEPS:
        engine.step(draft, ahead=ahead)
    if leave and B > 1:
        engine.step(False, ahead=True)
        engine.streams[0].max_tokens = len(engine.streams[0].out)
        engine.drop_finished()
        engine.step(False)
        engine.step(True)
    return engine


def warm_up(m: MTPModel, depth: int, rows: int, hidden: str = "post-norm", context: int = 0) -> List[StepLog]:
    """Run, once, every pass shape a batch of 1 .. ``rows`` rows meets while decoding (prefill aside) up to
    ``context`` keys (``warm_prompts``; 0: the first attention window only), rows keeping different numbers of
    drafts (``WARM_STEPS``) and one leaving (``_visit``). The decode that follows then compiles nothing, whatever
    its mix of drafting and plain steps and however rows leave. Returns the steps' logs."""
    log: List[StepLog] = []
    with mx.stream(decode_stream()):
        for B in range(1, rows + 1):
            for prompt_tokens in warm_prompts(context):
                engine = _visit(m, depth, B, hidden, prompt_tokens, leave=True)
                mx.eval([c.state for c in engine.cache + engine.head_cache])
                log.extend(engine.log)
    return log


def calibrate(m: MTPModel, depth: int, rows: int, hidden: str = "post-norm", steps: int = 4,
              sizes: Optional[Sequence[int]] = None, context: int = 0) -> Calibration:
    """``warm_up``'s shapes (up to ``context`` keys), then at each batch size of ``sizes`` (default 1 .. ``rows``) two rounds of
    ``steps`` + 2 pipelined plain steps and ``steps`` + 1 drafting steps, timed as the policy times a step
    (the first and last of a plain stretch and the first drafting step after it are not step costs):
    2 x ``steps`` timings of each kind per batch size. Returns them with how long calibrating took."""
    t0 = time.perf_counter()
    cal = Calibration(depth)
    with mx.stream(decode_stream()):
        for B in sorted(set(sizes or range(1, rows + 1))):
            for prompt_tokens in warm_prompts(context):
                mx.eval([c.state for c in _visit(m, depth, B, hidden, prompt_tokens, leave=True).cache])
            engine = _visit(m, depth, B, hidden, CATCH_UP + 1)
            timed_from = len(engine.log)
            for _ in range(2):
                for i in range(steps + 2):
                    engine.step(False, ahead=i <= steps)
                for _ in range(steps + 1):
                    engine.step(True)
            for previous, record in zip(engine.log[timed_from - 1:], engine.log[timed_from:]):
                cal.add(record, previous)
    cal.wall_s = time.perf_counter() - t0
    return cal
