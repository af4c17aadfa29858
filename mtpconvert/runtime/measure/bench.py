"""`mtpconvert bench`: acceptance and speed of MTP decoding against plain decoding.

Plain decoding is mlx-lm's own ``generate_step`` (``baseline.py``); our synchronous
``plain_generate`` runs too, as a cross-check column only. All decoders run on the same
prompts in the same process after a warm-up, for every requested (hidden-state convention,
depth) pair; greedy MTP output is checked token for token against mlx-lm's. Step costs
(timed with synchronous single calls) are measured separately so the
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
from mlx_lm.models.cache import ArraysCache

from ...progress import Counter, Progress
from ..smoke.decode import Divergence, divergence, encode_prompts
from ..decoding.load import MTPModel, load
from ..decoding.rollback import RollbackArraysCache
from ..decoding.sampling import Sampling
from ..decoding.speculative import DecodeStats, mtp_generate, plain_generate
from .baseline import DECODER, mlx_lm_generate
from .oracle import LABEL as ORACLE_LABEL
from .oracle import Oracle, parted


@dataclass
class StepCosts:
    """Seconds per call, averaged after warm-up, on a cache holding ``context`` tokens."""

    context: int
    decode_1: float  # plain one-token backbone step (stock forward)
    verify: float  # (depth+1)-token backbone pass + logits, every draft accepted (nothing to undo)
    undo: float  # extra for a rejection: linear-attention states recomputed for the kept prefix
    head: float  # one MTP head step (fc + decoder layer + lm_head)
    depth: int
    rows: int = 1  # sequences in each timed pass (batched step costs: B rows at the same context)

    @property
    def beta(self) -> float:
        return self.verify / self.decode_1

    @property
    def delta(self) -> float:
        return self.depth * self.head / self.decode_1

    @property
    def rho(self) -> float:
        return self.undo / self.decode_1

    def step_cost(self, reject_share: float) -> float:
        """Predicted MTP step in decode steps, when ``reject_share`` of steps reject a draft."""
        return self.beta + self.delta + reject_share * self.rho

    def predicted_speedup(self, tokens_per_step: float, reject_share: float) -> float:
        return tokens_per_step / self.step_cost(reject_share)

    def to_json(self) -> dict:
        return {
            "context": self.context, "depth": self.depth, "rows": self.rows,
            "decode_1_ms": round(1e3 * self.decode_1, 3), "verify_ms": round(1e3 * self.verify, 3),
            "undo_ms": round(1e3 * self.undo, 3), "head_ms": round(1e3 * self.head, 3),
            "beta": round(self.beta, 3), "delta": round(self.delta, 3), "rho": round(self.rho, 3),
        }


@dataclass
class BenchRow:
    """One (hidden, depth) pair over all prompts. ``plain``: mlx-lm's generate_step, the baseline;
    ``plain_loop``: our synchronous plain loop (a cross-check of the baseline, not a reference)."""

    hidden: str
    depth: int
    mtp: DecodeStats
    plain: DecodeStats
    costs: Optional[StepCosts] = None
    plain_loop: DecodeStats = field(default_factory=DecodeStats)
    # greedy only: where MTP's tokens first part from mlx-lm's, with mlx-lm's top-2 logit margin
    # there (a near-tie is a kernel difference between a k+1-token pass and a 1-token step)
    divergences: Optional[List[Divergence]] = None
    # oracle-acceptance P (measure/oracle.py): drafts replaced by the true greedy token with probability P
    oracle: Optional[Oracle] = None
    reference_misses: int = 0  # prompts whose timed MTP decode parted from the oracle's reference

    @property
    def mismatched_prompts(self) -> Optional[List[int]]:
        return None if self.divergences is None else [d.prompt for d in self.divergences]

    @property
    def speedup(self) -> float:
        return self.mtp.decode_tps / self.plain.decode_tps if self.plain.decode_tps else 0.0

    @property
    def speedup_vs_plain_loop(self) -> float:
        return self.mtp.decode_tps / self.plain_loop.decode_tps if self.plain_loop.decode_tps else 0.0

    @property
    def reject_share(self) -> float:
        """Share of steps that rejected a draft (and so paid for an undo)."""
        if not self.mtp.steps:
            return 0.0
        return 1 - self.mtp.accepted[self.depth - 1] / self.mtp.steps

    @property
    def overhead(self) -> Optional[float]:
        """Share of an MTP step not spent in the verify pass, head calls and undos (Python, syncs, sampling)."""
        if not self.costs or not self.mtp.steps:
            return None
        step = self.mtp.decode_s / self.mtp.steps
        return max(0.0, 1 - self.costs.step_cost(self.reject_share) * self.costs.decode_1 / step)

    def to_json(self) -> dict:
        out = {
            "hidden": self.hidden, "depth": self.depth, "mtp": self.mtp.to_json(),
            "plain": dict(self.plain.to_json(), decoder=DECODER),
            "plain_loop": dict(self.plain_loop.to_json(), decoder="mtpconvert plain_generate (cross-check)"),
            "speedup": round(self.speedup, 3), "speedup_vs_plain_loop": round(self.speedup_vs_plain_loop, 3),
        }
        if self.mismatched_prompts is not None:
            out["greedy_identical_to_mlx_lm"] = not self.mismatched_prompts
            out["mismatched_prompts"] = self.mismatched_prompts
            out["divergences"] = [d.to_json() for d in self.divergences]
        if self.costs:
            out["costs"] = self.costs.to_json()
            out["reject_share"] = round(self.reject_share, 4)
            out["predicted_speedup"] = round(
                self.costs.predicted_speedup(self.mtp.tokens_per_step, self.reject_share), 3)
            out["loop_overhead"] = round(self.overhead, 3)
        if self.oracle is not None:
            out["oracle_acceptance"] = self.oracle.p
            out["oracle"] = dict(self.oracle.stats.to_json(), reference_misses=self.reference_misses,
                                 label=ORACLE_LABEL)
        return out


@dataclass
class BenchResult:
    path: str
    sampling: Sampling
    max_tokens: int
    prompts: int
    rows: List[BenchRow] = field(default_factory=list)
    oracle: Sequence[float] = ()
    kernel: Optional[dict] = None  # --cuda-qmv: whether it ran and which kernel each (shape, rows) uses

    def to_json(self) -> dict:
        out = {
            "path": self.path,
            "sampling": vars(self.sampling),
            "max_tokens": self.max_tokens,
            "prompts": self.prompts,
            "device": str(mx.default_device()),
            "baseline": DECODER,
            "rows": [r.to_json() for r in self.rows],
        }
        if self.oracle:
            out["oracle_acceptance"] = list(self.oracle)
            out["oracle_label"] = ORACLE_LABEL
        if self.kernel is not None:
            out["cuda_qmv"] = self.kernel
        return out


def context_restorer(cache: list) -> Callable[[int], None]:
    """``restore(n)`` puts ``cache`` back where it is now, after a pass of ``n`` tokens.

    KV caches drop the pass's ``n`` rows; linear-attention caches get back the (conv window,
    SSM state) arrays they hold now, so timing a pass repeatedly needs no recompute.
    """
    saved = [(c[0], c[1]) if isinstance(c, ArraysCache) else None for c in cache]

    def restore(n: int) -> None:
        for c, s in zip(cache, saved):
            if s is None:
                c.trim(n)
            else:
                c[0], c[1] = s

    return restore


def timed(fn: Callable[[], object], n: int) -> float:
    """Seconds per call of ``fn`` (its result evaluated), after one untimed call."""
    mx.eval(fn())
    t0 = time.perf_counter()
    for _ in range(n):
        mx.eval(fn())
    return (time.perf_counter() - t0) / n


def measure_step_costs(m: MTPModel, context: Sequence[int], depth: int, n: int = 20, rows: int = 1) -> StepCosts:
    """Time one decode step, one verify pass, its undo and one head step at a fixed context.

    After each timed call the caches return to the context: KV caches are trimmed and the
    linear-attention states are set back to the arrays they held before (no compute).
    ``rows`` > 1 times the same passes over that many sequences at once (all at ``context``): the
    cost of a batched step of B rows with the stock caches (the floor of the batched engine's).
    """
    m.backbone.enable_rollback()
    ctx = mx.array([list(context)] * rows)
    tok = ctx[:, -1:]

    plain_cache = m.backbone.make_cache()
    mx.eval(m.backbone(ctx, cache=plain_cache))
    plain_restore = context_restorer(plain_cache)

    def decode_1():
        out = m.backbone(tok, cache=plain_cache)
        mx.eval(out)
        plain_restore(1)
        return out

    cache = m.backbone.rollback_cache(max_pass=depth + 1)
    pre, post = m.backbone.forward(ctx, cache)
    mx.eval(post)
    restore = context_restorer(cache)
    verify_in = mx.repeat(tok, depth + 1, axis=1)

    def verify():
        logits = m.logits(m.backbone.forward(verify_in, cache)[1])
        mx.eval(logits)
        restore(depth + 1)
        return logits

    def verify_reject():  # keep 1 of depth+1: the largest undo
        logits = m.logits(m.backbone.forward(verify_in, cache)[1])
        m.backbone.rollback(cache, keep=1, length=depth + 1)
        out = [logits] + [c[1] for c in cache if isinstance(c, RollbackArraysCache)]
        mx.eval(out)
        restore(1)
        return out

    head_cache = m.head.make_cache()
    mx.eval(m.head(post, m.embed(ctx), head_cache))
    h_last, e_last = post[:, -1:], m.embed(tok)

    def head():
        x = m.head(h_last, e_last, head_cache)
        head_cache[0].trim(1)
        return m.draft_logits(x)

    t_verify = timed(verify, n)
    t_undo = max(0.0, timed(verify_reject, n) - t_verify)
    return StepCosts(len(context), timed(decode_1, n), t_verify, t_undo, timed(head, n), depth, rows)


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
    prompt_ids: Optional[Sequence[Sequence[int]]] = None,
    oracle: Sequence[float] = (),
    refine: int = 4,
    cuda_qmv: bool = False,
    progress: Optional[Progress] = None,
    warmup_tokens: Optional[int] = None,
    cross_check: bool = True,
    step_costs: bool = True,
) -> BenchResult:
    """``prompt_ids`` replaces ``prompts`` with token ids (a folder with no tokenizer, e.g. random weights).

    ``progress`` counts the tokens decoded, warm-up included (stage "bench"). ``warmup_tokens``: tokens of
    each untimed warm-up decode (None: ``max_tokens``, every workload as it is timed). ``cross_check``:
    time our plain loop too (``BenchRow.plain_loop``). ``step_costs``: time them (``BenchRow.costs``).

    ``oracle``: acceptance rates P; each (hidden, depth) row is then run once per P with every greedy
    draft replaced by the true greedy token with probability P (``measure/oracle.py``); the
    reference is mlx-lm's greedy decode of the prompt, refined up to ``refine`` times in the warm-up
    where the MTP decode parts from it (GPU near-ties). ``cuda_qmv``: on a CUDA device, calibrate and use
    the multi-row quantized matvec (``decoding/cuda_qmv.py``) for the verify passes' row counts."""
    if oracle and not sampling.greedy:
        raise ValueError("--oracle-acceptance needs greedy decoding (--temp 0)")
    m = model or load(path)
    if not m.family.capabilities.pre_norm_hidden:  # its adapter gives post-norm states only
        if "pre-norm" in hiddens and len(hiddens) == 1:
            from ...errors import OptionsError

            raise OptionsError(f"--hidden pre-norm: the {m.family.name} head drafts from the post-norm state (its "
                               "backbone runs as its library's own forward)")
        hiddens = [h for h in hiddens if h != "pre-norm"]
    encoded = [list(p) for p in prompt_ids] if prompt_ids is not None else encode_prompts(path, prompts)
    result = BenchResult(str(path), sampling, max_tokens, len(encoded), oracle=tuple(oracle))
    if cuda_qmv:
        from ..decoding import cuda_qmv as kernel

        entries = kernel.enable(m.model, m.head, rows=sorted({d + 1 for d in depths}))
        result.kernel = {"available": kernel.available(),
                         "plan": {f"{e['n']}x{e['k']} rows={e['rows']}": e["best"] for e in entries}}
    vocab = m.backbone.vocab_size
    references = {}
    warm = max_tokens if warmup_tokens is None or oracle else min(warmup_tokens, max_tokens)
    first = max(warm, max_tokens // 2 + 1)  # mlx-lm's warm-up of prompt 0 also gives the step costs' context
    extra = max(depths) if oracle else 0  # the oracle looks up to depth tokens past the last one
    per_warm = warm * ((1 if cross_check else 0) + len(depths))
    per_row = max_tokens * (3 if cross_check else 2)
    count = Counter(progress, "bench", first + extra + (len(encoded) - 1) * (warm + extra) + len(encoded) * per_warm
                    + len(hiddens) * len(depths) * max(1, len(oracle)) * len(encoded) * per_row, "tokens")
    # Warm-up: one untimed run of every workload. Kernels are compiled per shape (the CUDA
    # backend's JIT takes ~0.1 s each), and a depth-k decode meets pass lengths 1..k+1 and
    # every prompt's prefill length: a short warm-up left compiles in the first timed row.
    mark = 0
    for i, ids in enumerate(encoded):
        count.at(f"warm-up, prompt {i + 1}/{len(encoded)}", done=mark)
        n = (first if i == 0 else warm) + extra
        generated, _ = mlx_lm_generate(m, ids, n, sampling, seed + i, on_tokens=count.add)
        references[i] = generated
        if cross_check:
            plain_generate(m, ids, warm, sampling, seed + i, on_tokens=count.add)
        if i == 0:  # step costs are timed half-way through the first prompt's decode
            cost_context = ids + generated[: max_tokens // 2]
        for depth in depths:
            mtp_generate(m, ids, warm, depth, sampling, hiddens[0], seed + i, on_tokens=count.add)
        mark += n + per_warm
    oracles = {}
    for depth in depths:
        for p in oracle:
            o = oracles[depth, p] = Oracle(p, vocab, {i: list(r) for i, r in references.items()}, seed)
            for i, ids in enumerate(encoded):  # warm-up under the oracle, refining its reference
                for _ in range(refine + 1):
                    tokens, _ = mtp_generate(m, ids, max_tokens, depth, sampling, hiddens[0], seed + i,
                                             draft_hook=o.for_stream(i))
                    if not o.refine(i, tokens):
                        break
            o.stats = type(o.stats)()
    for hidden in hiddens:
        for depth in depths:
            count.at(f"step costs, {hidden} depth {depth}", done=mark)
            costs = measure_step_costs(m, cost_context, depth) if step_costs else None
            for p in oracle or (None,):
                label = f"{hidden} depth {depth}" + (f" oracle P={p:g}" if p is not None else "")
                result.rows.append(bench_row(m, encoded, max_tokens, hidden, depth, sampling, seed, on_tokens,
                                             oracles.get((depth, p)), cross_check=cross_check,
                                             count=count, label=label))
                result.rows[-1].costs = costs
                mark += len(encoded) * per_row
    return result


def bench_row(m: MTPModel, encoded: Sequence[List[int]], max_tokens: int, hidden: str, depth: int,
              sampling: Sampling, seed: int, on_tokens: Optional[Callable[[int], None]],
              oracle: Optional[Oracle] = None, cross_check: bool = True, count: Optional[Counter] = None,
              label: str = "") -> BenchRow:
    """The three decoders on every prompt (two without ``cross_check``: our plain loop), interleaved per
    prompt so drift (heat, other load) hits all alike. ``count``: the bench's progress, at ``label``."""
    row = BenchRow(hidden, depth, DecodeStats(depth=depth), DecodeStats(),
                   divergences=[] if sampling.greedy else None, oracle=oracle)
    if oracle is not None:
        oracle.stats = type(oracle.stats)()
    count = count or Counter(None, "bench", None)
    timed = lambda n: (count.add(n), on_tokens(n) if on_tokens else None)  # noqa: E731
    start = count.done
    decoders = 3 if cross_check else 2

    def at(i: int, k: int, name: str) -> None:  # decoder k of prompt i starts
        count.at(f"{label}: prompt {i + 1}/{len(encoded)}, {name}", done=start + (i * decoders + k) * max_tokens)

    for i, ids in enumerate(encoded):
        at(i, 0, "mlx-lm")
        reference, ps = mlx_lm_generate(m, ids, max_tokens, sampling, seed + i, on_tokens=timed)
        if cross_check:
            at(i, 1, "our plain loop")
            _, ls = plain_generate(m, ids, max_tokens, sampling, seed + i, on_tokens=count.add)
            row.plain_loop.add(ls)
        at(i, decoders - 1, "MTP")
        tokens, ms = mtp_generate(m, ids, max_tokens, depth, sampling, hidden, seed + i, on_tokens=timed,
                                  draft_hook=oracle.for_stream(i) if oracle is not None else None)
        row.plain.add(ps)
        row.mtp.add(ms)
        if oracle is not None and parted(oracle.references[i], tokens):
            row.reference_misses += 1
        if sampling.greedy:
            found = divergence(m, i, ids, reference, tokens)
            if found is not None:
                row.divergences.append(found)
    return row
