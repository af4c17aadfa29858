"""What verify reports: findings with stable codes (for CI and tests) and the folder's summary."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

ERROR, WARNING, INFO = "error", "warning", "info"


@dataclass
class Finding:
    code: str
    severity: str
    message: str
    key: Optional[str] = None
    file: Optional[str] = None


@dataclass
class Report:
    path: str
    layout: str = "unknown"  # raw-vlm | raw-text | mlx
    model_type: str = "unknown"
    moe: bool = False
    vlm: bool = False
    tensors: int = 0
    shards: int = 0
    mtp_layers_config: Optional[int] = 0  # None: config.json does not say
    mtp_layers_found: int = 0
    mtp_complete: bool = False
    experts: str = "n/a"  # stacked | per-expert | fused | mixed | n/a
    norms: Dict[str, str] = field(default_factory=dict)  # group -> zero-centred | shifted | double-shifted
    norm_means: Dict[str, float] = field(default_factory=dict)
    quantization: Dict[str, Dict[str, int]] = field(default_factory=dict)  # group -> spec -> count
    dtypes: Dict[str, Dict[str, int]] = field(default_factory=dict)
    findings: List[Finding] = field(default_factory=list)
    mtp_layout: str = "unknown"  # compat.layout_of: sidecar | in-model | drafter | none | mixed:...
    runtimes: list = field(default_factory=list)  # compat.RuntimeCompat per MTP runtime

    @property
    def ok(self) -> bool:
        return not any(f.severity == ERROR for f in self.findings)

    def add(self, code: str, severity: str, message: str, key: Optional[str] = None, file=None) -> None:
        self.findings.append(Finding(code, severity, message, key, str(file) if file else None))

    def to_json(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        return d
