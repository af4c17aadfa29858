"""`mtpconvert smoke`: does the MTP head of a folder draft tokens the backbone accepts?

Runs the real draft/verify loop (greedy, depth 1) next to plain greedy decoding on a few
prompts: acceptance below the floor fails. MTP output that differs from the plain decode is
reported, not failed: a ``k+1``-token verify pass and a 1-token step run different kernels
(on a GPU above all), so where the plain decode's top two logits nearly tie the two decodes
may part without anything being wrong. Each divergence names its position and that margin;
a broken rollback shows as a large margin, a broken head as low acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

import mlx.core as mx

from ...errors import LayoutError
from ...progress import Counter, Progress

from ..decoding.load import MTPModel, load
from ..decoding.locate import readable_folder
from ..decoding.speculative import DecodeStats, mtp_generate, plain_generate
from .floors import DECODING_MIN_ACCEPTANCE, MIN_MLP_GAIN
from .mlp_gain import PairedGain

DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Here is a short story about a robot who learns to paint:",
)
DEEP_DEPTH = 3  # mtplx's default serving depth: the smoke checks exactness there too


@dataclass
class Divergence:
    """Where greedy MTP output first differs from plain greedy output on one prompt.

    ``margin``: the plain decode's top-1 minus top-2 logit at that position (None when it
    was not computed); a near-tie there is a kernel difference, a wide margin is a bug."""

    prompt: int
    position: int  # index into the generated tokens
    plain_token: int
    mtp_token: int
    margin: Optional[float] = None

    def to_json(self) -> dict:
        return {"prompt": self.prompt, "position": self.position, "plain_token": self.plain_token,
                "mtp_token": self.mtp_token, "top2_margin": None if self.margin is None else round(self.margin, 4)}


@dataclass
class SmokeResult:
    path: str
    hidden: str
    min_acceptance: float = DECODING_MIN_ACCEPTANCE
    mtp: DecodeStats = field(default_factory=DecodeStats)
    plain: DecodeStats = field(default_factory=DecodeStats)
    per_prompt: List[float] = field(default_factory=list)
    divergences: List[Divergence] = field(default_factory=list)
    min_mlp_gain: Optional[float] = MIN_MLP_GAIN  # None: reported, not gated
    mlp_gain_paired: Optional[PairedGain] = None  # teacher-forced over each prompt and its plain decode
    # the same prompts decoded with deeper chains of drafts (mtplx serves at depth 3 by default): exactness at
    # that depth is what lets mtplx_runtime.json vouch for it
    deep: DecodeStats = field(default_factory=DecodeStats)
    deep_mismatches: List[int] = field(default_factory=list)  # prompts whose deep decode differs from plain

    @property
    def acceptance(self) -> float:
        return self.mtp.acceptance

    @property
    def mismatched_prompts(self) -> List[int]:
        return [d.prompt for d in self.divergences]

    @property
    def identical(self) -> bool:
        """A diagnostic, not part of ``ok`` (see the module docstring)."""
        return not self.divergences

    @property
    def mlp_gain(self) -> Optional[float]:
        return None if self.mlp_gain_paired is None else self.mlp_gain_paired.gain

    @property
    def acceptance_ok(self) -> bool:
        return self.acceptance >= self.min_acceptance

    @property
    def mlp_ok(self) -> bool:
        return self.min_mlp_gain is None or self.mlp_gain is None or self.mlp_gain >= self.min_mlp_gain

    @property
    def ok(self) -> bool:
        return self.acceptance_ok and self.mlp_ok

    def to_json(self) -> dict:
        return {
            "path": self.path,
            "hidden": self.hidden,
            "acceptance": round(self.acceptance, 4),
            "proposed": sum(self.mtp.proposed),
            "accepted": sum(self.mtp.accepted),
            "per_prompt": [round(a, 4) for a in self.per_prompt],
            "identical_to_plain_greedy": self.identical,
            "deep": ({"depth": self.deep.depth, "acceptance_by_depth": [round(a, 4) for a in self.deep.acceptance_by_depth],
                      "identical_to_plain_greedy": not self.deep_mismatches, "mismatched_prompts": self.deep_mismatches}
                     if self.deep.depth else None),
            "mismatched_prompts": self.mismatched_prompts,
            "divergences": [d.to_json() for d in self.divergences],
            "min_acceptance": self.min_acceptance,
            **(self.mlp_gain_paired.to_json() if self.mlp_gain_paired is not None else {}),
            "min_mlp_gain": self.min_mlp_gain,
            "ok": self.ok,
        }


def encode_prompts(path: Path, prompts: Optional[Sequence[str]]) -> List[List[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))  # never trust_remote_code
    return [tok.encode(text) for text in (prompts or DEFAULT_PROMPTS)]


def first_difference(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """The first index where ``a`` and ``b`` differ (or where the shorter one ends); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_margin(m: MTPModel, prompt: Sequence[int], generated: Sequence[int], processors: Sequence = ()) -> float:
    """Top-1 minus top-2 logit of the plain model for the token after ``prompt + generated``
    (one prefill, the stock forward), after the decode's logits processors if it had any."""
    context = list(prompt) + list(generated)
    logits = m.backbone(mx.array([context]))[:, -1]
    for proc in processors:
        logits = proc(mx.array(context), logits)
    top = mx.topk(logits[0].astype(mx.float32), 2)
    return float((mx.max(top) - mx.min(top)).item())


