"""Rich tables for people; the JSON forms live next to the data (Plan.to_json, Report.to_json)."""

from __future__ import annotations

from collections import Counter
from typing import List

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..compat import RuntimeCompat, why
from ..plan import Plan
from ..verify import ERROR, Report


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def print_whole(table: Table, console: Console) -> None:
    """Print a table with no cell cut short: folded to fit a terminal, at its natural width when piped.

    Rich fits tables to the console width (80 columns when stdout is not a terminal) and ends
    cut cells with "…"; a piped table is read by a program or a log, which has no width.
    """
    for column in table.columns:
        column.overflow = "fold"
    if console.is_terminal:
        console.print(table)
        return
    natural = console.measure(table, options=console.options.update_width(1 << 16)).maximum
    wide = Console(file=console.file, width=max(console.width, natural), color_system=console.color_system,
                   force_terminal=False)
    wide.print(table)


def plan_table(plan: Plan, console: Console, limit: int = 0) -> None:
    table = Table(title=f"conversion plan: {plan.source}", show_lines=False)
    for col in ("output tensor", "from", "steps", "shape", "out", "shard"):
        table.add_column(col, overflow="fold")
    items = plan.items if not limit else plan.items[:limit]
    for it in items:
        src = it.sources[0].key if len(it.sources) == 1 else f"{it.sources[0].key} (+{len(it.sources) - 1})"
        out = it.dtype if it.quant is None else f"{it.quant.bits}b/g{it.quant.group_size}/{it.quant.mode}"
        table.add_row(it.name, src, " → ".join(s.label for s in it.steps), "×".join(map(str, it.slot.shape)), out,
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
        f"layout {plan.style}, norm +1 shift: {_shift_label(plan)}, "
        f"dtype {plan.dtype}, MTP layers kept: {plan.mtp_layers} (policy {plan.options.quant.mtp}), "
        f"{len(plan.shards)} output shard(s), {len(plan.dropped)} source tensor(s) dropped"
    )
    for note in plan.notes:
        console.print(f"note: {note}", highlight=False)


def report_table(report: Report, console: Console) -> None:
    table = Table(title=f"verify: {report.path}", show_header=False)
    table.add_column("check")
    table.add_column("result", overflow="fold")
    in_config = "not" if report.mtp_layers_config is None else report.mtp_layers_config
    mtp = f"{report.mtp_layers_found} found / {in_config} in config"
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
        # file and key, as the JSON gives them: a finding names where to look
        where = (f" [{f.key}]" if f.key else "") + (f" (file {f.file})" if f.file else "")
        console.print(f"[{style}]{f.severity.upper():7}[/{style}] {escape(f'{f.code}: {f.message}{where}')}",
                      highlight=False)
    verdict = "[green]OK[/green]: loadable and MTP-consistent" if report.ok else "[red]FAILED[/red]"
    console.print(verdict)


def _verdict_cell(ok, yes: str, no: str) -> str:
    return "[dim]n/a[/dim]" if ok is None else f"[green]{yes}[/green]" if ok else f"[red]{no}[/red]"


def runtimes_table(runtimes: List[RuntimeCompat], layout: str, console: Console) -> None:
    """The MTP runtime compatibility table (``mtpconvert.compat``, headers only): one row per runtime."""
    if not runtimes:
        return
    table = Table(title=f"MTP runtimes (head layout: {layout}; from headers)")
    table.add_column("runtime", no_wrap=True)
    table.add_column("version", max_width=18, overflow="fold")
    table.add_column("backbone\nexact?", no_wrap=True)
    table.add_column("head\nusable?", no_wrap=True)
    table.add_column("why", overflow="fold", ratio=1)
    for r in runtimes:
        table.add_row(r.runtime, r.versions, _verdict_cell(r.backbone_exact.ok, "yes", "no"),
                      _verdict_cell(r.head_usable.ok, "yes", "no"), escape(why(r)))
    console.print(table)


