"""`bench --concurrency ... --oracle-acceptance P`: batched MTP at a set acceptance against BatchGenerator.

For each depth k, concurrency C and oracle acceptance P (``measure/oracle.py``'s ``KeepOracle``), C
greedy streams start together (stream i takes prompt i mod the prompts given) and decode
``max_tokens`` each with:

``batchgen``  mlx-lm's ``BatchGenerator`` (the baseline every speedup divides by);
``plain``     our batched engine with drafting off;
``mtp``       our batched engine, every row drafting every step, each draft kept with probability P
              (the head, the verify pass and the undo run as always);
``auto``      our batched engine under ``DraftPolicy`` with the same oracle: whether the policy
              finds, at model scale, where drafting pays. The policy starts from a calibration
              (``calibration.calibrate``: every pass shape of 1 .. C rows run, both kinds timed at each) taken
              once per (k, C); each timed ``auto`` run is a fresh policy's first decode: no untimed run
              teaches it the acceptance first.

``batchgen`` and ``plain`` do not depend on P: they are timed once per (k, C) and round and shared by
that level's P rows. Each decoder runs once untimed first (kernels compile per shape). With ``rounds``
> 1 the timed runs repeat in a balanced order (``batch_bench.round_order``) and each decoder reports
its median round, with auto / best fixed paired within rounds (``batch_bench.paired_ratio``). Step
costs β, δ, ρ are timed with ``measure_step_costs(rows=C)``: C sequences at the same context, stock
caches, the floor of the engine's own passes; the predicted speedup is tokens per row-step / (β + δ +
r·ρ) against one stock ``(C, 1)`` decode step, BatchGenerator's step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx

from ...progress import Counter, Progress
from ..decoding.batched import Stream, run_batch
from ..decoding.calibration import calibrate
from ..decoding.draft_policy import Calibration, DraftPolicy
from ..decoding.load import MTPModel
from ..decoding.sampling import Sampling
from .baseline import mlx_lm_generate
from .batch_bench import BASELINE, DecoderRun, auto_vs_best, batchgen_decode, paired_ratio, timed_rounds
from .bench import StepCosts, measure_step_costs
from .oracle import KEEP_LABEL, KeepOracle


@dataclass
class EngineRun(DecoderRun):
    tokens_per_step: float = 1.0  # emitted tokens per row per drafting step (1 + accepted)
    reject_share: float = 0.0  # share of row-steps that rejected a draft
    step_ms: Optional[float] = None  # median step of the run (the first, after the joins, excluded)
    log: list = field(default_factory=list)  # per step: [rows, drafted, ms]
    policy: Optional[DraftPolicy] = None
    oracle: Optional[KeepOracle] = None


def engine_run(m: MTPModel, prompts: Sequence[Sequence[int]], max_tokens: int, depth: int, mode: str,
               hidden: str, seed: int, oracle: Optional[KeepOracle] = None,
               policy: Optional[DraftPolicy] = None) -> EngineRun:
    streams = [Stream(list(p), max_tokens, sampling=Sampling(), seed=seed + i) for i, p in enumerate(prompts)]
    engine = run_batch(m, streams, depth, mode, hidden=hidden, policy=policy,
                       keep_hook=oracle.keeps if oracle is not None else None)
    row_steps = sum(s.stats.proposed[0] for s in streams) if mode == "mtp" else 0
    kept_all = sum(s.stats.accepted[depth - 1] for s in streams) if mode == "mtp" else 0
    emitted = sum(len(s.out) - 1 for s in streams)
    times = sorted(r.seconds for r in engine.log[1:])  # the first step follows the prefill of every row
    return EngineRun([s.out for s in streams], [s.first_token_s for s in streams], [s.done_s for s in streams],
                     steps=len(engine.log), drafted_steps=sum(r.drafted for r in engine.log),
                     accepted=[sum(s.stats.accepted) for s in streams],
                     proposed=[sum(s.stats.proposed) for s in streams],
                     tokens_per_step=emitted / row_steps if row_steps else 1.0,
                     reject_share=1 - kept_all / row_steps if row_steps else 0.0,
                     step_ms=round(1e3 * times[len(times) // 2], 3) if times else None,
                     log=[[len(r.streams), int(r.drafted), round(1e3 * r.seconds, 2)] for r in engine.log],
                     policy=policy, oracle=oracle)


@dataclass
class OracleConcurrencyRow:
    concurrency: int
    depth: int
    p: float
    batchgen: DecoderRun
    plain: EngineRun
    mtp: EngineRun  # its oracle's coins are counted over its run
    auto: EngineRun  # its policy is the one its decode ran (a fresh one from the calibration)
    calibration: Calibration
    costs: StepCosts
    plain_matches_batchgen: bool

    @property
    def fixed(self) -> Dict[str, DecoderRun]:
        return {"batchgen": self.batchgen, "plain": self.plain, "mtp": self.mtp}

    def speedup(self, decoder: str = "mtp") -> float:
        base = self.batchgen.aggregate_tps
        return getattr(self, decoder).aggregate_tps / base if base else 0.0

    def auto_vs_best(self) -> float:
        return auto_vs_best(self.auto.aggregate_tps, *(r.aggregate_tps for r in self.fixed.values()))

    def auto_vs_best_paired(self) -> Optional[float]:
        return paired_ratio(self.auto.rounds, {n: r.rounds for n, r in self.fixed.items()})

    def predicted(self) -> float:
        return self.costs.predicted_speedup(self.mtp.tokens_per_step, self.mtp.reject_share)

    def to_json(self) -> dict:
        paired = {"auto_vs_best_paired": self.auto_vs_best_paired(),
                  "plain_vs_batchgen_paired": paired_ratio(self.plain.rounds, {"batchgen": self.batchgen.rounds})}
        return {
            "oracle_acceptance": self.p, "concurrency": self.concurrency, "depth": self.depth,
            "decoders": {"batchgen": self.batchgen.to_json(),
                         "plain": dict(self.plain.to_json(), median_step_ms=self.plain.step_ms),
                         "mtp": dict(self.mtp.to_json(), median_step_ms=self.mtp.step_ms,
                                     tokens_per_row_step=round(self.mtp.tokens_per_step, 3),
                                     reject_share=round(self.mtp.reject_share, 4)),
                         "auto": dict(self.auto.to_json(), median_step_ms=self.auto.step_ms, steps_log=self.auto.log,
                                      **self.auto.policy.to_json())},
            "speedup_mtp": round(self.speedup(), 3),
            "speedup_auto": round(self.speedup("auto"), 3),
            "auto_vs_best": round(self.auto_vs_best(), 3),
            **{k: round(v, 3) for k, v in paired.items() if v is not None},
            "speedup_plain_engine": round(self.speedup("plain"), 3),
            "calibration_s": round(self.calibration.wall_s, 2),
            "costs": self.costs.to_json(), "predicted_speedup": round(self.predicted(), 3),
            "oracle": self.mtp.oracle.to_json(),
            "greedy_plain_engine_identical_to_batchgen": self.plain_matches_batchgen,
        }


@dataclass
class OracleConcurrencyResult:
    path: str
    max_tokens: int
    prompts: int
    oracle: Sequence[float]
    rows: List[OracleConcurrencyRow] = field(default_factory=list)
    extra: Dict[str, object] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"path": self.path, "sampling": "greedy", "max_tokens": self.max_tokens, "prompts": self.prompts,
                "device": str(mx.default_device()), "baseline": BASELINE, "oracle_acceptance": list(self.oracle),
                "oracle_label": KEEP_LABEL, "rows": [r.to_json() for r in self.rows], **self.extra}


def bench_concurrency_oracle(
    m: MTPModel, path: str, encoded: Sequence[Sequence[int]], concurrency: Sequence[int], oracle: Sequence[float],
    max_tokens: int = 64, depths: Sequence[int] = (1,), seed: int = 0, hidden: str = "post-norm",
    on_tokens: Optional[Callable[[int], None]] = None, on_row: Optional[Callable[[OracleConcurrencyRow], None]] = None,
    progress: Optional[Progress] = None, rounds: int = 1,
) -> OracleConcurrencyResult:
    """Every (depth, C, P) row as described in the module doc; ``on_row(row)`` as each is done; ``progress``
    counts the rows (stage "bench")."""
    result = OracleConcurrencyResult(path, max_tokens, len(encoded), tuple(oracle))
    count = Counter(progress, "bench", len(depths) * len(concurrency) * len(oracle), "rows")
    count.at("step costs' context")
    cost_context = list(encoded[0]) + mlx_lm_generate(m, encoded[0], max_tokens // 2)[0]
    on_run = (lambda run: on_tokens(run.generated + len(run.tokens))) if on_tokens else None
    for depth in depths:
        for c in concurrency:
            level = f"depth {depth}, {c} stream{'s' if c > 1 else ''}"
            count.at(f"{level}: step costs, warm-up, baselines")
            prompts = [encoded[i % len(encoded)] for i in range(c)]
            costs = measure_step_costs(m, cost_context, depth, rows=c)
            cal = calibrate(m, depth, c, hidden)  # every pass shape of 1 .. c rows; both kinds timed at each
            decoders = {"batchgen": lambda: batchgen_decode(m, prompts, max_tokens, Sampling(), seed),
                        "plain": lambda: engine_run(m, prompts, max_tokens, depth, "plain", hidden, seed)}
            for p in oracle:
                count.at(f"{level}: oracle P={p:g}")
                decoders["mtp"] = lambda: engine_run(m, prompts, max_tokens, depth, "mtp", hidden, seed,
                                                     KeepOracle(p, seed))
                decoders["auto"] = lambda: engine_run(m, prompts, max_tokens, depth, "auto", hidden, seed,
                                                      KeepOracle(p, seed), DraftPolicy(calibration=cal))
                for run in decoders.values():  # warm-ups (kernels compile per shape)
                    run()
                runs = timed_rounds(decoders, rounds, on_run)
                result.rows.append(OracleConcurrencyRow(c, depth, p, runs["batchgen"], runs["plain"], runs["mtp"],
                                                        runs["auto"], cal, costs,
                                                        runs["batchgen"].tokens == runs["plain"].tokens))
                count.add()
                if on_row:
                    on_row(result.rows[-1])
    return result