def divergence(m: MTPModel, i: int, prompt: Sequence[int], plain: Sequence[int], spec: Sequence[int],
               processors: Sequence = ()) -> Optional[Divergence]:
    """Where ``spec`` first parts from the reference decode ``plain`` of prompt ``i`` (None if equal),
    with the reference's top-2 margin there; ``processors``: the logits processors both decodes ran."""
    at = first_difference(plain, spec)
    if at is None:
        return None
    if at >= min(len(plain), len(spec)):  # one decode stopped early: no competing token to weigh
        return Divergence(i, at, plain[at] if at < len(plain) else -1, spec[at] if at < len(spec) else -1)
    return Divergence(i, at, plain[at], spec[at], top2_margin(m, prompt, plain[:at], processors))


def load_folder(path: Path) -> MTPModel:
    """The folder loaded for decoding, once every file it reads has passed the folder rule and the head is
    located (``decoding.locate.readable_folder``). mlx-lm's loader raises ValueError where config.json and
    the weights disagree (a quantization block the shards do not match): named as such, not as a bug."""
    path = Path(path)
    readable_folder(path)
    try:
        return load(path)
    except ValueError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LayoutError(f"the model does not load: config.json and the weights disagree ({first[:300]})",
                          file=path / "config.json", code="load-failed") from None


def smoke(
    path: Path,
    prompts: Optional[Sequence[str]] = None,
    max_tokens: int = 48,
    hidden: str = "post-norm",
    min_acceptance: float = DECODING_MIN_ACCEPTANCE,
    model: Optional[MTPModel] = None,
    min_mlp_gain: Optional[float] = MIN_MLP_GAIN,
    deep_depth: int = DEEP_DEPTH,
    progress: Optional[Progress] = None,
) -> SmokeResult:
    """Plain and MTP greedy decoding of each prompt (depth 1, the gated one), and the same prompts at
    ``deep_depth`` (0: not run), whose token identity with plain greedy is recorded, never gated.
    ``progress`` counts the tokens decoded (stage "smoke")."""
    m = model or load_folder(path)
    result = SmokeResult(str(path), hidden, min_acceptance=min_acceptance, min_mlp_gain=min_mlp_gain)
    decoded = []
    encoded = encode_prompts(path, prompts)
    decodes = 3 if deep_depth > 1 else 2
    count = Counter(progress, "smoke", len(encoded) * decodes * max_tokens, "tokens")

    def running(i: int, what: str, finished: int) -> None:
        count.at(f"prompt {i + 1}/{len(encoded)}: {what}", done=(i * decodes + finished) * max_tokens)

    for i, ids in enumerate(encoded):
        running(i, "plain greedy", 0)
        plain, ps = plain_generate(m, ids, max_tokens, on_tokens=count.add)
        decoded.append(list(ids) + plain)
        running(i, "MTP depth 1", 1)
        spec, ms = mtp_generate(m, ids, max_tokens, hidden=hidden, on_tokens=count.add)
        result.plain.add(ps)
        result.mtp.add(ms)
        result.per_prompt.append(ms.acceptance)
        found = divergence(m, i, ids, plain, spec)
        if found is not None:
            result.divergences.append(found)
        if deep_depth > 1:
            running(i, f"MTP depth {deep_depth}", 2)
            deep, ds = mtp_generate(m, ids, max_tokens, depth=deep_depth, hidden=hidden, on_tokens=count.add)
            result.deep.add(ds)
            if deep != plain:
                result.deep_mismatches.append(i)
    count.at("the head's MLP gain (teacher-forced)", done=count.total)
    result.mlp_gain_paired = teacher_forced_mlp_gain(m, decoded, hidden)
    return result


