"""Plot benchmarks/series.py results: source size vs wall time and vs peak RSS, per tool.

    python -m benchmarks.plot benchmarks/results/series.json benchmarks/results/scaling.png   (needs matplotlib: pip install -e '.[bench]')

Every tool in the results is drawn; ``tool@cpu`` runs (MLX's CPU backend on a GPU machine) are
labelled as such.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

TOOLS = {"mlx_lm": "mlx_lm.convert (drops MTP)", "mtpconvert-drop": "mtpconvert --mtp drop",
         "mtpconvert": "mtpconvert (MTP kept)"}


def main(src: Path, out: Path) -> None:
    results = json.loads(src.read_text())
    points = sorted(results.values(), key=lambda r: r["source_bytes"])
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    gib = 2**30
    tools = sorted({t for p in points for t in p["runs"]}, key=lambda t: (t.endswith("@cpu"), list(TOOLS).index(t.split("@")[0])))
    for tool in tools:
        label = TOOLS[tool.split("@")[0]] + (", CPU backend" if tool.endswith("@cpu") else "")
        for kind, marker in (("dense", "o"), ("moe", "s")):
            pts = [p for p in points if ("A3B" in p["model"]) == (kind == "moe") and tool in p["runs"]]
            xs = [p["source_bytes"] / gib for p in pts]
            ax_t.plot(xs, [p["runs"][tool]["wall_s"] for p in pts], marker=marker,
                      label=f"{label}, {kind}", linestyle="-" if kind == "dense" else "none")
            ax_m.plot(xs, [p["runs"][tool]["peak_rss_kib"] / 2**20 for p in pts], marker=marker,
                      label=f"{label}, {kind}", linestyle="-" if kind == "dense" else "none")
    ax_t.set(xlabel="source checkpoint (GiB)", ylabel="wall time (s)", title="convert --bits 4: wall time")
    ax_m.set(xlabel="source checkpoint (GiB)", ylabel="peak RSS (GiB)", title="convert --bits 4: peak RSS")
    for ax in (ax_t, ax_m):
        ax.grid(alpha=0.3)
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
    ax_m.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
