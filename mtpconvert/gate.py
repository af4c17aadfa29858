"""What gates a commit: the checks a finished folder passes before it is renamed into place.

``convert``, ``pull-and-quantize`` and ``add-mtp`` run them on their temp folder, ``upload``
on the folder it is given. Verify reads headers; smoke measures the MTP head's greedy
acceptance, in one of two ways:

- ``full``: load the whole model and decode with drafts next to plain greedy
  (``runtime.smoke.decode``), when the weights fit in the memory available;
- ``layerwise``: teacher-forced, one decoder layer resident at a time
  (``runtime.smoke.layerwise``), when they do not: a 27B-397B conversion on a 16 GB runner.

``auto`` decides from the weight bytes against the available memory. Either way the gate
is acceptance above the floor and the head's MLP gain (``runtime.smoke.mlp_gain``: acceptance with
the head layer's MLP minus without it) above its own floor, which catches a head whose MLP
weights are scrambled (experts misordered) when its acceptance alone cannot; greedy token
identity is reported, never failed. A failure raises ``GateFailed`` (the finished shards stay
in the partial folder). Once every check passed, ``run_gate(..., contract=True)`` writes the folder's
``mtplx_runtime.json`` from the smoke's result where it measured exact decoding (``verify.contract``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Tuple

from .errors import ConvertError, OptionsError
from .progress import Progress, Step
from .runtime.smoke.floors import DECODING_MIN_ACCEPTANCE, LAYERWISE_MIN_ACCEPTANCE, MIN_MLP_GAIN
from .verify import ERROR, Report, verify

SMOKE_MODES = ("auto", "full", "layerwise")
STREAMED_REASON = "shards uploaded and freed as they are written: layerwise, fed each shard as it was finished"


class GateFailed(ConvertError):
    default_code = "check-failed"


@dataclass(frozen=True)
class Gate:
    """Which checks gate the commit, the smoke floor, and how the smoke runs.

    ``prompts``: text for the smoke (None: each check's built-in prompts, English and code,
    which the bundled fixture does not model: tests on it pass ``demo.fixture_prompts``)."""

    verify: bool = True
    smoke: bool = True
    min_acceptance: Optional[float] = None  # None: the floor of the smoke that runs (floor_for)
    smoke_mode: str = "auto"
    prompts: Optional[Tuple[str, ...]] = None
    min_mlp_gain: Optional[float] = MIN_MLP_GAIN  # None: the MLP gain is reported, not gated

    def floor_for(self, mode: str) -> float:
        """The acceptance floor of a smoke mode: the one given, else that mode's own. Teacher-forced
        acceptance reads lower than decoding acceptance on the same head (docs/smoke.md), so the
        layerwise check has its own floor."""
        if self.min_acceptance is not None:
            return self.min_acceptance
        return DECODING_MIN_ACCEPTANCE if mode == "full" else LAYERWISE_MIN_ACCEPTANCE

    def __post_init__(self):
        if self.smoke_mode not in SMOKE_MODES:
            raise OptionsError(f"smoke mode must be one of {', '.join(SMOKE_MODES)}, not {self.smoke_mode!r}")


@dataclass
class GateRecord:
    """What the checks found, for the caller's report and the model card."""

    verify: Optional[Report] = None
    smoke: Optional[object] = None  # runtime.smoke.decode.SmokeResult or runtime.smoke.teacher_forced.LayerwiseResult
    smoke_mode: Optional[str] = None  # "full" | "layerwise": which one ran
    smoke_reason: Optional[str] = None  # why that one, in words
    smoke_skipped: Optional[str] = None
    failed: Optional[str] = None  # "verify" | "smoke": the check that raised
    notes: list = field(default_factory=list)

    @property
    def verify_ok(self) -> Optional[bool]:
        return None if self.verify is None else self.verify.ok

    @property
    def smoke_acceptance(self) -> Optional[float]:
        return None if self.smoke is None else self.smoke.acceptance


def verify_folder(folder: Path, *, what: str = "output") -> Report:
    """Verify a folder; raise ``GateFailed`` naming its first error."""
    report = verify(folder)
    if not report.ok:
        first = next(f for f in report.findings if f.severity == ERROR)
        raise GateFailed(f"{what} failed verification: {first.code}: {first.message}", key=first.key,
                          file=first.file or folder)
    return report


