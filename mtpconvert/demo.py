"""The offline demo: bundled raw fixture -> convert --bits 4 -> verify -> MTP smoke.

    python -m mtpconvert.demo [--out demo-out] [--variant dense|moe]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from .execute import execute
from .fixture import fixture_path
from .fixture.language import MarkovLanguage
from .plan import ConvertOptions, build_plan
from .quant import QuantOptions
from .render import plan_summary, report_table
from .runtime.smoke import smoke
from .source import open_checkpoint
from .verify import verify


def fixture_prompts(n: int = 4, length: int = 12, seed: int = 1234):
    lang = MarkovLanguage()
    rng = np.random.default_rng(seed)
    return [lang.text(lang.sample(length, rng)) for _ in range(n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("demo-out"))
    ap.add_argument("--variant", choices=["dense", "moe"], default="dense")
    args = ap.parse_args(argv)
    console = Console()
    src = fixture_path(args.variant)
    console.rule(f"mtpconvert demo: {src.name} (raw Hugging Face layout, bundled)")
    results = []
    # The fixture's hidden size is 96, so group 32 lets every weight be quantized.
    for label, quant in [("--bits 4 (MTP kept at bf16)", dict(bits=4, group_size=32)),
                         ("--bits 4 --mtp match", dict(bits=4, group_size=32, mtp="match")),
                         ("--bits 8 --mtp match", dict(bits=8, group_size=32, mtp="match")),
                         ("no quantization", dict())]:
        out = args.out / label.split(" (")[0].replace("--", "").replace(" ", "_")
        if out.exists():
            shutil.rmtree(out)
        ckpt = open_checkpoint(src)
        plan = build_plan(ckpt, ConvertOptions(dtype="bfloat16", quant=QuantOptions(**quant)))
        if not results:
            plan_summary(plan, console)
        execute(plan, ckpt, out)
        report = verify(out)
        if not results:
            report_table(report, console)
        res = smoke(out, fixture_prompts())
        results.append((label, out, report.ok, res))
    table = Table(title="MTP greedy draft acceptance (depth 1, post-norm hidden state)")
    for col in ("conversion", "verify", "drafts accepted", "acceptance", "smoke"):
        table.add_column(col)
    for label, out, ok, res in results:
        t = res.total
        table.add_row(label, "ok" if ok else "FAILED", f"{t.accepted}/{t.proposed}", f"{t.rate:.1%}",
                      "pass" if res.ok else "FAIL")
    console.print(table)
    console.print(f"output folders under {args.out}/ (load them with mlx_lm.load)")
    return 0 if all(ok and res.ok for _, _, ok, res in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
