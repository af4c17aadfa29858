"""`mtpconvert bench --concurrency`: batched MTP against plain batched decoding.

For each concurrency C (and depth k), C streams start together and decode ``max_tokens`` each with:

``batchgen``  mlx-lm's ``BatchGenerator``: the plain batched baseline every speedup divides by;
``plain``     our batched engine with drafting off (the "same composition" reference);
``mtp``       our batched engine, every row drafting every step;
``auto``      our batched engine under ``batched.DraftPolicy``, which turns drafting off for a step when
              it measures that drafting loses at this batch size.

Throughput is decode throughput: tokens after each stream's first one, over the time from the last
stream's first token to the last stream's end (prefill excluded for every decoder alike).
Aggregate tok/s counts all streams; per-stream tok/s is each stream's own tokens over its own
decode time, averaged. All decoders run in one process, interleaved per concurrency, after an
untimed warm-up of each (kernels compile per shape; ``calibration.calibrate`` first runs every pass shape
of 1 .. C rows up to the longest context, since `auto`'s trajectory differs from any warm-up's, and times both
kinds at each). With
``rounds`` > 1 the timed runs repeat, interleaved in a balanced order (``round_order``: over as many
rounds as decoders each runs first once and follows each other decoder once), and each decoder
reports its median round (every round's aggregate tok/s is kept): on a shared machine one round
moves by tens of percent. Before every timed run the garbage is collected and
MLX's buffer cache cleared, so no run pays for the one before. The ``auto`` policy starts from the
calibration (no untimed run: its first timed round is its first decode) and is kept across rounds, as a
server keeps it.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx

from ...progress import Counter, Progress
from ..decoding.batched import Stream, run_batch
from ..decoding.calibration import calibrate
from ..decoding.draft_policy import DraftPolicy
from ..decoding.load import MTPModel
from ..decoding.sampling import Sampling
from .baseline import mlx_lm_sampler

BASELINE = "mlx_lm.generate.BatchGenerator"


@dataclass
class DecoderRun:
    """One decoder over the C streams of one concurrency level."""

    tokens: List[List[int]]
    first_s: List[float]  # perf_counter of each stream's first token
    done_s: List[float]  # perf_counter of each stream's last token
    steps: int = 0
    drafted_steps: int = 0
    accepted: List[int] = field(default_factory=list)  # per stream: drafts accepted
    proposed: List[int] = field(default_factory=list)  # per stream: drafts proposed (all depths)
    rounds: List[float] = field(default_factory=list)  # aggregate tok/s of every timed round (this is the median one)
    cpu_s: float = 0.0  # process CPU time of the whole run (prefill included, every thread)
    cpu_rounds: List[float] = field(default_factory=list)  # generated tokens per CPU second, every round
    # our engine's steps, each [batch size, drafted (0/1), head pass width, ms]; then every round's (``step_rounds``)
    step_log: List[list] = field(default_factory=list)
    step_rounds: List[List[list]] = field(default_factory=list)

    @property
    def cpu_tps(self) -> float:
        """Generated tokens per CPU second of the process: what the run costs, not how long it waited
        for a shared machine's cores."""
        return self.generated / self.cpu_s if self.cpu_s > 0 else 0.0

    @property
    def generated(self) -> int:
        return sum(len(t) - 1 for t in self.tokens)

    @property
    def aggregate_tps(self) -> float:
        span = max(self.done_s) - max(self.first_s)
        return self.generated / span if span > 0 else 0.0

    @property
    def per_stream_tps(self) -> float:
        rates = [(len(t) - 1) / (d - f) for t, f, d in zip(self.tokens, self.first_s, self.done_s) if d > f]
        return sum(rates) / len(rates) if rates else 0.0

    @property
    def acceptance(self) -> List[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]

    def to_json(self, step_logs: bool = False) -> dict:
        out = {"generated": self.generated, "aggregate_tok_per_s": round(self.aggregate_tps, 2),
               "per_stream_tok_per_s": round(self.per_stream_tps, 2)}
        if self.steps:
            out.update(steps=self.steps, drafted_steps=self.drafted_steps,
                       acceptance_by_stream=[round(a, 4) for a in self.acceptance])
        if self.cpu_s:
            out["tok_per_cpu_s"] = round(self.cpu_tps, 2)
        if len(self.rounds) > 1:
            out["aggregate_tok_per_s_rounds"] = [round(r, 2) for r in self.rounds]
            out["tok_per_cpu_s_rounds"] = [round(r, 2) for r in self.cpu_rounds]
        if step_logs and self.step_rounds:
            out["step_log_rounds"] = self.step_rounds
        return out


