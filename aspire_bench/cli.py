"""The `aspire-bench` command line. User errors print one line and exit 2 (no traceback)."""
from __future__ import annotations

import functools
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import click

from . import cli_types as T
from .cli_types import TokenCount, examples, hidden_alias, merge_alias, parse_decoder_args
from .errors import UserError
from .harness.store_cli import store_option
from .harness.tables import columns_option, format_option


def model_options(f):
    for opt in reversed([
        click.option("--model", default="tiny", show_default=True,
                     help="`tiny` (bundled), a name from `aspire-bench models`, an HF checkpoint directory, or a .gguf file."),
        click.option("--dtype", default="float32", show_default=True, type=click.Choice(T.DTYPES),
                     help="float32 | bfloat16 | float16 | auto (the checkpoint's own)"),
        click.option("--device", default="cpu", show_default=True, help="cpu | cuda"),
        click.option("--attention-backend", default="auto", show_default=True,
                     type=click.Choice(T.ATTENTION_BACKENDS),
                     help="auto | torch | cpu | triton (auto: triton on CUDA, cpu on CPU)"),
    ]):
        f = opt(f)
    return f


rope_option = click.option(
    "--rope-scaling", default=None, callback=T.rope_scaling, metavar="TYPE:FACTOR",
    help="Replace the checkpoint's RoPE scaling to run past its trained length: yarn, linear or dynamic with "
         "a factor above 1, e.g. yarn:2 (none: the checkpoint's own; llama3 needs a sweep file).")


def decoder_options(f, max_new_help: str = "Default: the task's own."):
    for opt in reversed([
        click.option("--decoder", default="ar", show_default=True, help="ar | magicdec | vegas | aspire | ..."),
        click.option("--decoder-arg", "decoder_args", multiple=True, metavar="K=V",
                     help="Decoder setting, repeatable (e.g. gamma=4)."),
        click.option("--batch-size", default=8, show_default=True, type=T.BATCH),
        click.option("--max-new-tokens", default=None, type=T.POSITIVE, help=max_new_help),
        click.option("--temperature", default=0.0, show_default=True, type=T.TEMPERATURE, help="0 = greedy."),
        click.option("--top-k", default=0, show_default=True, type=T.NON_NEGATIVE, help="0 = off."),
        click.option("--top-p", default=1.0, show_default=True, type=T.TOP_P, help="1 = off."),
        click.option("--seed", default=0, show_default=True, type=T.SEED),
    ]):
        f = opt(f)
    return f


def parse_percentiles(spec: str) -> tuple[float, ...]:
    try:
        qs = tuple(float(x) for x in spec.split(",") if x.strip())
    except ValueError:
        qs = ()
    if not qs or any(not 0 <= q <= 100 for q in qs):
        raise UserError(f"--percentiles {spec!r} must be comma-separated numbers in 0..100, such as 50,90,99")
    if len(set(qs)) != len(qs):
        raise UserError(f"--percentiles {spec!r} names one percentile twice: keep one")
    return tuple(int(q) if q == int(q) else q for q in qs)


def measure_options(f):
    for opt in reversed([
        click.option("--percentiles", default="50,90,99", show_default=True,
                     help="Latency percentiles reported (besides mean and median)."),
        click.option("--save-result", "save_result", default=None, type=click.Path(path_type=Path),
                     callback=T.new_output_path,
                     help="Also write a JSON result named as vLLM's `bench serve --save-result` does."),
    ]):
        f = opt(f)
    return f


def write_json(path: Path, obj) -> None:
    """Write `obj` as JSON to `path` atomically (never half-written); `-` prints it to stdout."""
    if str(path) == "-":
        click.echo(json.dumps(obj, indent=1, default=str))
        return
    from .atomic import write_text
    write_text(path, json.dumps(obj, indent=1, default=str))


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # a SIGTERM (a job's timeout, a scheduler) stops as Ctrl-C does: what is done is kept