@dataclass(frozen=True)
class SmokeChoice:
    mode: str  # "full" | "layerwise"
    reason: str


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def full_smoke_bytes(folder: Path, on_cpu: bool) -> int:
    """Memory the full smoke's weights take: the stored bytes, plus on the CPU a float32 copy
    of float MoE experts (``runtime.decoding.load`` casts them: mlx's CPU ``gather_mm`` is float32-only)."""
    from .runtime.smoke.sizing import folder_weight_bytes, weight_files
    from .io.header import read_header

    total = folder_weight_bytes(folder)
    if on_cpu:
        for f in weight_files(folder):
            total += sum(t.nbytes for k, t in read_header(f).tensors.items()
                         if ".switch_mlp." in k and t.dtype in ("BF16", "F16"))
    return total


def choose_smoke(folder: Path, requested: str = "auto") -> SmokeChoice:
    """``full`` when the model fits in the memory available (weights + 25% + 1 GiB), else ``layerwise``."""
    if requested != "auto":
        return SmokeChoice(requested, f"--smoke-mode {requested}")
    import mlx.core as mx

    from .runtime.smoke.sizing import available_memory_bytes, smoke_mode

    weights = full_smoke_bytes(folder, mx.default_device() == mx.cpu)
    available = available_memory_bytes()
    mode = smoke_mode(weights, available)
    if available is None:
        return SmokeChoice(mode, "available memory unknown")
    fits = "fits" if mode == "full" else "does not fit"
    reason = f"the model ({_gib(weights)} of weights) {fits} in {_gib(available)} available"
    if mode == "full":  # and the decoding fits this backend (runtime.smoke.decode.decoding_misfit)
        from .runtime.smoke.decode import decoding_misfit

        misfit = decoding_misfit(folder)
        if misfit:
            return SmokeChoice("layerwise", f"{reason}, but {misfit}")
    return SmokeChoice(mode, reason)


def smoke_failure(result, how: str, folder: Path) -> GateFailed:
    """The ``GateFailed`` of a smoke result that is not ok: below the acceptance floor, or a head
    whose MLP does not help its drafts (``result``: a ``SmokeResult`` or ``LayerwiseResult``)."""
    why = []
    if not result.acceptance_ok:
        why.append(f"greedy draft acceptance {result.acceptance:.1%} < {result.min_acceptance:.0%}")
    if not result.mlp_ok:
        g = result.mlp_gain_paired
        why.append(f"the head's MLP gain {g.gain:+.1%} (95% CI {g.low:+.1%} to {g.high:+.1%}, {g.positions} "
                   f"positions) < {result.min_mlp_gain:+.0%}: drafts are no better with its MLP than without")
    return GateFailed(f"MTP smoke test failed ({how}): " + "; ".join(why), file=folder,
                       hint="the head is converted wrongly (use --no-smoke to keep it anyway)")


def smoke_full(folder: Path, checks: Gate, on_stage: Callable[[str], None], progress: Optional[Progress] = None):
    """Greedy MTP decoding next to plain greedy, the whole model loaded."""
    from .runtime.smoke.decode import smoke

    on_stage("MTP smoke test (greedy draft/verify decoding, whole model loaded)")
    floor = checks.floor_for("full")
    result = smoke(folder, checks.prompts, min_acceptance=floor, min_mlp_gain=checks.min_mlp_gain, progress=progress)
    if not result.ok:
        raise smoke_failure(result, "full", folder)
    return result


LAYER_MESSAGE = re.compile(r"layer (\d+)/(\d+)$")


def layer_steps(progress: Optional[Progress], on_stage: Callable[[str], None]) -> Callable[[str], None]:
    """The layerwise smoke's messages ("embedding rows", "layer 3/40", "MTP head", "lm_head rows ...") as
    ``Step``s counting layers, or, with no ``progress``, a stage line for each but the lm_head blocks."""
    if progress is None:
        return lambda msg: on_stage(f"layerwise smoke: {msg}") if not msg.startswith("lm_head rows") else None
    state = {"done": 0, "total": None}

    def report(msg: str) -> None:
        m = LAYER_MESSAGE.match(msg)
        if m:
            state["done"], state["total"] = int(m.group(1)) - 1, int(m.group(2))
        elif msg == "MTP head" and state["total"] is not None:
            state["done"] = state["total"]
        progress(Step("smoke (layerwise)", state["done"], state["total"], "layers", msg))

    return report