def divergence_text(d) -> str:
    margin = "" if d.margin is None else f", top-2 logit margin {d.margin:.3g}"
    return f"prompt {d.prompt} token {d.position} ({d.plain_token} vs {d.mtp_token}{margin})"


def bench_table(result, console: Console) -> None:
    """One row per (hidden convention, depth): acceptance, tokens/step, tok/s both ways, speedup, costs."""
    s = result.sampling
    mode = "greedy" if s.greedy else f"temp {s.temperature}, top-p {s.top_p}, top-k {s.top_k or 'off'}"
    oracle = bool(getattr(result, "oracle", ()))
    label = "; ORACLE-ACCEPTANCE P: drafts replaced by the true token with probability P" if oracle else ""
    table = Table(title=f"MTP speculative decoding vs mlx-lm's generate_step ({mode}; {result.prompts} prompts x "
                        f"{result.max_tokens} tokens; {result.to_json()['device']}{label})")
    if oracle:
        table.add_column("oracle P", justify="right")
    for col in ("h_t", "k", "accept (by depth)", "drafted", "tok/step", "mlx-lm tok/s", "MTP tok/s", "speedup",
                "our loop tok/s", "β / δ / ρ", "pred.", "ovh"):
        table.add_column(col, justify="left" if col == "h_t" else "right")
    for r in result.rows:
        by_depth = "/".join(f"{a:.0%}" for a in r.mtp.acceptance_by_depth)
        c = r.costs
        table.add_row(
            *([f"{r.oracle.p:g}" if r.oracle is not None else "-"] if oracle else []),
            r.hidden.replace("-norm", ""), str(r.depth), f"{r.mtp.acceptance:.1%} ({by_depth})", f"{r.mtp.draft_share:.1%}",
            f"{r.mtp.tokens_per_step:.2f}", f"{r.plain.decode_tps:.1f}", f"{r.mtp.decode_tps:.1f}",
            f"{r.speedup:.2f}x", f"{r.plain_loop.decode_tps:.1f}",
            f"{c.beta:.2f} / {c.delta:.2f} / {c.rho:.2f}" if c else "-",
            f"{c.predicted_speedup(r.mtp.tokens_per_step, r.reject_share):.2f}x" if c else "-",
            f"{r.overhead:.0%}" if r.overhead is not None else "-",
        )
    print_whole(table, console)
    for r in result.rows:
        if r.divergences:
            console.print(f"[yellow]greedy MTP output differs from mlx-lm's[/yellow] ({r.hidden} k={r.depth}): "
                          + "; ".join(divergence_text(d) for d in r.divergences))
    console.print("speedup: MTP tok/s ÷ mlx-lm tok/s (mlx_lm.generate.generate_step, same sampler and prompts); "
                  "our loop: mtpconvert's synchronous plain loop, a cross-check; "
                  "accept: accepted/proposed drafts; drafted: share of emitted tokens that came from drafts; "
                  "β: verify pass / decode step; δ: head steps / decode step; ρ: undo after a rejection / decode step; "
                  "pred.: tok/step ÷ (β + δ + ρ × share of steps with a rejection); "
                  "ovh: share of an MTP step outside model calls", style="dim")