class Main(click.Group):
    def invoke(self, ctx):
        import signal
        import sqlite3
        _closed_streams_to_devnull()
        try:
            previous = signal.signal(signal.SIGTERM, _interrupt)
        except ValueError:  # not the main thread: leave signals alone
            previous = None
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as e:  # a command's message says what was kept and where
            click.secho(f"interrupted: {_one_line(e)}" if str(e) else "interrupted", fg="red", err=True)
            sys.exit(130)
        except UserError as e:
            click.secho(f"error: {_one_line(e)}", fg="red", err=True)
            sys.exit(2)
        except BrokenPipeError:  # the reader went away (`| head`): what it wanted, it has
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(0)
        except OSError as e:  # a fault of the machine (a full disk, a file removed underneath): one line
            click.secho(f"error: {_one_line(e)}", fg="red", err=True)
            sys.exit(2)
        except sqlite3.DatabaseError as e:  # a store damaged after it was opened (e.g. truncated)
            click.secho(f"error: the results store cannot be read ({e}): restore it from a backup or pass "
                        "another --store", fg="red", err=True)
            sys.exit(2)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)


def _closed_streams_to_devnull() -> None:
    """Started with stdout or stderr closed (`>&-`): they write to /dev/null, and the descriptor is
    taken before any file is opened, so it can never become a store or an output file."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_WRONLY)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            setattr(sys, name, open(fd, "w", closefd=False))  # noqa: SIM115 - the process's stream


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


@click.group(cls=Main, epilog=examples("aspire-bench demo", "aspire-bench --threads 1 run --decoder aspire --context-len 4k --parity"))
@click.version_option(package_name="aspire-bench")
@click.option("--threads", default=None, type=T.THREADS,
              help="CPU threads for torch (default: $ASPIRE_BENCH_THREADS, else torch's). On a busy machine 1 "
                   "is often faster.")
def main(threads):
    """Benchmark and evaluate long-context speculative decoders (AR, MagicDec, Vegas, ASPIRE)."""
    if threads is None:
        threads = T.env_positive_int("ASPIRE_BENCH_THREADS")
    if threads:
        import torch
        torch.set_num_threads(threads)


@main.command(epilog=examples(
    "aspire-bench generate --model tiny --decoder magicdec --prompts prompts.jsonl --out out.jsonl"))
@model_options
@functools.partial(decoder_options, max_new_help="Default: 128.")
@click.option("--prompts", "prompts_path", required=True, type=click.Path(path_type=Path),
              help='JSONL with {"id", "prompt"} or {"id", "input_ids"} per line.')
@click.option("--out", "out_path", required=True, type=click.Path(path_type=Path), callback=T.new_output_path,
              help="Output JSONL, written as requests finish (OUT.partial until the end).")
def generate(model, dtype, device, attention_backend, decoder, decoder_args, batch_size, max_new_tokens,
             temperature, top_k, top_p, seed, prompts_path, out_path):
    """Generate for your own prompts with any decoder; writes one JSON row per prompt."""
    from .atomic import refuse_overwrite
    from .harness.prompts import encode_prompts, read_prompts
    refuse_overwrite(out_path, {"--prompts": prompts_path})
    partial = out_path.with_name(out_path.name + ".partial")
    if partial.exists():  # never written over or removed: it may hold an earlier run's rows
        raise UserError(f"{partial} exists (the rows of an earlier interrupted run?): move or rename it first")
    rows = read_prompts(prompts_path)  # the file's form, before a model is loaded
    from .decoders import Request, SamplingParams, check_for_model, get_decoder
    from .engine import Engine
    from .progress import TokenProgress
    dec = get_decoder(decoder, **parse_decoder_args(decoder_args))
    engine = Engine.from_pretrained(model, dtype, device, attention_backend)
    check_for_model(dec, engine.cfg.num_layers)
    tok = engine.tokenizer
    prompts = encode_prompts(rows, tok, engine.cfg.vocab_size, str(prompts_path))
    new_tokens = max_new_tokens or 128
    longest = max(prompts, key=lambda p: len(p[1]))
    if len(longest[1]) + new_tokens > engine.max_context:  # the fixes this command has
        raise UserError(f"prompt {longest[0]!r} has {len(longest[1])} tokens; with {new_tokens} new tokens that "
                        f"exceeds the model's maximum context of {engine.max_context}: shorten the prompt or "
                        "lower --max-new-tokens")
    # Rows are appended to OUT.partial as requests finish (in finishing order) and the file is
    # renamed to OUT at the end: an interrupted run keeps what finished, OUT is never half-written.
    with _keep_partial(partial) as f:
        def writer(rid):
            def on_finish(output_ids, finish_reason):
                text = tok.decode(output_ids, skip_special_tokens=True) if tok is not None else None
                f.write(json.dumps({"id": rid, "output_ids": output_ids, "text": text,
                                    "finish_reason": finish_reason}) + "\n")
                f.flush()
                f.rows += 1
            return on_finish

        reqs = [Request(rid, ids, new_tokens, on_finish=writer(rid)) for rid, ids in prompts]
        params = SamplingParams(temperature, top_k, top_p, seed, engine.cfg.eos_token_ids)
        with TokenProgress(sum(r.max_new_tokens for r in reqs), f"{decoder}") as bar:
            out = dec.generate(engine, reqs, params, batch_size, progress=bar.advance)
    os.replace(partial, out_path)
    click.echo(f"wrote {len(out.results)} rows to {out_path}")


class _Rows:
    """A text file that counts the rows written to it."""

    def __init__(self, f):
        self.f, self.rows = f, 0

    def write(self, s):
        return self.f.write(s)

    def flush(self):
        self.f.flush()


@contextmanager
def _keep_partial(partial: Path):
    """OUT.partial, created here (never an existing file); on failure it is kept when rows were
    written and the message says where, removed when empty; at the end it is synced to disk."""
    with partial.open("x", encoding="utf-8") as raw:
        f = _Rows(raw)
        try:
            yield f
            raw.flush()
            os.fsync(raw.fileno())
        except BaseException as e:
            raw.close()
            if f.rows == 0:
                partial.unlink(missing_ok=True)  # ours, and empty
                kept = "no row had finished"
            else:
                kept = f"the {f.rows} row(s) finished so far are in {partial}"
            if isinstance(e, KeyboardInterrupt):
                raise KeyboardInterrupt(kept) from None
            if isinstance(e, UserError):
                raise UserError(f"{e} ({kept})") from None
            if isinstance(e, OSError):
                raise UserError(f"could not write {partial} ({e}); {kept}") from None
            raise


@main.command("run", epilog=examples(
    "aspire-bench run --decoder aspire --task code-completion --context-len 4k --batch-size 4 --limit 4 --parity",
    "aspire-bench run --decoder magicdec --decoder-arg gamma=4 --task needle --context-len 8k --columns all"))
@model_options
@rope_option
@decoder_options
@click.option("--task", default="code-completion", show_default=True, help="See `aspire-bench tasks`.")
@click.option("--data", default=None, help="Local dataset file/dir (json, jsonl, parquet) instead of the Hub cache.")
@click.option("--limit", default=8, show_default=True, type=T.REQUESTS, help="Samples to run.")
@click.option("--context-len", default=None, callback=T.context_len,
              help="Context bucket, e.g. 4k, 16k, 32k, 30-40k.")
@click.option("--repeat", default=1, show_default=True, type=T.POSITIVE, help="Measured repeats (median stored).")
@click.option("--parity", is_flag=True, help="Also run AR greedy and compare token for token.")
@click.option("--parity-tolerance", default=None, type=float,
              help="Near-tie tolerance relative to the logit scale (default: by dtype, see docs/metrics.md).")
@store_option
@click.option("--tag", default=None, help="Free label stored with the run.")
@click.option("--group", default=None, envvar="ASPIRE_BENCH_GROUP",
              help="Runs measured side by side share a group; speedups over AR are taken within it.")
@click.option("--unequal-work", is_flag=True,
              help="Under sampling, stop requests at EOS (default: generate exactly --max-new-tokens, so "
                   "every decoder does the same work); the group's speedups are marked 'unequal work'.")
@click.option("--tune", is_flag=True, help="magicdec / vegas: choose gamma on separate tuning requests first.")
@measure_options
@columns_option
@format_option
def run_command(model, dtype, device, attention_backend, rope_scaling, decoder, decoder_args, batch_size,
                max_new_tokens, temperature, top_k, top_p, seed, task, data, limit, context_len, repeat, parity,
                parity_tolerance, store_path, tag, group, unequal_work, tune, percentiles, save_result, columns,
                fmt):
    """Run a decoder on a task, print a summary and store the run."""
    from .atomic import refuse_overwrite
    from .harness.store import check_store_path
    from .tasks import get_task
    store = store_path
    decoder_args = parse_decoder_args(decoder_args)
    # Checks that need no model (run() repeats them for API callers), before torch is even imported.
    check_store_path(store)
    from .harness.tables import summary_table
    summary_table([], columns=columns)  # an unknown --columns name fails now, not after the run
    if save_result:
        refuse_overwrite(save_result, {"--store": store}, "--save-result")
    if data is not None and not get_task(task).reads_data:
        raise click.BadParameter(f"task {task} makes its own prompts and reads no --data: drop --data",
                                 param_hint="--data")
    from rich.markup import escape

    from .harness.records import vllm_result
    from .harness.rope import label as rope_label
    from .harness.runner import RunConfig, run
    from .harness.tables import info, print_summary
    qs = parse_percentiles(percentiles)
    cfg = RunConfig(model=model, decoder=decoder, decoder_args=decoder_args, task=task,
                    data=data, limit=limit, context_len=context_len, batch_size=batch_size,
                    max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                    repeat=repeat, parity=parity, parity_tolerance=parity_tolerance,
                    dtype=_concrete_dtype(model, dtype), device=device,
                    attention_backend=attention_backend, equal_work=not unequal_work, tune=tune,
                    rope_scaling=rope_scaling)
    _note_beyond_trained(model, rope_scaling, [context_len],
                         max_new_tokens or get_task(task).default_max_new_tokens)
    try:
        result = run(cfg, store=store, tag=tag, group=group, percentiles=qs)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"the run had not finished: nothing was stored in {store}") from None
    scaled = f" ({rope_label(rope_scaling)})" if rope_scaling else ""
    print_summary([result.record], title=escape(f"{task} on {model}{scaled}"), fmt=fmt,
                  baselines=_group_ar_runs(store, group), percentiles=qs, columns=columns)
    if save_result:
        write_json(save_result, vllm_result(result.record, qs))
    info(f"stored run {result.run_id} in {store}", fmt)


def _group_ar_runs(store: str, group: str | None) -> list:
    """The AR runs stored in `group`: the speedup of a run joining a group is over them."""
    if group is None:
        return []
    from .harness.store import Store
    with Store(store, readonly=True) as st:  # a read: the run itself is already saved
        return [st.get_run(s["run_id"]) for s in st.list_runs(group=group, decoder="ar", status="ok", kind="measured")]


def _note_beyond_trained(model: str, rope_scaling: dict | None, contexts, max_new_tokens: int) -> None:
    """Once, on stderr: the contexts that a scaling takes past the model's trained positions."""
    from .harness.rope import beyond_trained
    note = beyond_trained(model, rope_scaling, contexts, max_new_tokens)
    if note:
        click.echo(f"note: {note}", err=True)


