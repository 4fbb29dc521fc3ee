"""``stepwatch report``: a self-contained HTML post-mortem of one job, plus a terminal summary.

Everything is queried from the store through the DuckDB views, aggregated in SQL to a size a plot
can show (steps and ranks are binned when there are more than a few hundred), drawn with
matplotlib into PNGs embedded as data URIs: one file to open in a browser or attach to a ticket.
"""
from __future__ import annotations

import base64
import html
import io
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stepwatch.storage import queries
from stepwatch.storage.views import connect, query

PHASES = [("data_ms", "data wait", "#4e79a7"), ("compute_ms", "compute", "#59a14f"),
          ("comm_ms", "comm", "#f28e2b"), ("comm_wait_ms", "comm wait", "#e15759"),
          ("gc_ms", "GC", "#b07aa1"), ("host_gap_ms", "host gap", "#9c755f")]
KIND_COLORS = {"slow_rank": "#e15759", "regression": "#f28e2b", "recovery": "#59a14f", "jitter": "#b07aa1",
               "stall": "#555555"}


@dataclass
class Report:
    html: str
    summary: str


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def label_rows(xs, span: float, rows: int = 4, gap: float = 0.12) -> list[int | None]:
    """Rows (0 = top) for labels anchored at ``xs`` (sorted) on an axis ``span`` long, so that two labels
    in the same row are at least ``gap * span`` apart; None: no room (the mark is drawn, unlabelled)."""
    last = [-math.inf] * rows
    out: list[int | None] = []
    for x in xs:
        for r in range(rows):
            if x - last[r] >= gap * span:
                last[r] = x
                out.append(r)
                break
        else:
            out.append(None)
    return out


def rank_axis(ax, n_bins: int, rbin: int) -> None:
    """Integer rank ticks on a heatmap whose row i holds ranks ``[i * rbin, (i + 1) * rbin)`` (the image
    drawn with ``extent`` y from ``n_bins * rbin - 0.5`` down to ``-0.5``)."""
    from matplotlib.ticker import FixedLocator, MaxNLocator

    if rbin == 1 and n_bins <= 16:
        ax.yaxis.set_major_locator(FixedLocator(list(range(n_bins))))
    else:
        ax.yaxis.set_major_locator(MaxNLocator(nbins=8, integer=True))
    ax.set_ylim(n_bins * rbin - 0.5, -0.5)


def _range_sql(t_from, t_to) -> tuple[str, list]:
    cond, params = "", []
    if t_from:
        cond += " AND t_end >= CAST(? AS TIMESTAMPTZ)"
        params.append(str(t_from))
    if t_to:
        cond += " AND t_end <= CAST(? AS TIMESTAMPTZ)"
        params.append(str(t_to))
    return cond, params


