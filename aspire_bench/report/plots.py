"""The leaderboard plots, as HTML fragments. plotly.js itself is written once next to the pages.

Only SVG traces (go.Scatter, go.Box), never WebGL ones: the report must render anywhere, headless
browsers without a GPU included.
"""
from __future__ import annotations

import re
from collections.abc import Sequence

import plotly.graph_objects as go

from aspire_bench.report.leaderboard import Board, Row, prompt_length

# How many requests' draft-length trajectories to draw per row: enough to show that they differ.
TRAJECTORY_REQUESTS = 3
HEIGHT = 380


def row_name(row: Row) -> str:
    return f"{row.label} [{row.setup}]" if row.setup else row.label


def _div(fig: go.Figure, div_id: str, title: str, x: str, y: str) -> str:
    fig.update_layout(title=title, xaxis_title=x, yaxis_title=y, template="plotly_white", height=HEIGHT,
                      margin={"l": 60, "r": 20, "t": 50, "b": 50}, legend={"font": {"size": 10}})
    html = fig.to_html(full_html=False, include_plotlyjs=False, div_id=re.sub(r"[^A-Za-z0-9_-]", "-", div_id),
                       default_height=f"{HEIGHT}px", config={"displaylogo": False, "responsive": True})
    return f"<div class=\"plot\">{html}</div>"


def speedup_vs_context(boards: Sequence[Board], div_id: str, title: str) -> str | None:
    """Speedup over AR against context length, one line per decoder (the ASPIRE paper's Figure 1 view)."""
    series: dict[str, list[tuple[float, float, str]]] = {}
    for b in boards:
        for row in b.rows:
            x, y = prompt_length(row), row.value("speedup")
            if x is not None and y is not None:
                series.setdefault(row_name(row), []).append((x, y, b.context))
    if not series:
        return None
    fig = go.Figure()
    for name, pts in series.items():
        pts.sort()
        fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers", name=name,
                                 text=[p[2] for p in pts],
                                 hovertemplate="%{text}: %{x} tokens<br>speedup %{y:.2f}×<extra>" + name + "</extra>"))
    fig.add_hline(y=1.0, line_dash="dot", line_color="#888")
    return _div(fig, div_id, title, "context length (median prompt tokens)", "speedup over AR (×)")


def accepted_length_distribution(board: Board, div_id: str) -> str | None:
    """Each request's mean accepted length, per decoder: the spread that per-request scheduling exploits."""
    fig = go.Figure()
    for row in board.rows:
        values = [r.figures.get("mean_accepted_len") for r in row.run.requests]
        ids = [r.id for r, v in zip(row.run.requests, values) if v is not None]
        values = [v for v in values if v is not None]
        if values:
            fig.add_trace(go.Box(y=values, name=row_name(row), boxpoints="all", jitter=0.4, pointpos=0,
                                 text=ids, hovertemplate="%{text}: %{y:.2f}<extra></extra>"))
    if not fig.data:
        return None
    return _div(fig, div_id, "mean accepted length per request", "", "tokens per verification")


def acceptance_by_position(board: Board, div_id: str) -> str | None:
    fig = go.Figure()
    for row in board.rows:
        pts = sorted((int(k[len("accept_rate_pos"):]), v) for k, v in row.summary.items()
                     if k.startswith("accept_rate_pos") and v is not None)
        if pts:
            fig.add_trace(go.Scatter(x=[k for k, _ in pts], y=[v for _, v in pts], mode="lines+markers",
                                     name=row_name(row)))
    if not fig.data:
        return None
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
                                     line_shape="hv", name=row_name(row)))
    if not fig.data:
        return None
    fig.update_yaxes(range=[0, 1.02])
    return _div(fig, div_id, "TPOT distribution over requests (CDF)", "TPOT (ms)", "fraction of requests ≤ x")


def draft_trajectories(board: Board, div_id: str) -> str | None:
    """Draft length chosen at each verification, for a few requests of each decoder that records it."""
    fig = go.Figure()
    for row in board.rows:
        shown = [r for r in row.run.requests if r.extra.get("draft_lengths")][:TRAJECTORY_REQUESTS]
        for r in shown:
            lengths = r.extra["draft_lengths"]
            fig.add_trace(go.Scatter(x=list(range(len(lengths))), y=lengths, mode="lines+markers", line_shape="hv",
                                     name=f"{row_name(row)} · {r.id}"))
    if not fig.data:
        return None
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