def _concrete_dtype(model: str, dtype: str) -> str:
    """--dtype auto as the checkpoint's own dtype, so a stored run names the dtype it ran in."""
    if dtype != "auto":
        return dtype
    from .engine.loading import checkpoint_dtype, resolve_model_path
    return checkpoint_dtype(resolve_model_path(model))


@main.command("demo", epilog=examples("aspire-bench demo",
                                      "aspire-bench demo --context-len 4k --max-new-tokens 32 --out /tmp/demo"))
@store_option
@click.option("--out", default=None, help="Leaderboard directory.  [default: leaderboards/demo, with --real "
                                         "leaderboards/demo-real]")
@click.option("--context-len", "contexts", default=None, callback=lambda c, p, v: T.csv_contexts(c, p, v) if v else None,
              help="Comma-separated context buckets (default: the demo sweep's).")
@hidden_alias("--contexts", "contexts_alias", callback=lambda c, p, v: T.csv_contexts(c, p, v) if v else None)
@click.option("--max-new-tokens", default=None, type=T.POSITIVE, help="Default: the demo sweep's.")
@click.option("--real", is_flag=True, help="On SmolLM2-135M instead of the bundled model (fetch it first: "
                                           "aspire-bench models get smollm2-135m).")
def demo_command(store_path, out, contexts, contexts_alias, max_new_tokens, real):
    """AR, MagicDec, Vegas and ASPIRE side by side on the bundled tiny model (--real: on SmolLM2-135M);
    writes a leaderboard."""
    from .demo import DEMO_REAL_SWEEP, DEMO_SWEEP, demo
    store = store_path
    contexts = merge_alias(contexts, contexts_alias, None, "--context-len", "--contexts")
    overrides = {"sweep_file": DEMO_REAL_SWEEP if real else DEMO_SWEEP}
    out = out or ("leaderboards/demo-real" if real else "leaderboards/demo")
    if contexts:
        overrides["contexts"] = contexts
    if max_new_tokens:
        overrides["max_new_tokens"] = max_new_tokens
    index = demo(store, out, **overrides)
    click.echo(f"leaderboard: {index}")


