"""What gates a commit: the checks a finished folder passes before it is renamed into place.

``convert``, ``pull-and-quantize`` and ``add-mtp`` run them on their temp folder, ``upload``
on the folder it is given. Verify reads headers; smoke decodes with the MTP head. A
failure raises ``CheckFailed`` (the finished shards stay in the partial folder).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from .errors import ConvertError
from .verify import ERROR, Report, verify

DEFAULT_MIN_ACCEPTANCE = 0.40  # the decoding smoke's floor: runtime/smoke.py says where it comes from


class CheckFailed(ConvertError):
    default_code = "check-failed"


@dataclass(frozen=True)
class Checks:
    """Which checks gate the commit, and the smoke floor."""

    verify: bool = True
    smoke: bool = True
    min_acceptance: float = DEFAULT_MIN_ACCEPTANCE


@dataclass
class CheckRecord:
    """What the checks found, for the caller's report and the model card."""

    verify: Optional[Report] = None
    smoke: Optional[object] = None  # runtime.smoke.SmokeResult
    smoke_skipped: Optional[str] = None
    notes: list = field(default_factory=list)

    @property
    def verify_ok(self) -> Optional[bool]:
        return None if self.verify is None else self.verify.ok

    @property
    def smoke_acceptance(self) -> Optional[float]:
        return None if self.smoke is None else self.smoke.acceptance


def verify_folder(folder: Path, *, what: str = "output") -> Report:
    """Verify a folder; raise ``CheckFailed`` naming its first error."""
    report = verify(folder)
    if not report.ok:
        first = next(f for f in report.findings if f.severity == ERROR)
        raise CheckFailed(f"{what} failed verification: {first.code}: {first.message}", key=first.key,
                          file=first.file or folder)
    return report


def smoke_folder(folder: Path, min_acceptance: float, on_stage: Callable[[str], None] = lambda s: None):
    """Greedy MTP decoding next to plain greedy; raise ``CheckFailed`` when the head is broken."""
    from .runtime.smoke import smoke

    on_stage("MTP smoke test (greedy draft/verify decoding)")
    result = smoke(folder, min_acceptance=min_acceptance)
    if not result.ok:
        raise CheckFailed(
            f"MTP smoke test failed: greedy draft acceptance {result.acceptance:.1%} < {min_acceptance:.0%}"
            if result.identical else "MTP decoding differs from plain greedy decoding",
            file=folder, hint="the head is converted wrongly (use --no-smoke to keep it anyway)",
        )
    return result


def run_checks(folder: Path, checks: Checks, record: CheckRecord, *, has_mtp: bool,
               on_stage: Callable[[str], None] = lambda s: None) -> None:
    """The checks ``checks`` asks for, on ``folder``; findings go into ``record``."""
    if checks.verify:
        on_stage("verifying")
        record.verify = verify_folder(folder)
    if checks.smoke and has_mtp:
        record.smoke = smoke_folder(folder, checks.min_acceptance, on_stage)