def concurrency_table(result, console: Console) -> None:
    """One row per (depth, concurrency): aggregate and per-stream tok/s of each decoder, speedups, acceptance."""
    s = result.sampling
    mode = "greedy" if s.greedy else f"temp {s.temperature}, top-p {s.top_p}, top-k {s.top_k or 'off'}"
    j = result.to_json()
    table = Table(title=f"Batched MTP vs mlx-lm's BatchGenerator ({mode}; {result.max_tokens} tokens per stream; "
                        f"{j['device']})")
    for col in ("k", "streams", "BatchGenerator tok/s", "plain engine", "MTP tok/s", "MTP per stream", "speedup",
                "auto tok/s", "auto drafted", "auto speedup", "accept by stream"):
        table.add_column(col, justify="right")
    for r in result.rows:
        bg, pl, mtp, auto = (r.runs[n] for n in ("batchgen", "plain", "mtp", "auto"))
        table.add_row(
            str(r.depth), str(r.concurrency), f"{bg.aggregate_tps:.1f}", f"{pl.aggregate_tps:.1f}",
            f"{mtp.aggregate_tps:.1f}", f"{mtp.per_stream_tps:.1f}", f"{r.speedup('mtp'):.2f}x",
            f"{auto.aggregate_tps:.1f}", f"{auto.drafted_steps}/{auto.steps}", f"{r.speedup('auto'):.2f}x",
            " ".join(f"{a:.0%}" for a in mtp.acceptance),
        )
    print_whole(table, console)
    for depth, cross in j["crossover"].items():
        where = f"from {cross['mtp']} streams" if cross["mtp"] else "at none of the levels measured"
        console.print(f"k={depth}: batched MTP is slower than BatchGenerator {where}", highlight=False)
    if s.greedy:
        bad = [f"k={r.depth} C={r.concurrency}: {n}" for r in result.rows
               for n, same in r.greedy_identical().items() if not same]
        if bad:
            console.print(f"[yellow]greedy output differs from the plain batched engine[/yellow] ({'; '.join(bad)})")
    console.print("tok/s: decode tokens of all streams per second (prefill excluded); plain engine: our batched "
                  "step with drafting off; speedup: ÷ BatchGenerator; auto: drafting turned off for a step when "
                  "measured to lose at that batch size (DraftPolicy); accept: accepted/proposed drafts per stream",
                  style="dim")


def _shift_label(plan) -> str:
    if plan.norms_shifted:
        return "yes (raw source)"
    if plan.raw and plan.family.head.norms_zero_centred:
        return "no (zero-centred: the runtime adds 1)"
    return "no (already MLX)" if plan.family.head.norms_zero_centred else "no (plain RMSNorm gains)"


def oracle_concurrency_table(result, console: Console) -> None:
    """``bench --concurrency ... --oracle-acceptance P``: one row per (depth, streams, P)."""
    table = Table(title=f"Batched MTP vs mlx-lm's BatchGenerator at ORACLE-ACCEPTANCE P (greedy; {result.max_tokens} "
                        f"tokens per stream; {result.to_json()['device']})")
    for col in ("oracle P", "k", "streams", "BatchGenerator tok/s", "plain engine", "MTP tok/s", "speedup", "pred.",
                "auto tok/s (drafted)", "auto / best", "β / δ / ρ", "accept by stream"):
        table.add_column(col, justify="right")
    for r in result.rows:
        c = r.costs
        table.add_row(f"{r.p:g}", str(r.depth), str(r.concurrency), f"{r.batchgen.aggregate_tps:.1f}",
                      f"{r.plain.aggregate_tps:.1f}", f"{r.mtp.aggregate_tps:.1f}", f"{r.speedup():.2f}x",
                      f"{r.predicted():.2f}x",
                      f"{r.auto.aggregate_tps:.1f} ({r.auto.drafted_steps}/{r.auto.steps})",
                      f"{r.auto_vs_best():.2f}", f"{c.beta:.2f} / {c.delta:.2f} / {c.rho:.2f}",
                      " ".join(f"{a:.0%}" for a in r.mtp.acceptance))
    print_whole(table, console)
    console.print("oracle-acceptance P: each greedy draft the head proposes kept with probability P, else rejected "
                  "(head, verify pass and undo run as always); speedup: MTP ÷ BatchGenerator tok/s; pred.: tokens per "
                  "row-step ÷ (β + δ + ρ × share of row-steps with a rejection), costs timed over C sequences at "
                  "one context; auto: DraftPolicy deciding each step under the same oracle, its first decode after a "
                  "calibration (auto / best: over the "
                  "fastest of BatchGenerator, plain and MTP)", style="dim")