def _csv_or_none(callback):
    return lambda ctx, param, value: None if value is None else callback(ctx, param, value)


@main.command("bench", epilog=examples(
    "aspire-bench bench --context-len 16k --batch-size 8 --sampling paper --decoders ar,magicdec,aspire",
    "aspire-bench bench --context-len 4k,8k --batch-size 1,4 --limit 8 --repeat 2 --json rows.json"))
@model_options
@rope_option
@click.option("--task", default="code-completion", show_default=True)
@click.option("--context-len", "contexts", default=None, callback=_csv_or_none(T.csv_contexts),
              help="Context buckets, comma-separated: one cell per context.  [default: 4k,16k,32k]")
@hidden_alias("--contexts", "contexts_alias", callback=_csv_or_none(T.csv_contexts))
@click.option("--batch-size", "batch_sizes", default=None, callback=_csv_or_none(T.csv_batch_sizes),
              help="Batch sizes, comma-separated: one cell per batch size.  [default: 1,8]")
@hidden_alias("--batch-sizes", "batch_sizes_alias", callback=_csv_or_none(T.csv_batch_sizes))
@click.option("--decoders", default=None, callback=lambda ctx, p, v: None if v is None else T.decoder_specs(ctx, p, v),
              help="Decoders, each with optional settings in brackets: magicdec[budget=512],aspire[ratio=0.035] "
                   "(default: every built-in decoder that is not an ablation).")