def batchgen_decode(m: MTPModel, prompts: Sequence[Sequence[int]], max_tokens: int, sampling: Sampling,
                    seed: int) -> DecoderRun:
    """mlx-lm's BatchGenerator on all prompts at once (no stop tokens: every stream runs to max_tokens)."""
    from mlx_lm.generate import BatchGenerator

    mx.random.seed(seed)
    gen = BatchGenerator(m.model, max_tokens=max_tokens, sampler=mlx_lm_sampler(sampling),
                         prefill_batch_size=len(prompts), completion_batch_size=len(prompts))
    try:
        uids = gen.insert([list(p) for p in prompts], [max_tokens] * len(prompts))
        row = {uid: i for i, uid in enumerate(uids)}
        tokens = [[] for _ in prompts]
        first, done = [0.0] * len(prompts), [0.0] * len(prompts)
        finished = 0
        while finished < len(prompts):
            _, responses = gen.next()
            now = time.perf_counter()
            for r in responses:
                i = row[r.uid]
                if not tokens[i]:
                    first[i] = now
                tokens[i].append(int(r.token))
                if r.finish_reason is not None:
                    done[i] = now
                    finished += 1
    finally:
        gen.close()
    return DecoderRun(tokens, first, done)


def engine_decode(m: MTPModel, prompts: Sequence[Sequence[int]], max_tokens: int, sampling: Sampling, seed: int,
                  depth: int, mode: str, hidden: str = "post-norm",
                  policy: Optional[DraftPolicy] = None) -> DecoderRun:
    streams = [Stream(list(p), max_tokens, sampling=sampling, seed=seed + i) for i, p in enumerate(prompts)]
    engine = run_batch(m, streams, depth, mode, hidden=hidden, policy=policy)
    return DecoderRun([s.out for s in streams], [s.first_token_s for s in streams], [s.done_s for s in streams],
                      steps=len(engine.log), drafted_steps=sum(r.drafted for r in engine.log),
                      accepted=[sum(s.stats.accepted) for s in streams],
                      proposed=[sum(s.stats.proposed) for s in streams],
                      step_log=[[len(r.streams), int(r.drafted), r.head_width, round(1e3 * r.seconds, 3)]
                                for r in engine.log])


def auto_vs_best(auto: float, *fixed: float) -> float:
    """auto's tok/s over the best fixed choice's (BatchGenerator, plain engine, mtp): 0 when none ran."""
    best = max(fixed)
    return auto / best if best else 0.0


def round_order(n: int, i: int) -> List[int]:
    """Round i's order of n decoders, a row of a Williams square: over n rounds (even n) each decoder
    runs first once and right after each other decoder once, so whatever a run leaves behind for
    the next (caches, allocator, clocks) falls on every decoder alike. A rotation (round i starting
    at decoder i) would keep every decoder behind the same one."""
    first, lo, hi = [0], 1, n - 1
    while lo <= hi:
        first.append(lo)
        lo += 1
        if lo <= hi:
            first.append(hi)
            hi -= 1
    return [(j + i) % n for j in first]


