"""`mtpconvert smoke`: does the MTP head of a folder draft tokens the backbone accepts?"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

from .acceptance import Acceptance, greedy_acceptance
from .load import load

DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Here is a short story about a robot who learns to paint:",
)
# Working heads on real models accept 60-90% of greedy drafts; broken ones (missing
# norm shift, wrong expert order, mismatched hidden state) accept 0-5%.
DEFAULT_MIN_ACCEPTANCE = 0.30


@dataclass
class SmokeResult:
    path: str
    hidden: str
    per_prompt: List[Acceptance] = field(default_factory=list)
    min_acceptance: float = DEFAULT_MIN_ACCEPTANCE

    @property
    def total(self) -> Acceptance:
        return Acceptance(sum(a.proposed for a in self.per_prompt), sum(a.accepted for a in self.per_prompt))

    @property
    def ok(self) -> bool:
        return self.total.rate >= self.min_acceptance

    def to_json(self) -> dict:
        return {
            "path": self.path,
            "hidden": self.hidden,
            "acceptance": round(self.total.rate, 4),
            "proposed": self.total.proposed,
            "accepted": self.total.accepted,
            "per_prompt": [round(a.rate, 4) for a in self.per_prompt],
            "min_acceptance": self.min_acceptance,
            "ok": self.ok,
        }


def smoke(
    path: Path,
    prompts: Optional[Sequence[str]] = None,
    max_tokens: int = 48,
    hidden: str = "post-norm",
    min_acceptance: float = DEFAULT_MIN_ACCEPTANCE,
) -> SmokeResult:
    from transformers import AutoTokenizer

    m = load(path)
    tok = AutoTokenizer.from_pretrained(str(path))
    result = SmokeResult(str(path), hidden, min_acceptance=min_acceptance)
    for text in prompts or DEFAULT_PROMPTS:
        ids = tok.encode(text)
        result.per_prompt.append(greedy_acceptance(m, ids, max_tokens, hidden))
    return result