@click.option("--repeat", default=3, show_default=True, type=T.POSITIVE)
@click.option("--max-new-tokens", default=128, show_default=True, type=T.POSITIVE)
@click.option("--sampling", default="greedy,paper", show_default=True,
              help="Sampling settings, each run on the same prefilled requests: greedy (parity is checked), "
                   "paper (temperature 0.7, top-k 50, top-p 0.9, the ASPIRE paper's), or temperature:top_k:top_p.")
@click.option("--seed", default=0, show_default=True, type=T.SEED)
@click.option("--limit", default=None, type=T.REQUESTS,
              help="Requests per cell (default: 16 or the batch size, whichever is larger).")
@click.option("--no-tune", is_flag=True, help="Skip tuning the baselines' gamma (no tuned rows).")
@click.option("--no-bound", is_flag=True, help="Skip measuring step costs (no bound share).")
@click.option("--no-calibration-rounds", is_flag=True,
              help="Skip the calibration rounds timed between runs (the simulator then uses the group's "
                   "ASPIRE calibration).")
@store_option
@click.option("--json", "json_out", default=None, type=click.Path(path_type=Path), callback=T.new_output_path,
              help="Also write the rows as JSON to this file (a list of rows; see docs/metrics.md); - prints "
                   "them to stdout instead of the table.")
@click.option("--parity-tolerance", default=None, type=float,
              help="Near-tie tolerance relative to the logit scale (default: by dtype, see docs/metrics.md).")
