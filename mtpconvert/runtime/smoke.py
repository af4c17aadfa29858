"""`mtpconvert smoke`: does the MTP head of a folder draft tokens the backbone accepts?

Runs the real draft/verify loop (greedy, depth 1) next to plain greedy decoding on a few
prompts: acceptance below the floor fails, and so does MTP output that differs from the
plain decode (a wrong rollback would show there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence

from .load import MTPModel, load
from .speculative import DecodeStats, mtp_generate, plain_generate

DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Here is a short story about a robot who learns to paint:",
)
# Chosen on the text fixtures with these prompts (docs/runtime.md): every correct conversion,
# down to a 2-bit head over a 4-bit backbone, accepted >= 46.9% of greedy drafts; every broken
# one < 39% (head norms without +1 0%, fc halves swapped 2.9%, MoE experts reversed 35-39%).
# Real releases accept ~75-85%.
DEFAULT_MIN_ACCEPTANCE = 0.40


@dataclass
class SmokeResult:
    path: str
    hidden: str
    min_acceptance: float = DEFAULT_MIN_ACCEPTANCE
    mtp: DecodeStats = field(default_factory=DecodeStats)
    plain: DecodeStats = field(default_factory=DecodeStats)
    per_prompt: List[float] = field(default_factory=list)
    mismatched_prompts: List[int] = field(default_factory=list)

    @property
    def acceptance(self) -> float:
        return self.mtp.acceptance

    @property
    def identical(self) -> bool:
        return not self.mismatched_prompts

    @property
    def ok(self) -> bool:
        return self.acceptance >= self.min_acceptance and self.identical

    def to_json(self) -> dict:
        return {
            "path": self.path,
            "hidden": self.hidden,
            "acceptance": round(self.acceptance, 4),
            "proposed": sum(self.mtp.proposed),
            "accepted": sum(self.mtp.accepted),
            "per_prompt": [round(a, 4) for a in self.per_prompt],
            "identical_to_plain_greedy": self.identical,
            "mismatched_prompts": self.mismatched_prompts,
            "min_acceptance": self.min_acceptance,
            "ok": self.ok,
        }


def encode_prompts(path: Path, prompts: Optional[Sequence[str]]) -> List[List[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))  # never trust_remote_code
    return [tok.encode(text) for text in (prompts or DEFAULT_PROMPTS)]


def smoke(
    path: Path,
    prompts: Optional[Sequence[str]] = None,
    max_tokens: int = 48,
    hidden: str = "post-norm",
    min_acceptance: float = DEFAULT_MIN_ACCEPTANCE,
    model: Optional[MTPModel] = None,
) -> SmokeResult:
    m = model or load(path)
    result = SmokeResult(str(path), hidden, min_acceptance=min_acceptance)
    for i, ids in enumerate(encode_prompts(path, prompts)):
        plain, ps = plain_generate(m, ids, max_tokens)
        spec, ms = mtp_generate(m, ids, max_tokens, hidden=hidden)
        result.plain.add(ps)
        result.mtp.add(ms)
        result.per_prompt.append(ms.acceptance)
        if spec != plain:
            result.mismatched_prompts.append(i)
    return result
