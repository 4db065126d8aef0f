"""`aspire-bench diagnose recall | heterogeneity`: the ASPIRE paper's two diagnostics on any model.
Results print as tables, go to --json and to the store as `diagnostic` runs. cli.py adds COMMANDS."""
from __future__ import annotations

import json
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from . import cli_types as T
from .atomic import write_text
from .harness.store_cli import store_option
from .harness.tables import emit, format_option, info

FAMILIES = ("temporal", "cross-layer", "refresh", "window", "vegas")  # diagnostics.recall.FAMILIES, import-free


def _ints(ctx, param, value):
    """Comma-separated integers >= 1; `none` or an empty value for none."""
    if value is None or value.strip().lower() in ("", "none"):
        return ()
    return tuple(T.csv_positive_ints(ctx, param, value))


def _families(ctx, param, value):
    items = T.csv_list(ctx, param, value)
    bad = [x for x in items if x not in FAMILIES]
    if bad:
        raise click.BadParameter(f"unknown predictor {bad[0]!r}: choose from {', '.join(FAMILIES)}")
    return tuple(dict.fromkeys(items))


def common_options(f):
    """Model, task and output options shared by both diagnostics."""
    for opt in reversed([
        click.option("--model", default="tiny", show_default=True,
                     help="`tiny` (bundled), a name from `aspire-bench models`, an HF checkpoint directory, or a .gguf file."),
        click.option("--dtype", default="float32", show_default=True, type=click.Choice(T.DTYPES)),
        click.option("--device", default="cpu", show_default=True, help="cpu | cuda"),
        click.option("--attention-backend", default="auto", show_default=True, type=click.Choice(T.ATTENTION_BACKENDS)),
        click.option("--task", default="code-completion", show_default=True, help="See `aspire-bench tasks`."),
        click.option("--data", default=None, help="Local dataset file/dir instead of the Hub cache."),
        click.option("--context-len", default=None, callback=T.context_len, help="Context bucket, e.g. 4k, 16k."),
        click.option("--seed", default=0, show_default=True, type=T.SEED),
        # the global `aspire-bench --threads N` sets it; kept here, hidden, for older command lines
        click.option("--threads", default=None, type=T.POSITIVE, hidden=True),
        store_option,
        click.option("--json", "json_out", default=None, type=click.Path(path_type=Path),
                     callback=T.new_output_path, help="Also write the result as JSON to this file; - prints it "
                     "to stdout instead of the tables."),
        format_option,
    ]):
        f = opt(f)
    return f


def _prepare(threads, store_path, dtype, model, task, data):
    """Checks that need no model, then the thread count: before any compute."""
    from .harness.store import check_store_path
    from .tasks import get_task
    check_store_path(store_path)
    if data is not None and not get_task(task).reads_data:
        raise click.BadParameter(f"task {task} makes its own prompts and reads no --data: drop --data",
                                 param_hint="--data")
    if threads:
        import torch
        torch.set_num_threads(threads)
    if dtype == "auto":
        from .engine.loading import checkpoint_dtype, resolve_model_path
        return checkpoint_dtype(resolve_model_path(model))
    return dtype


def _write_json(path: Path | None, obj) -> None:
    if path is None or str(path) == "-":  # `-`: printed as the command's --format json output
        return
    write_text(path, json.dumps(obj, indent=1))


def _save(store_path, record, fmt) -> None:
    from .harness.store import save_record
    run_id = save_record(store_path, record)
    info(f"stored diagnostic run {run_id} in {store_path}", fmt)


@click.group(epilog=T.examples("aspire-bench diagnose recall --context-len 4k",
                               "aspire-bench diagnose heterogeneity --context-len 4k"))
def diagnose():
    """The ASPIRE paper's diagnostics on any model: attention recall of sparse views, and how
    heterogeneous accepted draft lengths are across requests."""


@diagnose.command("recall", epilog=T.examples(
    "aspire-bench diagnose recall --model tiny --context-len 4k --requests 2",
    "aspire-bench diagnose recall --k-tokens 256 --k-pages 32 --json recall.json"))