@measure_options
@columns_option
@format_option
def bench_command(model, dtype, device, attention_backend, rope_scaling, task, contexts, contexts_alias,
                  batch_sizes, batch_sizes_alias, decoders, repeat, max_new_tokens, sampling, seed, limit, no_tune,
                  no_bound, no_calibration_rounds, store_path, json_out, parity_tolerance, percentiles, save_result,
                  columns, fmt):
    """Decoders side by side on the same requests: tok/s, ratios with intervals, tuned baselines, bound share."""
    store = store_path
    contexts = merge_alias(contexts, contexts_alias, ["4k", "16k", "32k"], "--context-len", "--contexts")
    batch_sizes = merge_alias(batch_sizes, batch_sizes_alias, [1, 8], "--batch-size", "--batch-sizes")
    from .decoders import get_decoder
    from .decoders.base import sampling_in_range
    from .harness.bench import bench, bench_table, parse_sampling, state_notes
    from .harness.records import vllm_result
    from .harness.store import Store, check_store_path
    from .harness.tables import emit, info
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]
    try:
        samplings = [parse_sampling(x) for x in split(sampling)]
        T.refuse_duplicates([(s.temperature, s.top_k, s.top_p) for s in samplings], "sampling ")
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--sampling") from None
    except click.BadParameter as e:
        raise click.BadParameter(f"{sampling!r}: the same sampling is given twice: keep one",
                                 param_hint="--sampling") from e
    for s in samplings:  # the ranges a single run has
        if not sampling_in_range(s.temperature, s.top_k, s.top_p):
            raise click.BadParameter(f"{s.name}: need temperature >= 0, top_k >= 0, 0 < top_p <= 1",
                                     param_hint="--sampling")
    for name, args in decoders or ():
        get_decoder(name, **args)  # an unknown name or setting fails now, not after the cells before it
    qs = parse_percentiles(percentiles)
    check_store_path(store)  # before the compute: a bad --store must not throw the benchmark away
    bench_table([], 0.0, columns)  # so is a bad --columns
    from .tasks import get_task
    get_task(task)
    from .atomic import refuse_overwrite
    for option, out in (("--json", json_out), ("--save-result", save_result)):
        if out:
            refuse_overwrite(out, {"--store": store}, option)
    if json_out and save_result:
        refuse_overwrite(save_result, {"--json": json_out}, "--save-result")
    _note_beyond_trained(model, rope_scaling, contexts, max_new_tokens)
    rows, bw = bench(model, task, contexts, batch_sizes, decoders, repeat,
                     max_new_tokens, samplings, seed, limit, store, _concrete_dtype(model, dtype), device,
                     attention_backend, tune=not no_tune, percentiles=qs, bound=not no_bound,
                     parity_tolerance=parity_tolerance, calibration_rounds=not no_calibration_rounds,
                     rope_scaling=rope_scaling)
    data = [r.to_json() for r in rows]  # the `--json` contract, also what --format json prints
    if json_out is not None and str(json_out) == "-":
        fmt = "json"  # the rows on stdout, status lines on stderr
    emit(bench_table(rows, bw, columns), fmt, data=data)
    if json_out is not None and str(json_out) != "-":
        write_json(json_out, data)
    if save_result:
        write_json(save_result, [{**vllm_result(r.record, qs), "context": r.context, "sampling": r.sampling,
                                  "tuned": r.tuned} for r in rows])
    info(f"stored {len(rows)} runs in {store}", fmt)
    with Store(store, readonly=True) as st:  # a cell measured before in another machine state: say so
        for note in state_notes(st, rows):
            info(note, fmt)


@main.command("train-tiny", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                              "help_option_names": []},
              epilog=examples("aspire-bench train-tiny --help"))
@click.pass_context
def train_tiny_command(ctx):
    """Train the bundled tiny model (arguments: see `aspire-bench train-tiny --help`)."""
    from .tinymodel.train import main as train_main
    sys.exit(train_main(ctx.args))


@main.command("tasks", epilog=examples("aspire-bench tasks"))
def tasks_command():
    """List the tasks."""
    from .tasks import describe_tasks
    for name, desc in describe_tasks():
        click.echo(f"{name:18s} {desc}")


@main.command("decoders", epilog=examples("aspire-bench decoders"))
def decoders_command():
    """List the decoders: name, what it does, its settings; ablations and plug-ins are marked."""
    from .decoders import describe_decoders
    rows = describe_decoders()
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        mark = {"ablation": "[ablation] ", "plug-in": "[plug-in] ", "bound": "[upper bound] "}.get(r["kind"], "")
        click.echo(f"{r['name']:{width}s}  {mark}{r['description']}")


