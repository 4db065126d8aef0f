"""The report's pages: the index (leaderboards + plots) and one page per run."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime, timezone

import plotly

from aspire_bench.harness import figures
from aspire_bench.harness.records import RunRecord, platform_summary
from aspire_bench.report import plots
from aspire_bench.report.html import DASH, cell, esc, fmt, mapping_table, page, table
from aspire_bench.report.leaderboard import (
    COLUMNS,
    MILLIS,
    Board,
    Leaderboards,
    Row,
    best_values,
    bound_sentence,
    group_name,
)

PLOTLY_JS = "plotly.min.js"
# Environment entries summarised in every page's header.
VERSION_KEYS = ("aspire_bench", "torch", "transformers", "python", "cuda")


def run_href(run_id: int, root: str = "") -> str:
    return f"{root}runs/run-{run_id}.html"


def header_meta(runs: Sequence[RunRecord], now: datetime | None = None) -> str:
    """Date, devices and versions of the runs shown (each distinct value once)."""
    now = now or datetime.now(timezone.utc)
    envs = [r.env for r in runs]
    devices = sorted({platform_summary(e) for e in envs}) or [DASH]
    parts = [f"generated {now.strftime('%Y-%m-%d %H:%M UTC')}", "device: " + ", ".join(devices)]
    for key in VERSION_KEYS:
        values = sorted({str(e[key]) for e in envs if e.get(key) is not None})
        if values:
            parts.append(f"{key} {'/'.join(values)}")
    revs = sorted({str(e["git_rev"])[:10] + ("+dirty" if e.get("git_dirty") else "") for e in envs if e.get("git_rev")})
    if revs:
        parts.append("git " + "/".join(revs))
    parts.append(f"plotly {plotly.__version__}")
    return esc(" · ".join(parts))


# --- index ------------------------------------------------------------------------------------


def _header_cell(col) -> str:
    return (f"<th title=\"{esc(col.tip)}\">{esc(col.header)} "
            f"<a class=\"def\" href=\"metrics.html#{esc(col.anchor)}\" title=\"definition\">i</a></th>")


def _value_cell(row: Row, col, best: dict) -> str:
    value = row.value(col.key)
    shown = None if value is None else (value * 1000 if col.key in MILLIS else value)
    is_best = value is not None and col.key in best and value == best[col.key]
    extra = "best" if is_best else ""
    if col.key == "parity_identical_pct" and value is not None:
        counts = [(row.value("parity_near_tie"), "near-tie"), (row.value("parity_mismatch"), "mismatch"),
                  (row.value("parity_length"), "length")]
        notes = "".join(f" · {int(n)} {name}" for n, name in counts if n)
        return cell(value, extra_cls=extra, html=f"{esc(fmt(value, col.fmt))}%{esc(notes)}")
    if col.key == "decode_tok_s" and value is not None:
        # The runner stores each run's min/max over its own measured repeats; several runs add theirs.
        lo = min(r.aggregates.get("decode_tok_s_min") or r.aggregates.get("decode_tok_s") or 0 for r in row.runs)
        hi = max(r.aggregates.get("decode_tok_s_max") or r.aggregates.get("decode_tok_s") or 0 for r in row.runs)
        return cell(shown, extra_cls=extra, html=f"<span title=\"min–max over repeats: {lo:.1f}–{hi:.1f}\">"
                    f"{esc(fmt(shown, col.fmt))}</span>")
    if col.key == "speedup" and value is not None:
        ci, unequal = row.value("speedup_ci95"), row.value("unequal_work")
        text = f"{fmt(shown, col.fmt)}×"
        if not ci and not unequal:
            return cell(shown, extra_cls=extra, html=esc(text))
        if ci:
            text += f" [{fmt(ci[0], col.fmt)}, {fmt(ci[1], col.fmt)}]"
        if unequal:  # sampled runs stopped at EOS: not the same work as AR
            text += " (unequal work)"
        return cell(shown, extra_cls=extra, html=f"<span title=\"[95% bootstrap interval over requests × repeats]; "
                    f"unequal work: sampled requests stopped at EOS\">{esc(text)}</span>")
    return cell(shown, col.fmt, extra_cls=extra)


def board_table(board: Board) -> str:
    best = best_values(board)
    head = ("<th class=\"l\">decoder</th><th class=\"l\">setup</th><th class=\"l\" title=\"runs measured side by "
            "side in one invocation; speedups are taken within it\">group</th><th title=\"repeats (same config hash "
            "in one group): figures are their medians\">runs</th>" + "".join(_header_cell(c) for c in COLUMNS))
    body = []
    for row in board.rows:
        runs_links = " ".join(f"<a href=\"{run_href(r.run_id)}\">#{r.run_id}</a>" for r in row.runs)
        body.append(
            f"<tr data-decoder=\"{esc(row.label)}\">"
            + cell(row.label, html=f"<a href=\"{run_href(row.run.run_id)}\">{esc(row.label)}</a>")
            + cell(row.setup or None) + _group_cell(row.run) + cell(len(row.runs), html=runs_links)
            + "".join(_value_cell(row, c, best) for c in COLUMNS) + "</tr>")
    mixed = len({r.group for r in board.rows}) > 1
    note = ("rows come from different groups (invocations, maybe machines): compare their speedups, not their "
            "raw timings, which get no ★ here · " if mixed else "")
    star = "★ best per column · " if best else ""
    return (f"<div class=\"scroll\"><table class=\"sortable leaderboard\" id=\"lb-{esc(board.slug)}\"><thead><tr>"
            f"{head}</tr></thead><tbody>{''.join(body)}</tbody></table></div>"
            f"<p class=\"note\">{note}{star}click a header to sort</p>")


def _group_cell(run: RunRecord) -> str:
    """The group by the sweep (or bench) that ran it and when; its id on hover."""
    if run.group is None:
        return cell(None)
    name = group_name(run)
    return cell(name, html=f"<span title=\"group {esc(run.group)}\">{esc(name)}</span>")


def bounds_note(board: Board, simulated: dict) -> str:
    lines = [t for t in (bound_sentence(r, board, simulated) for r in board.rows) if t]
    if not lines:
        return ""
    return ("<div class=\"bounds\"><p class=\"note\">What bounds each decoder here "
            "(<a href=\"metrics.html#the-bound\">bound share</a>):</p><ul>"
            + "".join(f"<li>{esc(t)}</li>" for t in lines) + "</ul></div>")


def board_section(board: Board, simulated: dict | None = None) -> str:
    plot_divs = [p for p in (plots.accepted_length_distribution(board, f"acc-{board.slug}"),
                             plots.acceptance_by_position(board, f"pos-{board.slug}"),
                             plots.latency_cdf(board, f"tpot-{board.slug}"),
                             plots.draft_trajectories(board, f"draft-{board.slug}")) if p]
    return (f"<h3 id=\"{esc(board.slug)}\">{esc(board.title)}</h3>{board_table(board)}{bounds_note(board, simulated or {})}"
            f"<div class=\"plots\">{''.join(plot_divs)}</div>")


def render_index(lb: Leaderboards, now: datetime | None = None, diagnostics: str = "",
                 simulated: dict | None = None) -> str:
    """`diagnostics`: the link to the diagnostics page (HTML), when the store has any; `simulated`:
    replays of stored runs by the id of the run they replay (leaderboard.simulated_by_source)."""
    by_model_task: dict[tuple[str, str], list[Board]] = defaultdict(list)
    for b in lb.boards:
        by_model_task[(b.model, b.task)].append(b)
    parts = [("<p class=\"note\">How to read these tables and plots: <a href=\"leaderboard.html\">leaderboard "
              "guide</a>. Every column header links to its exact definition. Simulated runs are on the "
              "<a href=\"projected.html\">projected</a> page, never ranked here.</p>"), diagnostics]
    if not lb.boards:
        parts.append("<p>No successful runs in this store yet.</p>")
    toc = "".join(f"<li><a href=\"#{esc(b.slug)}\">{esc(b.title)}</a> ({len(b.rows)} decoders)</li>" for b in lb.boards)
    parts.append(f"<ul>{toc}</ul>")
    for (model, task), boards in by_model_task.items():
        parts.append(f"<h2>{esc(model)} · {esc(task)}</h2>")
        sp = plots.speedup_vs_context(boards, f"speedup-{boards[0].slug}", f"speedup over AR vs context length · "
                                      f"{model} · {task}")
        if sp:
            parts.append(f"<div class=\"plots wide\">{sp}</div>")
        parts.extend(board_section(b, simulated) for b in boards)
    parts.append(_runs_section(lb.runs))
    return page("aspire-bench leaderboards", "".join(parts), meta=header_meta(lb.runs, now), scripts=[PLOTLY_JS])


def _runs_section(runs: Sequence[RunRecord]) -> str:
    rows = [[cell(r.run_id, html=f"<a href=\"{run_href(r.run_id)}\">#{r.run_id}</a>"), cell(r.created_at),
             cell(r.status, extra_cls="bad" if r.status != "ok" else ""), cell(figures.decoder_label(r.config)),
             cell(" · ".join(figures.cell(r.config))), _group_cell(r), cell(r.error)] for r in runs]
    return ("<h2 id=\"all-runs\">All runs</h2>"
            + table(["run", "created", "status", "decoder", "model · task · context", "group", "error"],
                    rows, cls="runs"))


# --- run pages --------------------------------------------------------------------------------

REQUEST_HEADERS = ("id", "prompt", "output", "finish", "score", "TTFT ms", "TPOT ms", "mean acc. len",
                   "distinct-4", "verifications", "parity")


def _request_cells(r) -> list[str]:
    f = r.figures
    ms = (lambda v: None if v is None else 1000 * v)
    return [cell(r.id), cell(r.prompt_len), cell(len(r.output_ids)), cell(r.finish_reason), cell(r.score, ".3f"),
            cell(ms(f.get("ttft_s")), ".1f"), cell(ms(f.get("tpot_s")), ".2f"), cell(f.get("mean_accepted_len"), ".2f"),
            cell(f.get("distinct4"), ".3f"), cell(len(r.verifications)), cell((r.parity or {}).get("kind"))]


def render_run(run: RunRecord, repeats: Sequence[RunRecord] = (), now: datetime | None = None) -> str:
    label = figures.decoder_label(run.config)
    facts = {"run": run.run_id, "status": run.status, "error": run.error, "created": run.created_at,
             "decoder": label, "model · task · context": " · ".join(figures.cell(run.config)),
             "group": run.group, "sweep": run.sweep, "tag": run.tag, "config hash": run.config_hash}
    if run.group is not None:
        facts["group"] = f"{group_name(run)} ({run.group})"
    parts = [mapping_table({k: v for k, v in facts.items() if v is not None})]
    others = [r for r in repeats if r.run_id != run.run_id]
    if others:
        parts.append("<p>Repeats in the same group: " + " ".join(
            f"<a href=\"run-{r.run_id}.html\">#{r.run_id}</a>" for r in others) + "</p>")
    parts.append("<h2>Figures</h2><p class=\"note\">times in ms; definitions: "
                 "<a href=\"../metrics.html\">metrics</a></p>")
    parts += [f"<h3>{esc(title)}</h3>{mapping_table(values)}" for title, values in aggregate_sections(run.aggregates)]
    parts += ["<h2>Config</h2>", mapping_table(run.config), "<h2>Decoder settings used</h2>",
              mapping_table(run.info) if run.info else f"<p>{DASH}</p>",
              "<h2>Environment</h2>", mapping_table(run.env)]
    parts.append(f"<h2>Requests ({len(run.requests)})</h2>"
                 + table(REQUEST_HEADERS, (_request_cells(r) for r in run.requests), cls="requests"))
    parts.append(_divergences(run))
    outputs = "".join(f"<details><summary>{esc(r.id)}</summary><pre>{esc(r.text if r.text is not None else r.output_ids)}"
                      f"</pre></details>" for r in run.requests)
    if outputs:
        parts.append(f"<h2>Outputs</h2>{outputs}")
    return page(f"run #{run.run_id}: {label}", "".join(parts), meta=header_meta([run], now), root="../")


# Run-page sections of a run's aggregates: the first whose prefixes match a key takes it.
SECTIONS = (("Throughput", ("decode_tok_s", "speedup", "allowed_speedup", "bound_share", "generated", "decode_wall",
                            "bytes_per", "achieved_bw", "memory_bw", "fma", "n_requests", "repeats")),
            ("Latency", ("ttft", "tpot", "itl", "e2e", "prefill")),
            ("Acceptance", ("mean_accepted", "draft_acceptance", "accept_rate", "req_accepted", "verifications")),
            ("Parity", ("parity",)),
            ("Output quality", ("score", "distinct")))


def aggregate_sections(aggregates: dict) -> list[tuple[str, dict]]:
    """The aggregates in sections, seconds (keys ending `_s`) shown as milliseconds (`_ms`)."""
    out: dict[str, dict] = {title: {} for title, _ in SECTIONS}
    out["Other"] = {}
    for k, v in aggregates.items():
        title = next((t for t, prefixes in SECTIONS if k.startswith(prefixes)), "Other")
        if k.endswith("_s") and isinstance(v, (int, float)) and not isinstance(v, bool):
            k, v = k[:-2] + "_ms", v * 1000
        out[title][k] = v
    return [(t, values) for t, values in out.items() if values]


def _divergences(run: RunRecord) -> str:
    """Requests whose output differs from AR's, with AR's top1−top2 margin where they split."""
    rows = [r for r in run.requests if r.parity and r.parity.get("kind") != "identical"]
    if not any(r.parity for r in run.requests):
        return "<h2>Parity divergences</h2><p class=\"note\">no parity comparison recorded for this run</p>"
    if not rows:
        return "<h2>Parity divergences</h2><p>none: every compared request is identical to AR</p>"
    body = [[cell(r.id), cell(r.parity.get("kind"), extra_cls="bad" if r.parity.get("kind") != "near-tie" else ""),
             cell(r.parity.get("first_divergence")), cell(r.parity.get("margin"), ".3g"),
             cell(r.parity.get("matched")), cell(r.parity.get("length"))] for r in rows]
    return ("<h2>Parity divergences</h2>"
            + table(["request", "kind", "first divergence", "AR margin (top1−top2 logit)", "matched", "length"],
                    body, cls="divergences"))