def build(data_dir: str | Path, job: str, t_from: str | None = None, t_to: str | None = None,
          max_points: int = 600, max_ranks: int = 256) -> Report:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    con = connect(data_dir)
    cond, rp = _range_sql(t_from, t_to)
    _, info = query(con, f"SELECT min(step), max(step), count(DISTINCT rank), min(t_end), max(t_end), count(*) "
                         f"FROM steps WHERE job = ?{cond}", [job] + rp)
    s_min, s_max, n_ranks, t_min, t_max, n_rows = info[0]
    if not n_rows:
        raise ValueError(f"no steps stored for job {job!r} in that range (try: stepwatch sql \"SELECT DISTINCT job FROM steps\")")
    n_steps = s_max - s_min + 1
    sbin = max(1, math.ceil(n_steps / max_points))
    rbin = max(1, math.ceil(n_ranks / max_ranks))

    # per step (binned): median over ranks of each phase, max step time
    _, rows = query(con, f"""
        WITH s AS (SELECT step, median(step_ms) AS step_ms,
                          median(data_ms) AS data_ms, median(compute_ms) AS compute_ms, median(comm_ms) AS comm_ms,
                          median(comm_wait_ms) AS comm_wait_ms, median(gc_ms) AS gc_ms
                   FROM steps WHERE job = ?{cond} GROUP BY step)
        SELECT step // {sbin} * {sbin} AS b, avg(step_ms), avg(data_ms), avg(compute_ms), avg(comm_ms),
               avg(comm_wait_ms), avg(gc_ms), max(step_ms)
        FROM s GROUP BY b ORDER BY b""", [job] + rp)
    a = np.array([[np.nan if v is None else v for v in r] for r in rows], dtype=float)
    steps, step_ms = a[:, 0], a[:, 1]
    ph = {k: np.nan_to_num(a[:, i + 2]) for i, k in enumerate(["data_ms", "compute_ms", "comm_ms", "comm_wait_ms", "gc_ms"])}
    ph["host_gap_ms"] = np.clip(step_ms - sum(ph.values()), 0, None)

    _, alerts = query(con, "SELECT alert_id, kind, status, step_first, step_detected, ranks, nodes, cause, cost_pct, "
                           "suggestion FROM alerts WHERE job = ? ORDER BY step_first, status", [job])
    firing = [r for r in alerts if r[2] == "firing"]
    resolved = {r[0]: r[4] for r in alerts if r[2] == "resolved"}

    figs = {}
    # 1. step time with change points
    fig, ax = plt.subplots(figsize=(11, 3.2))
    ax.plot(steps, step_ms, lw=1, color="#333")
    cps = sorted((r for r in firing if r[1] in ("regression", "recovery")), key=lambda r: r[3])
    rows_ = label_rows([r[3] for r in cps], max(s_max - s_min, 1))
    counts: dict[str, int] = {}
    for r, row in zip(cps, rows_):
        counts[r[1]] = counts.get(r[1], 0) + 1
        ax.axvline(r[3], color=KIND_COLORS[r[1]], ls="--", lw=1.2)
        if row is not None:                       # labels in up to 4 rows, never on top of each other
            ax.annotate(f"{r[1]} ({r[7]})", (r[3], 1.0), xycoords=("data", "axes fraction"), fontsize=8,
                        color=KIND_COLORS[r[1]], xytext=(3, -10 - 11 * row), textcoords="offset points")
    if cps:                                       # how many of each, labelled or not
        from matplotlib.lines import Line2D
        ax.legend([Line2D([], [], color=KIND_COLORS[k], ls="--") for k in counts],
                  [f"{k} ×{n}" for k, n in counts.items()], loc="lower right", fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("step time (ms, median over ranks)")
    ax.grid(alpha=0.3)
    figs["step_time"] = _png(fig)

    # 2. ranks x steps busy-time heatmap (relative to each step's median)
    _, hm = query(con, f"""
        SELECT step // {sbin} AS sb, rank // {rbin} AS rb, avg(step_ms - coalesce(comm_wait_ms, 0)) AS busy
        FROM steps WHERE job = ?{cond} GROUP BY sb, rb""", [job] + rp)
    hb = np.array(hm, dtype=float)
    S = int(hb[:, 0].max() - hb[:, 0].min() + 1)
    Rb = int(hb[:, 1].max() + 1)
    grid = np.full((Rb, S), np.nan)
    grid[hb[:, 1].astype(int), (hb[:, 0] - hb[:, 0].min()).astype(int)] = hb[:, 2]
    rel = 100 * (grid / np.nanmedian(grid, axis=0, keepdims=True) - 1)
    fig, ax = plt.subplots(figsize=(11, 3.8))
    vmax = max(5.0, float(np.nanpercentile(np.abs(rel), 99.9)))
    im = ax.imshow(rel, aspect="auto", cmap="RdBu_r", vmin=-vmax, vmax=vmax, interpolation="nearest",
                   extent=[s_min, s_max + 1, Rb * rbin - 0.5, -0.5])
    rank_axis(ax, Rb, rbin)
    fig.colorbar(im, ax=ax, label="busy time vs step median (%)")
    ax.set_xlabel("step")
    ax.set_ylabel(f"rank{'' if rbin == 1 else f' (bins of {rbin})'}")
    figs["heatmap"] = _png(fig)

    # 3. phase breakdown
    fig, ax = plt.subplots(figsize=(11, 3.2))
    ax.stackplot(steps, *[ph[k] for k, _, _ in PHASES], labels=[n for _, n, _ in PHASES],
                 colors=[c for _, _, c in PHASES], alpha=0.9)
    ax.set_xlabel("step")
    ax.set_ylabel("ms (median over ranks)")
    ax.legend(loc="upper left", ncol=6, fontsize=8)
    ax.grid(alpha=0.3)
    figs["phases"] = _png(fig)

    # 4. alert timeline
    fig, ax = plt.subplots(figsize=(11, max(1.6, 0.35 * len(firing) + 0.8)))
    for i, r in enumerate(firing):
        end = resolved.get(r[0], s_max)
        ax.barh(i, max(end - r[3], 1), left=r[3], color=KIND_COLORS.get(r[1], "#777"), height=0.6)
        who = f" rank {','.join(map(str, r[5][:3]))}" if r[5] else ""
        ax.text(r[3], i, f" {r[1]}{who} · {r[7]}", va="center", fontsize=8)
    ax.set_xlim(s_min, s_max + 1)
    ax.set_yticks([])
    ax.set_xlabel("step")
    ax.invert_yaxis()
    figs["alerts"] = _png(fig)

    # 5. cost per cause
    cols_c, cost = queries.run(con, "card_hours_lost", job=job, t_from=t_from, t_to=t_to)
    fig, ax = plt.subplots(figsize=(6, 2.6))
    if cost:
        ax.barh([r[0] for r in cost], [r[3] or 0 for r in cost], color="#e15759")
        ax.invert_yaxis()
    ax.set_xlabel("card-hours lost (estimate)")
    figs["cost"] = _png(fig)

    cols_s, slow = queries.run(con, "slowest_ranks", job=job, t_from=t_from, t_to=t_to)
    _, jit = query(con, f"""
        WITH s AS (SELECT step, max(step_ms) AS step_ms FROM steps WHERE job = ?{cond} GROUP BY step),
        w AS (SELECT step_ms, median(step_ms) OVER (ORDER BY step ROWS BETWEEN 10 PRECEDING AND 10 FOLLOWING) AS m FROM s)
        SELECT avg(CASE WHEN step_ms > 1.1 * m THEN 1.0 ELSE 0.0 END) FROM w""", [job] + rp)
    jitter = 100 * (jit[0][0] or 0)

    lines = [f"job {job}: {n_ranks:,} ranks, steps {s_min}–{s_max} ({n_rows:,} step rows), {t_min} → {t_max}",
             f"median step time {np.nanmedian(step_ms):.1f} ms; jitter ratio {jitter:.1f}% of steps > 1.1x local median",
             f"alerts: {len(firing)} fired, {len(resolved)} resolved"]
    for r in firing:
        who = f" rank {r[5][0]} on {r[6][0]}" if r[5] else ""
        lines.append(f"  - {r[1]}{who} from step {r[3]} (detected {r[4]}), cause {r[7]}, cost ≈ {r[8]:.1f}%")
    if slow:
        top = dict(zip(cols_s, slow[0]))
        lines.append(f"slowest rank: {top['rank']} on {top['node']}, busy {top['busy_ms']} ms "
                     f"({top['slower_pct']:+.1f}% vs median rank)")
    summary = "\n".join(lines)

    def table(cols, rows):
        head = "".join(f"<th>{html.escape(str(c))}</th>" for c in cols)
        body = "".join("<tr>" + "".join(f"<td>{html.escape('' if v is None else (f'{v:,.2f}' if isinstance(v, float) else str(v)))}</td>"
                                        for v in r) + "</tr>" for r in rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    alert_rows = [(r[1], r[2], r[3], r[4], ", ".join(map(str, r[5] or [])), ", ".join(r[6] or []), r[7],
                   r[8], r[9]) for r in alerts]
    doc = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>stepwatch report — {html.escape(job)}</title>
<style>
body {{ font-family: system-ui, -apple-system, Segoe UI, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }}
h1 {{ font-size: 1.5em; margin-bottom: 0.2em; }} h2 {{ font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }}
pre.summary {{ background: #f6f8fa; padding: 1em; border-radius: 6px; white-space: pre-wrap; }}
table {{ border-collapse: collapse; font-size: 0.85em; width: 100%; }}
th, td {{ border: 1px solid #ddd; padding: 4px 6px; text-align: left; vertical-align: top; }}
th {{ background: #f0f0f0; }} img {{ max-width: 100%; }} .muted {{ color: #777; font-size: 0.85em; }}
</style></head><body>
<h1>stepwatch post-mortem: {html.escape(job)}</h1>
<p class="muted">generated {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} from {html.escape(str(Path(data_dir).absolute()))}</p>
<pre class="summary" id="summary">{html.escape(summary)}</pre>
<h2>Step time and change points</h2><img alt="step time" src="{figs['step_time']}">
<h2>Busy time, ranks × steps</h2><p class="muted">each cell: busy time (step time − comm wait) relative to that step's median rank; red = slower</p>
<img alt="busy-time heatmap" src="{figs['heatmap']}">
<h2>Phase breakdown</h2><img alt="phases" src="{figs['phases']}">
<h2>Alert timeline</h2><img alt="alert timeline" src="{figs['alerts']}">
{table(["kind", "status", "step first", "step detected", "ranks", "nodes", "cause", "cost %", "suggestion"], alert_rows)}
<h2>Cost per cause</h2><img alt="cost per cause" src="{figs['cost']}">
{table(cols_c, cost)}
<h2>Slowest ranks</h2>
{table(cols_s, slow)}
</body></html>"""
    con.close()
    return Report(doc, summary)