@main.command("calibrate", epilog=examples("aspire-bench calibrate --model tiny --batch-size 8 --context-len 16k"))
@model_options
@click.option("--batch-size", default=8, show_default=True, type=T.BATCH)
@click.option("--context-len", default=4096, show_default=True, type=TokenCount(),
              help="Context of each request in tokens (4096 or 4k). An aspire run uses the fit taken at "
                   "its median prompt length to the nearest power of two (at least 4k).")
@click.option("--repeats", default=3, show_default=True, type=T.POSITIVE)
@click.option("--out", default=None, type=click.Path(path_type=Path), callback=T.new_output_path,
              help="Where to save the fit (default: the cache aspire looks in).")
def calibrate_command(model, dtype, device, attention_backend, batch_size, context_len, repeats, out):
    """Fit ASPIRE's step-cost model on timed mixed steps; aspire uses a matching fit automatically."""
    from .decoders.calibration import calibrate, save_calibration
    from .harness.runner import load_engine
    engine = load_engine(model, dtype, device, attention_backend)
    if context_len + 32 > engine.max_context:
        raise UserError(f"--context-len {context_len} exceeds the model's maximum context {engine.max_context}")
    with click.progressbar(length=1, label="timing mixed steps", file=click.get_text_stream("stderr")) as bar:
        def progress(i, n):
            bar.length = n
            bar.update(1)
        res = calibrate(engine, batch_size, context_len, repeats=repeats, progress=progress)
    path = save_calibration(res, engine, batch_size, out)
    fit = res.fit
    click.echo(f"step time = {fit.beta0 * 1e3:.3f} ms + {fit.beta_tok * 1e6:.2f} us/token + "
               f"{fit.beta_attn * 1e9:.3f} ns/KV position read + "
               f"{fit.beta_qk * 1e9:.3f} ns/(query x KV position)"
               + (f" beyond a row's first {fit.qk_free} tokens" if fit.beta_qk and fit.qk_free else "")
               + ("" if fit.beta_qk else " (query x KV term not significant)")
               + (f" + {fit.beta_multi * 1e9:.3f} ns/KV position read by a row of more than {fit.qk_free} "
                  "tokens" if fit.beta_multi else "")
               + (f" + {fit.beta_sparse * 1e9:.3f} ns/KV position read scattered through a sparse view"
                  if fit.beta_sparse else " (sparse-view term not significant)")
               + (f" + {fit.beta_capture * 1e9:.3f} ns/KV position whose scores a row captured"
                  if fit.beta_capture else " (capture term not significant)")
               + (f"; Vegas's steps: {fit.beta_layered * 1e9:.3f} ns/KV position read through per-layer views"
                  if fit.beta_layered is not None else "")
               + (f", {fit.beta_topk * 1e9:.3f} ns/token score captured for a top-k"
                  if fit.beta_topk is not None else ""))
    from .decoders.scheduler import fit_problem
    problem = fit_problem(fit)
    if problem:
        click.echo(f"warning: this fit will be rejected by aspire ({problem}): calibrate on an idle machine",
                   err=True)
    click.echo(f"R^2 {fit.r2:.3f}; held-out relative error median {res.heldout_rel_err_median:.1%}, "
               f"max {res.heldout_rel_err_max:.1%} over {res.n_samples} steps")
    click.echo(f"saved {path}")


def _register_commands():
    from .diagnose_cli import COMMANDS as diagnose_commands
    from .gate import COMMANDS as gate_commands
    from .harness.store_cli import COMMANDS as store_commands
    from .harness.sweep_cli import COMMANDS as sweep_commands
    from .lm_eval_cli import COMMANDS as lm_eval_commands
    from .models_cli import COMMANDS as models_commands
    from .report.cli import COMMANDS as report_commands
    from .simulator.cli import COMMANDS as simulator_commands
    for cmd in (*store_commands, *sweep_commands, *report_commands, *gate_commands, *lm_eval_commands,
                *diagnose_commands, *simulator_commands, *models_commands):
        main.add_command(cmd)


_register_commands()


if __name__ == "__main__":
    main()
