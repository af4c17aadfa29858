"""What a compat check answers: per runtime, a :class:`Verdict` on the backbone and one on the head
(:class:`RuntimeCompat`), the table they make (:class:`CompatReport`; its JSON is what ``verify
--json`` carries as ``runtimes``), its text rendering and the warnings for an ``--mtp`` choice."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import List, Optional

PRECISION = "precision"  # Verdict.cause: the head's quantization (the --mtp choice) is what decides


@dataclass
class Verdict:
    ok: Optional[bool]  # None: the question does not apply (a drafter folder has no backbone)
    reason: str
    cause: str = ""  # "precision" when only the head's quantization stands in the way


@dataclass
class RuntimeCompat:
    runtime: str
    versions: str
    backbone_exact: Verdict
    head_usable: Verdict
    verified: bool = True  # rule checked by running the runtime (interop/), not only read from its code


@dataclass
class CompatReport:
    folder: str
    layout: str  # sidecar | sidecar:<file> | in-model | drafter | none | mixed:<place>+<place>...
    runtimes: List[RuntimeCompat] = field(default_factory=list)

    def get(self, runtime: str) -> RuntimeCompat:
        for r in self.runtimes:
            if r.runtime == runtime:
                return r
        raise KeyError(runtime)

    def to_json(self) -> dict:
        return asdict(self)


def precision_warnings(report: CompatReport, choice: str) -> List[str]:
    """One line per runtime that cannot use the head because of its quantization (``choice``
    names the option, e.g. ``--mtp match``)."""
    lines = []
    for r in report.runtimes:
        v = r.head_usable if r.head_usable.cause == PRECISION else r.backbone_exact
        if v.cause == PRECISION:
            lines.append(f"{choice}: {r.runtime} cannot use this head: {v.reason}")
    return lines


def _mark(ok: Optional[bool], yes: str, no: str) -> str:
    return "n/a" if ok is None else yes if ok else no


def why(r: RuntimeCompat) -> str:
    """The head's reason, after the backbone's when the backbone is wrong (once when they are one)."""
    bb, hd = r.backbone_exact, r.head_usable
    if bb.ok is not False or bb.reason == hd.reason:
        return hd.reason
    return f"backbone: {bb.reason}; head: {hd.reason}"


def render(report: CompatReport) -> str:
    """A plain-text table (one line per runtime)."""
    lines = [f"{report.folder or '(folder)'}  layout: {report.layout}",
             f"{'runtime':<16} {'backbone':<9} {'head':<6} reason"]
    for r in report.runtimes:
        lines.append(f"{r.runtime:<16} {_mark(r.backbone_exact.ok, 'exact', 'WRONG'):<9} "
                     f"{'yes' if r.head_usable.ok else 'no':<6} {why(r)}")
    return "\n".join(lines)