@common_options
@click.option("--requests", default=4, show_default=True, type=T.POSITIVE, help="Requests (task samples).")
@click.option("--positions", default=32, show_default=True, type=T.POSITIVE,
              help="Query positions per request: the continuation's first tokens (fewer if it is shorter).")
@click.option("--continuation", default="auto", show_default=True, type=click.Choice(("auto", "reference", "greedy")),
              help="Teacher-force the task's reference text (auto: when it has one) or the model's greedy output.")
@click.option("--heads", default="max", show_default=True, type=click.Choice(("max", "mean")),
              help="How attention is reduced over query heads (ASPIRE: max).")
@click.option("--k-tokens", default="256,1024", show_default=True, callback=_ints,
              help="Budgets in tokens, comma-separated (`none` for none).")
@click.option("--k-pages", default="32,64", show_default=True, callback=_ints,
              help="Budgets in pages, comma-separated (`none` for none).")
@click.option("--page-size", default=None, type=T.POSITIVE, help="Tokens per page (default: the engine's, 16).")
@click.option("--lags", default="1,2,4,8,16", show_default=True, callback=_ints, help="Temporal-reuse lags.")
@click.option("--sinks", default=16, show_default=True, type=T.NON_NEGATIVE, help="Sink tokens of the window view.")
@click.option("--vegas-gamma", default=6, show_default=True, type=T.POSITIVE,
              help="Vegas: the last verification is this many tokens back (its draft length).")
@click.option("--predictors", default=",".join(FAMILIES), show_default=True, callback=_families)
def recall_command(model, dtype, device, attention_backend, task, data, context_len, seed, threads, store_path,
                   json_out, fmt, requests, positions, continuation, heads, k_tokens, k_pages, page_size, lags,
                   sinks, vegas_gamma, predictors):
    """Mass recall@k of each attention predictor against the true attention, per layer and averaged."""
    if not (k_tokens or k_pages):
        raise click.BadParameter("give at least one budget in --k-tokens or --k-pages", param_hint="--k-tokens")
    if "temporal" in predictors and not lags:
        raise click.BadParameter("temporal reuse needs at least one lag", param_hint="--lags")
    dtype = _prepare(threads, store_path, dtype, model, task, data)
    from .diagnostics.recall_run import RecallConfig, diagnose_recall, recall_record
    cfg = RecallConfig(model=model, task=task, context_len=context_len, data=data, requests=requests,
                       positions=positions, continuation=continuation, heads=heads, k_tokens=k_tokens,
                       k_pages=k_pages, page_size=page_size, lags=lags, sinks=sinks, vegas_gamma=vegas_gamma,
                       predictors=predictors, seed=seed, dtype=dtype, device=device, attention_backend=attention_backend)
    result = diagnose_recall(cfg)
    title = f"{task} on {model}" + (f" at {context_len}" if context_len else "")
    emit(recall_tables(result.rows, title), "json" if str(json_out) == "-" else fmt, data=result.rows)
    _write_json(json_out, result.rows)
    _save(store_path, recall_record(result), fmt)


def _k_label(unit: str, k: int) -> str:
    return f"{k} {'tok' if unit == 'tokens' else 'pages'}"


def recall_tables(rows: list[dict], title: str) -> list[Table]:
    """Mean over layers (predictor x budget), then per layer at the first budget for the predictors
    that have one score per layer (temporal, window, vegas) and the last-but-one refresh layer."""
    budgets = list(dict.fromkeys((r["unit"], r["k"]) for r in rows))
    preds = list(dict.fromkeys(r["predictor"] for r in rows))
    means = {(r["predictor"], r["unit"], r["k"]): r["recall"] for r in rows if r["layer"] == "mean"}
    t = Table(title=escape(f"mass recall@k, mean over layers · {title}"))
    t.add_column("predictor")
    for unit, k in budgets:
        t.add_column(_k_label(unit, k), justify="right")
    for p in preds:
        t.add_row(p, *(f"{means[(p, u, k)]:.3f}" if (p, u, k) in means else "—" for u, k in budgets))
    layers = sorted({r["layer"] for r in rows if r["layer"] != "mean"})
    if not budgets or not layers:
        return [t]
    unit, k = next((b for b in budgets if b[0] == "pages"), budgets[0])
    refresh = f"refresh:layer={max(layers) - 1}" if len(layers) > 1 else None
    shown = [p for p in preds if p.startswith(("temporal", "window", "vegas")) or p == refresh]
    per = {(r["predictor"], r["layer"]): r["recall"] for r in rows
           if r["layer"] != "mean" and r["unit"] == unit and r["k"] == k}
    t2 = Table(title=escape(f"mass recall@{_k_label(unit, k)} per layer · {title}"))
    t2.add_column("predictor")
    for li in layers:
        t2.add_column(str(li), justify="right")
    for p in shown:
        t2.add_row(p, *(f"{per[(p, li)]:.2f}" if (p, li) in per else "—" for li in layers))
    return [t, t2]