def paired_ratio(own: Sequence[float], against: Dict[str, Sequence[float]]) -> Optional[float]:
    """Median over the rounds of ``own`` over, in the same round, the one of ``against`` with the best
    median (runs of one round are seconds apart: load that moves between rounds cancels); None with
    one round. Against one choice for every round, not each round's fastest: that maximum of several
    noisy runs is no decoder anyone could pick, and it scored the plain engine itself 0.93-0.96
    pooled on the CPU fixtures."""
    if min(len(r) for r in (own, *against.values())) < 2:
        return None
    best = max(against, key=lambda n: statistics.median(against[n]))
    ratios = [a / b for a, b in zip(own, against[best]) if b > 0]
    return statistics.median(ratios) if ratios else None


def timed_rounds(decoders: Dict[str, Callable[[], DecoderRun]], rounds: int,
                 on_run: Optional[Callable[[DecoderRun], None]] = None,
                 on_start: Optional[Callable[[str, int], None]] = None,
                 settle: Optional[Callable[[], None]] = None) -> Dict[str, DecoderRun]:
    """Each decoder's timed run ``rounds`` times in the balanced order (``round_order``), the garbage collected
    and MLX's buffer cache cleared before every run; per decoder its median run, holding every round's
    aggregate tok/s and tokens per CPU second. ``on_start(name, round)`` before each run, ``on_run(run)`` after;
    ``settle()`` right before each run, after the collection (what brings the machine to a steady state)."""
    timed: Dict[str, List[DecoderRun]] = {name: [] for name in decoders}
    names = list(decoders)
    for i in range(rounds):
        for name in (names[j] for j in round_order(len(names), i)):
            if on_start:
                on_start(name, i)
            gc.collect()  # the last run's garbage is not collected on this run's time
            mx.clear_cache()
            if settle:
                settle()
            c0 = time.process_time()
            run = decoders[name]()
            run.cpu_s = time.process_time() - c0
            timed[name].append(run)
            if on_run:
                on_run(run)
    runs = {}
    for name, done in timed.items():
        ranked = sorted(done, key=lambda r: r.aggregate_tps)
        runs[name] = ranked[(len(ranked) - 1) // 2]
        runs[name].rounds = [r.aggregate_tps for r in done]
        runs[name].cpu_rounds = [r.cpu_tps for r in done]
        runs[name].step_rounds = [r.step_log for r in done if r.step_log]
    return runs


@dataclass
class ConcurrencyRow:
    concurrency: int
    depth: int
    runs: Dict[str, DecoderRun]
    policy: Optional[DraftPolicy] = None

    def speedup(self, name: str) -> float:
        base = self.runs["batchgen"].aggregate_tps
        return self.runs[name].aggregate_tps / base if base else 0.0

    def auto_vs_best(self) -> float:
        return auto_vs_best(*(self.runs[n].aggregate_tps for n in ("auto", "batchgen", "plain", "mtp")))

    def paired(self, name: str, against: Sequence[str], cpu: bool = False) -> Optional[float]:
        """``paired_ratio`` of ``name``'s aggregate tok/s (``cpu``: tokens per CPU second)."""
        series = lambda n: self.runs[n].cpu_rounds if cpu else self.runs[n].rounds  # noqa: E731
        return paired_ratio(series(name), {n: series(n) for n in against})

    def greedy_identical(self) -> Dict[str, bool]:
        """Per decoder: every stream's tokens equal the plain batched engine's."""
        ref = self.runs["plain"].tokens
        return {name: run.tokens == ref for name, run in self.runs.items() if name != "plain"}

    def to_json(self, greedy: bool, step_logs: bool = False) -> dict:
        out = {"concurrency": self.concurrency, "depth": self.depth,
               "decoders": {name: run.to_json(step_logs) for name, run in self.runs.items()},
               "speedup_mtp": round(self.speedup("mtp"), 3), "speedup_auto": round(self.speedup("auto"), 3),
               "speedup_plain_engine": round(self.speedup("plain"), 3), "auto_vs_best": round(self.auto_vs_best(), 3)}
        paired = {"auto_vs_best_paired": self.paired("auto", ("batchgen", "plain", "mtp")),
                  "plain_vs_batchgen_paired": self.paired("plain", ("batchgen",)),
                  "auto_vs_best_cpu_paired": self.paired("auto", ("batchgen", "plain", "mtp"), cpu=True),
                  "plain_vs_batchgen_cpu_paired": self.paired("plain", ("batchgen",), cpu=True)}
        out.update({k: round(v, 3) for k, v in paired.items() if v is not None})
        if greedy:
            out["greedy_identical_to_plain_engine"] = self.greedy_identical()
        if self.policy is not None:
            out.update(self.policy.to_json())
        return out


@dataclass
class ConcurrencyResult:
    path: str
    sampling: Sampling
    max_tokens: int
    prompts: int
    rows: List[ConcurrencyRow] = field(default_factory=list)

    def crossover(self, depth: int, decoder: str = "mtp") -> Optional[int]:
        """The smallest concurrency at which ``decoder`` is slower than the plain batched baseline."""
        losing = [r.concurrency for r in self.rows if r.depth == depth and r.speedup(decoder) < 1]
        return min(losing) if losing else None

    def to_json(self, step_logs: bool = False) -> dict:
        """``step_logs``: every round's steps of our engine's decoders too (``DecoderRun.step_log``)."""
        depths = sorted({r.depth for r in self.rows})
        return {
            "path": self.path, "sampling": vars(self.sampling), "max_tokens": self.max_tokens,
            "prompts": self.prompts, "device": str(mx.default_device()), "baseline": BASELINE,
            "rows": [r.to_json(self.sampling.greedy, step_logs) for r in self.rows],
            "crossover": {str(d): {"mtp": self.crossover(d), "auto": self.crossover(d, "auto")} for d in depths},
        }


def bench_concurrency(
    m: MTPModel, path: str, encoded: Sequence[Sequence[int]], concurrency: Sequence[int], max_tokens: int = 64,
    depths: Sequence[int] = (1,), sampling: Sampling = Sampling(), seed: int = 0, hidden: str = "post-norm",
    on_tokens: Optional[Callable[[int], None]] = None, rounds: int = 1, progress: Optional[Progress] = None,
    settle: Optional[Callable[[], None]] = None,
) -> ConcurrencyResult:
    """Stream i of a level takes prompt i mod len(encoded); stream i samples with seed + i. Each decoder
    reports its median of ``rounds`` interleaved timed runs (``settle``: see ``timed_rounds``). ``progress`` counts the runs, warm-up included
    (stage "bench")."""
    result = ConcurrencyResult(path, sampling, max_tokens, len(encoded))
    count = Counter(progress, "bench", len(depths) * len(concurrency) * (3 + 4 * rounds), "runs")
    for depth in depths:
        for c in concurrency:
            level = f"depth {depth}, {c} stream{'s' if c > 1 else ''}"
            count.at(f"{level}: warm-up")
            prompts = [encoded[i % len(encoded)] for i in range(c)]
            decoders = {
                "batchgen": lambda: batchgen_decode(m, prompts, max_tokens, sampling, seed),
                "plain": lambda: engine_decode(m, prompts, max_tokens, sampling, seed, depth, "plain", hidden),
                "mtp": lambda: engine_decode(m, prompts, max_tokens, sampling, seed, depth, "mtp", hidden),
            }
            # every pass shape of 1 .. c rows, whatever auto's trajectory, and both kinds timed at each
            cal = calibrate(m, depth, c, hidden, context=max(len(p) for p in prompts) + max_tokens)
            for run in decoders.values():  # warm-up: compiles every shape the timed runs meet
                run()
                count.add()
            policy = DraftPolicy(calibration=cal)  # its first decode is the first timed round
            decoders["auto"] = lambda: engine_decode(m, prompts, max_tokens, sampling, seed, depth, "auto", hidden,
                                                     policy)

            def done(run: DecoderRun) -> None:
                if on_tokens:
                    on_tokens(run.generated + c)
                count.add()

            runs = timed_rounds(decoders, rounds, done,
                                on_start=lambda name, i: count.at(f"{level}: round {i + 1}/{rounds}, {name}"),
                                settle=settle)
            result.rows.append(ConcurrencyRow(c, depth, runs, policy))
    return result
