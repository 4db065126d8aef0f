"""The leaderboard plots, as HTML fragments. plotly.js itself is written once next to the pages.

Only SVG traces (go.Scatter, go.Box), never WebGL ones: the report must render anywhere, headless
browsers without a GPU included.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from html import escape

import plotly.graph_objects as go

from aspire_bench.report.colors import styles
from aspire_bench.report.leaderboard import Board, Row, name_setups, prompt_length, setup_of

# How many requests' draft-length trajectories to draw per row: enough to show that they differ.
TRAJECTORY_REQUESTS = 3
HEIGHT = 380


def row_name(row: Row) -> str:
    return f"{row.label} [{row.setup}]" if row.setup else row.label


def _div(fig: go.Figure, div_id: str, title: str, x: str, y: str) -> str:
    """The plot under its title. The title is HTML above the plot, not plotly's: it wraps in a narrow box
    and the plot's toolbar (top right) never covers it."""
    fig.update_layout(xaxis_title=x, yaxis_title=y, template="plotly_white", height=HEIGHT,
                      margin={"l": 60, "r": 20, "t": 30, "b": 50}, legend={"font": {"size": 10}})
    html = fig.to_html(full_html=False, include_plotlyjs=False, div_id=re.sub(r"[^A-Za-z0-9_-]", "-", div_id),
                       default_height=f"{HEIGHT}px", config={"displaylogo": False, "responsive": True})
    return f"<div class=\"plot\"><div class=\"plot-title\">{escape(title)}</div>{html}</div>"


def _style(fig: go.Figure) -> None:
    """Each trace in its decoder's colour (trace.meta holds the decoder's name); a decoder's second
    trace in a plot gets another dash and marker."""
    for trace, st in zip(fig.data, styles([t.meta for t in fig.data])):
        if isinstance(trace, go.Box):
            trace.update(marker_color=st["color"], line_color=st["color"])
        else:
            trace.update(line={"color": st["color"], "dash": st["dash"]},
                         marker={"color": st["color"], "symbol": st["symbol"]})


def speedup_vs_context(boards: Sequence[Board], div_id: str, title: str) -> str | None:
    """Speedup over AR against context length, one line per decoder and setup (the ASPIRE paper's
    Figure 1 view), with its 95% interval. Rows of different setups (batch size, sampling, ...) are
    never joined: each setup is a line of its own, named by the settings that tell it apart."""
    series: dict[tuple, list[tuple]] = {}
    setups: dict[tuple, dict] = {}
    for b in boards:
        for row in b.rows:
            x, y = prompt_length(row), row.value("speedup")
            if x is not None and y is not None:
                setup = setup_of(row.run)
                key = (row.label, row.decoder, tuple(sorted(setup.items())))
                setups[key] = setup
                series.setdefault(key, []).append((x, y, b.context, row.value("speedup_ci95")))
    if not series:
        return None
    keys = list(series)
    # Among the lines of one decoder label, the settings that differ name them.
    names = {}
    for label in dict.fromkeys(k[0] for k in keys):
        mine = [k for k in keys if k[0] == label]
        for k, setup in zip(mine, name_setups([setups[k] for k in mine])):
            names[k] = f"{label} [{setup}]" if setup else label
    fig = go.Figure()
    for key in keys:
        pts, name = sorted(series[key], key=lambda p: p[0]), names[key]
        ci = [p[3] for p in pts]
        err = {"type": "data", "symmetric": False, "array": [c[1] - p[1] if c else 0 for p, c in zip(pts, ci)],
               "arrayminus": [p[1] - c[0] if c else 0 for p, c in zip(pts, ci)], "thickness": 1.2, "width": 4}
        hover = [f"{p[2]}: {p[0]} tokens<br>speedup {p[1]:.2f}×" + (f" [{c[0]:.2f}, {c[1]:.2f}]" if c else "")
                 for p, c in zip(pts, ci)]
        fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers", name=name,
                                 meta=key[1], error_y=err if any(ci) else None, text=hover,
                                 hovertemplate="%{text}<extra>" + escape(name) + "</extra>"))
    _style(fig)
    xs = {x for pts in series.values() for x, *_ in pts}
    if len(xs) == 1:  # one context: a readable axis around it, not plotly's ±1 token
        x = next(iter(xs))
        fig.update_xaxes(range=[0.5 * x, 1.5 * x])
    fig.add_hline(y=1.0, line_dash="dot", line_color="#888")
    return _div(fig, div_id, title, "context length (median prompt tokens)", "speedup over AR (×), 95% interval")