def teacher_forced_mlp_gain(m: MTPModel, sequences: Sequence[Sequence[int]], hidden: str) -> PairedGain:
    """The head's MLP gain (``runtime.smoke.mlp_gain``) teacher-forced over ``sequences``: each prompt
    followed by its plain greedy decode, so the positions are the ones the decode drafted at."""
    from .teacher_forced import teacher_forced_full

    return teacher_forced_full(m, sequences, hidden).mlp_gain_paired


# ------------------------------------------------------------------ the decoding smoke against this backend

# The decoding smoke's estimated time past which the post-check's ``auto`` runs the layerwise check instead.
# Decoding multiplies every weight by one row per token (a few rows per verify pass), which mlx's CPU kernels
# do at ~1 GFLOP/s whatever the BLAS (bfloat16 and quantized matmuls are mlx's own loops): a 27B-shaped
# 2-layer bf16 model costs 3-7 s a token on a 2-core CPU, ~20-50 min for the 432 passes of the default smoke.
# The layerwise check multiplies each weight by every position at once, where a fast BLAS helps.
DECODE_BUDGET_S = 300.0


def decode_passes(max_tokens: int = 48, prompts: int = len(DEFAULT_PROMPTS), deep_depth: int = DEEP_DEPTH) -> int:
    """Forward passes ``smoke`` makes at most (no draft accepted): plain, depth-1 and, with ``deep_depth``,
    deep decoding of ``max_tokens`` tokens of each prompt."""
    return prompts * max_tokens * (3 if deep_depth > 1 else 2)


def row_gflops(folder: Path, size: int = 1024) -> float:
    """GFLOP/s of one row times a ``size`` x ``size`` matrix stored as the folder's weights are (its
    quantization from config.json, else its float dtype), measured here (~0.1 s)."""
    import json
    import time

    from .compute import model_dtype_of

    config = json.loads((Path(folder) / "config.json").read_text())
    quant = config.get("quantization") or {}
    dtype = model_dtype_of(folder)
    w = mx.random.normal((size, size), key=mx.random.key(0))
    x = mx.random.normal((1, size), key=mx.random.key(1)).astype(dtype)
    if quant.get("bits"):
        kw = dict(group_size=int(quant.get("group_size", 64)), bits=int(quant["bits"]))
        if quant.get("mode", "affine") != "affine":
            kw["mode"] = quant["mode"]
        parts = mx.quantize(w, **kw)
        wq, scales, biases = parts[0], parts[1], (parts[2] if len(parts) > 2 else None)
        fn = lambda: mx.quantized_matmul(x, wq, scales, biases, transpose=True, **kw)  # noqa: E731
    else:
        w = w.astype(dtype)
        fn = lambda: x @ w.T  # noqa: E731
    mx.eval(fn())
    t = time.perf_counter()
    for _ in range(4):
        mx.eval(fn())
    return 4 * 2 * size * size / max(time.perf_counter() - t, 1e-9) / 1e9


def decoding_misfit(folder: Path, max_tokens: int = 48, budget_s: float = DECODE_BUDGET_S) -> Optional[str]:
    """Why the decoding smoke does not fit ``folder`` on this backend, or None when it does: its library's
    forward cannot run the backbone as configured (``Family.forward_misfit``), or, on the CPU,
    ``decode_passes`` over its weights at the measured one-row rate take longer than ``budget_s``."""
    import json

    from ...families import family_for
    from .compute import active_params

    config = json.loads((Path(folder) / "config.json").read_text())
    misfit = family_for(config).forward_misfit(config)
    if misfit:
        return misfit
    if mx.default_device() != mx.cpu:
        return None
    passes = decode_passes(max_tokens)
    rate = row_gflops(folder)
    seconds = passes * 2 * sum(active_params(folder).values()) / (rate * 1e9)
    if seconds <= budget_s:
        return None
    return (f"decoding would take ~{seconds / 60:.0f} min on this CPU ({passes} passes over the weights at "
            f"{rate:.1f} GFLOP/s a row)")