@diagnose.command("heterogeneity", epilog=T.examples(
    "aspire-bench diagnose heterogeneity --model tiny --context-len 4k --requests 4 --max-new-tokens 32"))
@common_options
@click.option("--decoder", default="aspire", show_default=True, help="A speculative decoder: its draft view is used.")
@click.option("--decoder-arg", "decoder_args", multiple=True, metavar="K=V",
              help="Further decoder setting, repeatable (the draft length is --draft-len's).")
@click.option("--draft-len", default=20, show_default=True, type=T.POSITIVE, help="Tokens drafted per round (D).")
@click.option("--requests", default=16, show_default=True, type=T.POSITIVE, help="Requests (task samples).")
@click.option("--max-new-tokens", default=128, show_default=True, type=T.POSITIVE)
@click.option("--batch-size", default=8, show_default=True, type=T.POSITIVE)
def heterogeneity_command(model, dtype, device, attention_backend, task, data, context_len, seed, threads, store_path,
                          json_out, fmt, decoder, decoder_args, draft_len, requests, max_new_tokens, batch_size):
    """Per request, the accepted drafts out of D per round (mean, std, min, max); across requests the
    distribution of the means (min, quartiles, max, mean)."""
    from .diagnostics.heterogeneity import fixed_draft_settings
    fixed_draft_settings(decoder, draft_len)  # ar and bad lengths fail before anything loads
    args = T.parse_decoder_args(decoder_args)
    dtype = _prepare(threads, store_path, dtype, model, task, data)
    from .diagnostics.heterogeneity import HeterogeneityConfig, diagnose_heterogeneity
    cfg = HeterogeneityConfig(model=model, task=task, context_len=context_len, data=data, decoder=decoder,
                              decoder_args=args, draft_len=draft_len, requests=requests,
                              max_new_tokens=max_new_tokens, batch_size=batch_size, seed=seed, dtype=dtype,
                              device=device, attention_backend=attention_backend)
    result = diagnose_heterogeneity(cfg)
    title = f"{decoder}, D={draft_len} · {task} on {model}" + (f" at {context_len}" if context_len else "")
    emit(heterogeneity_tables(result.requests, result.summary, title), "json" if str(json_out) == "-" else fmt,
         data=result.to_json())
    _write_json(json_out, result.to_json())
    _save(store_path, result.record, fmt)


def _num(v, spec=".2f") -> str:
    return "—" if v is None else format(v, spec)


def heterogeneity_tables(requests: list[dict], summary: dict, title: str) -> list[Table]:
    t = Table(title=escape(f"accepted drafts per round · {title}"))
    for c in ("request", "prompt", "rounds", "mean", "std", "min", "max"):
        t.add_column(c, justify="left" if c == "request" else "right")
    for r in requests:
        t.add_row(escape(r["id"]), str(r["prompt_len"]), str(r["rounds"]), _num(r["mean"]), _num(r["std"]),
                  _num(r["min"], "g"), _num(r["max"], "g"))
    s = Table(title=escape(f"across requests (per-request means) · {title}"))
    for c in ("requests", "min", "q1", "median", "q3", "max", "mean"):
        s.add_column(c, justify="right")
    s.add_row(str(summary["n"]), *(_num(summary[k]) for k in ("min", "q1", "median", "q3", "max", "mean")))
    return [t, s]


COMMANDS = [diagnose]