def smoke_layerwise(folder: Path, checks: Gate, on_stage: Callable[[str], None],
                    progress: Optional[Progress] = None):
    """Teacher-forced greedy acceptance, one decoder layer resident at a time."""
    from .runtime.smoke.layerwise import layerwise_acceptance

    on_stage("MTP smoke test (layerwise: teacher-forced, one layer in memory at a time)")
    coarse = layer_steps(progress, on_stage)
    floor = checks.floor_for("layerwise")
    from .runtime.smoke.compute import fitted_prompt_tokens
    from .runtime.smoke.layerwise import DEFAULT_MAX_PROMPT_TOKENS

    tokens, cut = fitted_prompt_tokens(folder, DEFAULT_MAX_PROMPT_TOKENS)  # the work this backend fits
    if cut:
        on_stage(f"layerwise smoke: {cut}")
    result = layerwise_acceptance(folder, checks.prompts, min_acceptance=floor, min_mlp_gain=checks.min_mlp_gain,
                                  progress=coarse, max_prompt_tokens=tokens)
    if not result.ok:
        raise smoke_failure(result, "layerwise, teacher-forced", folder)
    return result


def smoke_streamed(streamed, checks: Gate, on_stage: Callable[[str], None]):
    """The layerwise smoke that was fed each output shard as it was written (``runtime.smoke.streamed``):
    only the head and lm_head are left to run."""
    on_stage("MTP smoke test (layerwise, fed shard by shard: the head and lm_head)")
    result = streamed.finish()
    if not result.ok:
        raise smoke_failure(result, "layerwise, teacher-forced, streamed", result.path)
    return result


def smoke_folder(folder: Path, checks: Gate, record: GateRecord,
                 on_stage: Callable[[str], None] = lambda s: None, progress: Optional[Progress] = None):
    """The smoke ``checks.smoke_mode`` asks for (auto: whichever fits); raise ``GateFailed``
    when the head's acceptance or its MLP gain is below its floor. ``record`` says which ran and why."""
    on_stage("MTP smoke test: choosing full or layerwise for this model and backend")
    choice = choose_smoke(folder, checks.smoke_mode)
    record.smoke_mode, record.smoke_reason = choice.mode, choice.reason
    run = smoke_full if choice.mode == "full" else smoke_layerwise
    record.smoke = run(folder, checks, on_stage, progress)
    return record.smoke


def run_gate(folder: Path, checks: Gate, record: GateRecord, *, has_mtp: bool,
               on_stage: Callable[[str], None] = lambda s: None, streamed=None,
               contract: bool = False, progress: Optional[Progress] = None) -> None:
    """The checks ``checks`` asks for, on ``folder``; findings go into ``record`` (``record.failed``
    names the check that raised, for the caller's resume advice). ``streamed``: the smoke already
    fed the shards as they were written (``runtime.smoke.streamed.StreamedLayerwise``): it finishes here.
    ``contract`` (a folder the command builds: the partial folder before its rename): once they passed,
    write ``mtplx_runtime.json`` from the smoke, or remove one already there that nothing here measured
    (``verify.contract.write``; its note goes to ``record.notes``). ``upload`` never passes it: it does not
    write into the folder it is given. ``progress``: the smoke's ``Step``s."""
    if checks.verify:
        on_stage("verifying")
        record.failed = "verify"
        record.verify = verify_folder(folder)
    if checks.smoke and has_mtp:
        record.failed = "smoke"
        if streamed is not None:
            record.smoke_mode, record.smoke_reason = "layerwise", STREAMED_REASON
            record.smoke = smoke_streamed(streamed, checks, on_stage)
        else:
            smoke_folder(folder, checks, record, on_stage, progress)
    record.failed = None
    if contract:
        from .verify.contract import write

        note = write(folder, record, has_mtp=has_mtp)
        if note:
            record.notes.append(note)