def accepted_length_distribution(board: Board, div_id: str) -> str | None:
    """Each request's mean accepted length, per decoder: the spread that per-request scheduling exploits."""
    fig = go.Figure()
    for row in board.rows:
        values = [r.figures.get("mean_accepted_len") for r in row.run.requests]
        ids = [r.id for r, v in zip(row.run.requests, values) if v is not None]
        values = [v for v in values if v is not None]
        if values:
            fig.add_trace(go.Box(y=values, name=row_name(row), boxpoints="all", jitter=0.4, pointpos=0, meta=row.decoder,
                                 text=ids, hovertemplate="%{text}: %{y:.2f}<extra></extra>"))
    if not fig.data:
        return None
    _style(fig)
    return _div(fig, div_id, "mean accepted length per request", "", "tokens per verification")


def acceptance_by_position(board: Board, div_id: str) -> str | None:
    fig = go.Figure()
    for row in board.rows:
        pts = sorted((int(k[len("accept_rate_pos"):]), v) for k, v in row.summary.items()
                     if k.startswith("accept_rate_pos") and v is not None)
        if pts:
            fig.add_trace(go.Scatter(x=[k for k, _ in pts], y=[v for _, v in pts], mode="lines+markers",
                                     name=row_name(row), meta=row.decoder))
    if not fig.data:
        return None
    _style(fig)
    fig.update_yaxes(range=[0, 1.05])
    return _div(fig, div_id, "acceptance by draft position", "draft position k (0-based)",
                "P(k accepted | draft reached k)")


def latency_cdf(board: Board, div_id: str) -> str | None:
    """Empirical CDF over requests of TPOT, one step line per decoder."""
    fig = go.Figure()
    for row in board.rows:
        tpots = sorted(1000 * r.figures["tpot_s"] for r in row.run.requests if r.figures.get("tpot_s") is not None)
        if tpots:
            n = len(tpots)
            fig.add_trace(go.Scatter(x=tpots, y=[(i + 1) / n for i in range(n)], mode="lines+markers",
                                     line_shape="hv", name=row_name(row), meta=row.decoder))
    if not fig.data:
        return None
    _style(fig)
    fig.update_yaxes(range=[0, 1.02])
    return _div(fig, div_id, "TPOT distribution over requests (CDF)", "TPOT (ms)", "fraction of requests ≤ x")


def draft_trajectories(board: Board, div_id: str) -> str | None:
    """Draft length chosen at each verification, for a few requests of each decoder that records it."""
    fig = go.Figure()
    for row in board.rows:
        shown = [r for r in row.run.requests if r.draft_lengths][:TRAJECTORY_REQUESTS]
        for r in shown:
            lengths = r.draft_lengths
            fig.add_trace(go.Scatter(x=list(range(len(lengths))), y=lengths, mode="lines+markers", line_shape="hv",
                                     name=f"{row_name(row)} · {r.id}", meta=row.decoder))
    if not fig.data:
        return None
    _style(fig)
    return _div(fig, div_id, "draft length over a request (ASPIRE scheduler)", "verification #", "draft length")


# --- diagnostics (`aspire-bench diagnose`) ---------------------------------------------------------

BUDGET_COLORS = ("#636efa", "#ef553b", "#00cc96", "#ab63fa", "#ffa15a", "#19d3f3")  # plotly's first six


def mean_recall_rows(rows: list[dict]) -> dict[tuple[str, int], dict[str, float]]:
    """{(unit, k): {predictor: recall averaged over layers}}."""
    out: dict[tuple[str, int], dict[str, float]] = {}
    for r in rows:
        if r["layer"] == "mean":
            out.setdefault((r["unit"], r["k"]), {})[r["predictor"]] = r["recall"]
    return out


def budget_label(unit: str, k: int) -> str:
    return f"{k} {'tokens' if unit == 'tokens' else 'pages'}"


