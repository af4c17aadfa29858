"""Rich tables for people; the JSON forms live next to the data (Plan.to_json, Report.to_json)."""

from __future__ import annotations

from collections import Counter

from rich.console import Console
from rich.table import Table

from .plan import Plan
from .verify import ERROR, Report


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def plan_table(plan: Plan, console: Console, limit: int = 0) -> None:
    table = Table(title=f"conversion plan: {plan.source}", show_lines=False)
    for col in ("output tensor", "from", "steps", "shape", "out", "shard"):
        table.add_column(col, overflow="fold")
    items = plan.items if not limit else plan.items[:limit]
    for it in items:
        src = it.sources[0].key if len(it.sources) == 1 else f"{it.sources[0].key} (+{len(it.sources) - 1})"
        out = it.dtype if it.quant is None else f"{it.quant.bits}b/g{it.quant.group_size}/{it.quant.mode}"
        table.add_row(it.name, src, " → ".join(it.steps), "×".join(map(str, it.slot.shape)), out,
                      it.shard.replace(".safetensors", ""))
    console.print(table)
    if limit and len(plan.items) > limit:
        console.print(f"… {len(plan.items) - limit} more tensors (use --json for all)")
    plan_summary(plan, console)


def plan_summary(plan: Plan, console: Console) -> None:
    groups = plan.by_group()
    quant = Counter(
        (it.slot.group, "unquantized" if it.quant is None else f"{it.quant.bits}b/g{it.quant.group_size}/{it.quant.mode}")
        for it in plan.items
    )
    table = Table(title="summary")
    table.add_column("group")
    table.add_column("tensors", justify="right")
    table.add_column("in", justify="right")
    table.add_column("out", justify="right")
    table.add_column("quantization")
    for group, items in sorted(groups.items()):
        q = ", ".join(f"{n}× {spec}" for (g, spec), n in sorted(quant.items()) if g == group)
        table.add_row(group, str(len(items)), human_bytes(sum(i.in_bytes for i in items)),
                      human_bytes(sum(i.out_bytes for i in items)), q)
    console.print(table)
    console.print(
        f"layout {plan.style}, norm +1 shift: {'yes (raw source)' if plan.raw else 'no (already MLX)'}, "
        f"dtype {plan.dtype}, MTP layers kept: {plan.mtp_layers} (policy {plan.options.quant.mtp}), "
        f"{len(plan.shards)} output shard(s), {len(plan.dropped)} source tensor(s) dropped"
    )


def report_table(report: Report, console: Console) -> None:
    table = Table(title=f"verify: {report.path}", show_header=False)
    table.add_column("check")
    table.add_column("result", overflow="fold")
    mtp = f"{report.mtp_layers_found} found / {report.mtp_layers_config} in config"
    mtp += " (complete)" if report.mtp_complete else ""
    rows = [
        ("layout", f"{report.layout} ({'VLM wrapper' if report.vlm else 'text-only'})"),
        ("model", f"{report.model_type} ({'MoE' if report.moe else 'dense'})"),
        ("tensors / shards", f"{report.tensors} / {report.shards}"),
        ("MTP", mtp),
        ("experts", report.experts),
        ("norms", ", ".join(f"{g}: {s} (mean {report.norm_means[g]:.3f})" for g, s in report.norms.items()) or "-"),
        ("quantization", "; ".join(f"{g}: " + ", ".join(f"{n}× {k}" for k, n in c.items())
                                   for g, c in report.quantization.items()) or "-"),
        ("dtypes", "; ".join(f"{g}: " + ", ".join(f"{n}× {k}" for k, n in c.items())
                             for g, c in report.dtypes.items()) or "-"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    for f in report.findings:
        style = "red" if f.severity == ERROR else "yellow" if f.severity == "warning" else "dim"
        where = f" [{f.key}]" if f.key else ""
        console.print(f"[{style}]{f.severity.upper():7}[/{style}] {f.code}: {f.message}{where}", highlight=False)
    verdict = "[green]OK[/green]: loadable and MTP-consistent" if report.ok else "[red]FAILED[/red]"
    console.print(verdict)