def recall_vs_lag(rows: list[dict], div_id: str) -> str | None:
    """Temporal reuse against its lag, one line per budget; the cross-layer view of the last-but-one layer
    (ASPIRE's refresh, one token back) as a dotted line of the same budget for comparison."""
    fig, lags = go.Figure(), set()
    for b, ((unit, k), means) in enumerate(mean_recall_rows(rows).items()):
        color = BUDGET_COLORS[b % len(BUDGET_COLORS)]  # a budget's lines share a colour
        pts = sorted((int(p.split("=")[1]), v) for p, v in means.items() if p.startswith("temporal:lag="))
        if not pts:
            continue
        lags.update(g for g, _ in pts)
        fig.add_trace(go.Scatter(x=[g for g, _ in pts], y=[v for _, v in pts], mode="lines+markers",
                                 name=f"temporal · {budget_label(unit, k)}", line_color=color))
        refresh = sorted((int(p.split("=")[1]), v) for p, v in means.items() if p.startswith("refresh:layer="))
        if len(refresh) > 1:
            layer, v = refresh[-2]
            fig.add_trace(go.Scatter(x=[pts[0][0], pts[-1][0]], y=[v, v], mode="lines", line_dash="dot",
                                     name=f"refresh:layer={layer} · {budget_label(unit, k)}", line_color=color))
    if not fig.data:
        return None
    fig.update_xaxes(type="log", tickvals=sorted(lags))  # the lags themselves, no log-scale minor ticks
    fig.update_yaxes(range=[0, 1.02])
    return _div(fig, div_id, "mass recall of temporal reuse vs lag (mean over layers)", "lag (tokens)",
                "mass recall@k")


def recall_vs_source_layer(rows: list[dict], div_id: str) -> str | None:
    """Cross-layer reuse (same token) and the refresh view (previous token) against their source layer."""
    fig = go.Figure()
    for b, ((unit, k), means) in enumerate(mean_recall_rows(rows).items()):
        for family, dash in (("cross-layer:from=", "solid"), ("refresh:layer=", "dot")):
            pts = sorted((int(p.split("=")[1]), v) for p, v in means.items() if p.startswith(family))
            if pts:
                fig.add_trace(go.Scatter(x=[j for j, _ in pts], y=[v for _, v in pts], mode="lines+markers",
                                         name=f"{family.split(':')[0]} · {budget_label(unit, k)}",
                                         line={"color": BUDGET_COLORS[b % len(BUDGET_COLORS)], "dash": dash}))
    if not fig.data:
        return None
    fig.update_yaxes(range=[0, 1.02])
    return _div(fig, div_id, "mass recall vs source layer (mean over the layers it predicts)", "source layer",
                "mass recall@k")


def accepted_mean_histogram(requests: list[dict], draft_len: int, div_id: str) -> str | None:
    """How the per-request mean accepted drafts spread (the paper: 2.56 to 20.00 of 20)."""
    means = [r["mean"] for r in requests if r.get("mean") is not None]
    if not means:
        return None
    fig = go.Figure(go.Histogram(x=means, xbins={"start": 0, "end": draft_len + 1e-9, "size": max(draft_len / 20, 0.5)},
                                 name="requests", hovertemplate="%{x}: %{y} requests<extra></extra>"))
    fig.update_xaxes(range=[0, draft_len])
    return _div(fig, div_id, f"mean accepted drafts per request (D = {draft_len})", "accepted drafts per round",
                "requests")


def accepted_per_round_box(requests: list[dict], draft_len: int, div_id: str) -> str | None:
    """Each request's accepted drafts round by round: the fluctuation within a request."""
    fig = go.Figure()
    for i, r in enumerate(requests):
        if r.get("accepted"):  # named by index (request ids are long); the id shows on hover
            fig.add_trace(go.Box(y=r["accepted"], name=str(i), boxpoints="all", jitter=0.4, pointpos=0,
                                 showlegend=False, hovertemplate=f"{r['id']}: %{{y}}<extra></extra>"))
    if not fig.data:
        return None
    fig.update_yaxes(range=[-0.5, draft_len + 0.5])
    return _div(fig, div_id, "accepted drafts per round, per request", "request (index)", "accepted drafts")
