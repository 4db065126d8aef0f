"""The `aspire-bench` command line. User errors print one line and exit 2 (no traceback)."""
from __future__ import annotations

import functools
import json
import sys
from contextlib import contextmanager
from pathlib import Path

import click

from . import cli_types as T
from .cli_types import TokenCount, parse_decoder_args
from .errors import UserError
from .harness.tables import format_option


def model_options(f):
    for opt in reversed([
        click.option("--model", default="tiny", show_default=True,
                     help="HF checkpoint directory, or `tiny` (the bundled model)."),
        click.option("--dtype", default="float32", show_default=True, type=click.Choice(T.DTYPES),
                     help="float32 | bfloat16 | float16 | auto (the checkpoint's own)"),
        click.option("--device", default="cpu", show_default=True, help="cpu | cuda"),
        click.option("--attention-backend", default="auto", show_default=True,
                     type=click.Choice(T.ATTENTION_BACKENDS),
                     help="auto | torch | cpu | triton (auto: triton on CUDA, cpu on CPU)"),
    ]):
        f = opt(f)
    return f


def decoder_options(f, max_new_help: str = "Default: the task's own."):
    for opt in reversed([
        click.option("--decoder", default="ar", show_default=True, help="ar | magicdec | vegas | aspire | ..."),
        click.option("--decoder-arg", "decoder_args", multiple=True, metavar="K=V",
                     help="Decoder setting, repeatable (e.g. gamma=4)."),
        click.option("--batch-size", default=8, show_default=True, type=T.POSITIVE),
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
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(path)


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # a SIGTERM (a job's timeout, a scheduler) stops as Ctrl-C does: what is done is kept


class Main(click.Group):
    def invoke(self, ctx):
        import signal
        import sqlite3
        try:
            previous = signal.signal(signal.SIGTERM, _interrupt)
        except ValueError:  # not the main thread: leave signals alone
            previous = None
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.secho("interrupted", fg="red", err=True)
            sys.exit(130)
        except UserError as e:
            click.secho(f"error: {_one_line(e)}", fg="red", err=True)
            sys.exit(2)
        except sqlite3.DatabaseError as e:  # a store damaged after it was opened (e.g. truncated)
            click.secho(f"error: the results store cannot be read ({e}): restore it from a backup or pass "
                        "another --store", fg="red", err=True)
            sys.exit(2)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


@click.group(cls=Main)
@click.version_option(package_name="aspire-bench")
@click.option("--threads", default=None, type=T.POSITIVE, envvar="ASPIRE_BENCH_THREADS",
              help="CPU threads for torch (default: torch's). On a busy machine 1 is often faster.")
def main(threads):
    """Benchmark and evaluate long-context speculative decoders (AR, MagicDec, Vegas, ASPIRE)."""
    if threads:
        import torch
        torch.set_num_threads(threads)


@main.command()
@model_options
@functools.partial(decoder_options, max_new_help="Default: 128.")
@click.option("--prompts", "prompts_path", required=True, type=click.Path(path_type=Path),
              help='JSONL with {"id", "prompt"} or {"id", "input_ids"} per line.')
@click.option("--out", "out_path", required=True, type=click.Path(path_type=Path), callback=T.new_output_path,
              help="Output JSONL, written as requests finish (OUT.partial until the end).")
def generate(model, dtype, device, attention_backend, decoder, decoder_args, batch_size, max_new_tokens,
             temperature, top_k, top_p, seed, prompts_path, out_path):
    """Generate for your own prompts with any decoder; writes one JSON row per prompt."""
    from .harness.prompts import encode_prompts, read_prompts
    rows = read_prompts(prompts_path)  # the file's form, before a model is loaded
    from .decoders import Request, SamplingParams, get_decoder
    from .engine import Engine
    from .progress import TokenProgress
    dec = get_decoder(decoder, **parse_decoder_args(decoder_args))
    engine = Engine.from_pretrained(model, dtype, device, attention_backend)
    tok = engine.tokenizer
    prompts = encode_prompts(rows, tok, engine.cfg.vocab_size, str(prompts_path))
    # Rows are appended to OUT.partial as requests finish (in finishing order) and the file is
    # renamed to OUT at the end: an interrupted run keeps what finished, OUT is never half-written.
    partial = out_path.with_name(out_path.name + ".partial")
    with _keep_partial(partial) as f:
        def writer(rid):
            def on_finish(output_ids, finish_reason):
                text = tok.decode(output_ids, skip_special_tokens=True) if tok is not None else None
                f.write(json.dumps({"id": rid, "output_ids": output_ids, "text": text,
                                    "finish_reason": finish_reason}) + "\n")
                f.flush()
            return on_finish

        reqs = [Request(rid, ids, max_new_tokens or 128, on_finish=writer(rid)) for rid, ids in prompts]
        params = SamplingParams(temperature, top_k, top_p, seed, engine.cfg.eos_token_ids)
        with TokenProgress(sum(r.max_new_tokens for r in reqs), f"{decoder}") as bar:
            out = dec.generate(engine, reqs, params, batch_size, progress=bar.advance)
    partial.replace(out_path)
    click.echo(f"wrote {len(out.results)} rows to {out_path}")


@contextmanager
def _keep_partial(partial: Path):
    """The open OUT.partial; on failure it is kept when rows were written (and the error says so),
    removed when empty."""
    f = partial.open("w")
    try:
        yield f
    except BaseException as e:
        f.close()
        if partial.stat().st_size == 0:
            partial.unlink()
        elif isinstance(e, UserError):
            raise UserError(f"{e} (the rows finished so far are in {partial})") from None
        raise
    f.close()


@main.command("run")
@model_options
@decoder_options
@click.option("--task", default="code-completion", show_default=True, help="See `aspire-bench tasks`.")
@click.option("--data", default=None, help="Local dataset file/dir (json, jsonl, parquet) instead of the Hub cache.")
@click.option("--limit", default=8, show_default=True, type=T.POSITIVE, help="Samples to run.")
@click.option("--context-len", default=None, callback=T.context_len,
              help="Context bucket, e.g. 4k, 16k, 32k, 30-40k.")
@click.option("--repeat", default=1, show_default=True, type=T.POSITIVE, help="Measured repeats (median stored).")
@click.option("--parity", is_flag=True, help="Also run AR greedy and compare token for token.")
@click.option("--parity-tolerance", default=None, type=float,
              help="Near-tie tolerance relative to the logit scale (default: by dtype, see docs/metrics.md).")
@click.option("--store", default="aspire_results.db", show_default=True, help="SQLite results store.")
@click.option("--tag", default=None, help="Free label stored with the run.")
@click.option("--group", default=None, envvar="ASPIRE_BENCH_GROUP",
              help="Runs measured side by side share a group; speedups over AR are taken within it.")
@click.option("--unequal-work", is_flag=True,
              help="Under sampling, stop requests at EOS (default: generate exactly --max-new-tokens, so "
                   "every decoder does the same work); the group's speedups are marked 'unequal work'.")
@click.option("--tune", is_flag=True, help="magicdec / vegas: choose gamma on separate tuning requests first.")
@measure_options
@format_option
def run_command(model, dtype, device, attention_backend, decoder, decoder_args, batch_size, max_new_tokens,
                temperature, top_k, top_p, seed, task, data, limit, context_len, repeat, parity, parity_tolerance,
                store, tag, group, unequal_work, tune, percentiles, save_result, fmt):
    """Run a decoder on a task, print a summary and store the run."""
    from .harness.store import check_store_path
    from .tasks import get_task
    decoder_args = parse_decoder_args(decoder_args)
    # Checks that need no model (run() repeats them for API callers), before torch is even imported.
    check_store_path(store)
    if data is not None and not get_task(task).reads_data:
        raise click.BadParameter(f"task {task} makes its own prompts and reads no --data: drop --data",
                                 param_hint="--data")
    from rich.markup import escape

    from .harness.records import vllm_result
    from .harness.runner import RunConfig, run
    from .harness.tables import info, print_summary
    qs = parse_percentiles(percentiles)
    cfg = RunConfig(model=model, decoder=decoder, decoder_args=decoder_args, task=task,
                    data=data, limit=limit, context_len=context_len, batch_size=batch_size,
                    max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                    repeat=repeat, parity=parity, parity_tolerance=parity_tolerance,
                    dtype=_concrete_dtype(model, dtype), device=device,
                    attention_backend=attention_backend, equal_work=not unequal_work, tune=tune)
    result = run(cfg, store=store, tag=tag, group=group, percentiles=qs)
    print_summary([result.record], title=escape(f"{task} on {model}"), fmt=fmt,
                  baselines=_group_ar_runs(store, group), percentiles=qs)
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


def _concrete_dtype(model: str, dtype: str) -> str:
    """--dtype auto as the checkpoint's own dtype, so a stored run names the dtype it ran in."""
    if dtype != "auto":
        return dtype
    from .engine.loading import checkpoint_dtype, resolve_model_path
    return checkpoint_dtype(resolve_model_path(model))


@main.command("demo")
@click.option("--store", default="aspire_results.db", show_default=True)
@click.option("--out", default="leaderboards/demo", show_default=True, help="Leaderboard directory.")
@click.option("--contexts", default=None, help="Comma-separated context buckets (default: the demo sweep's).")
@click.option("--max-new-tokens", default=None, type=T.POSITIVE, help="Default: the demo sweep's.")
def demo_command(store, out, contexts, max_new_tokens):
    """AR, MagicDec, Vegas and ASPIRE side by side on the bundled tiny model; writes a leaderboard."""
    from .demo import demo
    overrides = {}
    if contexts:
        overrides["contexts"] = [c.strip() for c in contexts.split(",") if c.strip()]
    if max_new_tokens:
        overrides["max_new_tokens"] = max_new_tokens
    index = demo(store, out, **overrides)
    click.echo(f"leaderboard: {index}")


@main.command("bench")
@model_options
@click.option("--task", default="code-completion", show_default=True)
@click.option("--contexts", default="4k,16k,32k", show_default=True, callback=T.csv_contexts)
@click.option("--batch-sizes", default="1,8", show_default=True, callback=T.csv_positive_ints)
@click.option("--decoders", default="ar,magicdec,vegas,aspire,aspire-fixed,aspire-fsm,aspire-norefresh", show_default=True,
              callback=T.decoder_specs,
              help="Decoders, each with optional settings in brackets: magicdec[budget=512],aspire[ratio=0.035].")
@click.option("--repeat", default=3, show_default=True, type=T.POSITIVE)
@click.option("--max-new-tokens", default=128, show_default=True, type=T.POSITIVE)
@click.option("--sampling", default="greedy,paper", show_default=True,
              help="Sampling settings, each run on the same prefilled requests: greedy (parity is checked), "
                   "paper (temperature 0.7, top-k 50, top-p 0.9, the ASPIRE paper's), or temperature:top_k:top_p.")
@click.option("--seed", default=0, show_default=True, type=T.SEED)
@click.option("--limit", default=None, type=T.POSITIVE,
              help="Requests per cell (default: 16 or the batch size, whichever is larger).")
@click.option("--no-tune", is_flag=True, help="Skip tuning the baselines' gamma (no tuned rows).")
@click.option("--no-bound", is_flag=True, help="Skip measuring step costs (no bound share).")
@click.option("--no-calibration-rounds", is_flag=True,
              help="Skip the calibration rounds timed between runs (the simulator then uses the group's "
                   "ASPIRE calibration).")
@click.option("--store", default="aspire_results.db", show_default=True)
@click.option("--json", "json_out", default=None, type=click.Path(path_type=Path), callback=T.new_output_path,
              help="Also write the rows as JSON (a list of rows; see docs/metrics.md).")
@click.option("--parity-tolerance", default=None, type=float,
              help="Near-tie tolerance relative to the logit scale (default: by dtype, see docs/metrics.md).")
@measure_options
@format_option
def bench_command(model, dtype, device, attention_backend, task, contexts, batch_sizes, decoders, repeat,
                  max_new_tokens, sampling, seed, limit, no_tune, no_bound, no_calibration_rounds, store, json_out,
                  parity_tolerance, percentiles, save_result, fmt):
    """Decoders side by side on the same requests: tok/s, ratios with intervals, tuned baselines, bound share."""
    from .decoders import get_decoder
    from .decoders.base import sampling_in_range
    from .harness.bench import bench, bench_table, parse_sampling
    from .harness.records import vllm_result
    from .harness.store import check_store_path
    from .harness.tables import emit, info
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]
    try:
        samplings = [parse_sampling(x) for x in split(sampling)]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--sampling") from None
    for s in samplings:  # the ranges a single run has
        if not sampling_in_range(s.temperature, s.top_k, s.top_p):
            raise click.BadParameter(f"{s.name}: need temperature >= 0, top_k >= 0, 0 < top_p <= 1",
                                     param_hint="--sampling")
    for name, args in decoders:
        get_decoder(name, **args)  # an unknown name or setting fails now, not after the cells before it
    qs = parse_percentiles(percentiles)
    check_store_path(store)  # before the compute: a bad --store must not throw the benchmark away
    rows, bw = bench(model, task, contexts, batch_sizes, decoders, repeat,
                     max_new_tokens, samplings, seed, limit, store, _concrete_dtype(model, dtype), device,
                     attention_backend, tune=not no_tune, percentiles=qs, bound=not no_bound,
                     parity_tolerance=parity_tolerance, calibration_rounds=not no_calibration_rounds)
    data = [r.to_json() for r in rows]  # the `--json` contract, also what --format json prints
    emit(bench_table(rows, bw), fmt, data=data)
    if json_out:
        write_json(json_out, data)
    if save_result:
        write_json(save_result, [{**vllm_result(r.record, qs), "context": r.context, "sampling": r.sampling,
                                  "tuned": r.tuned} for r in rows])
    info(f"stored {len(rows)} runs in {store}", fmt)


@main.command("train-tiny", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                              "help_option_names": []})
@click.pass_context
def train_tiny_command(ctx):
    """Train the bundled tiny model (arguments: see `aspire-bench train-tiny --help`)."""
    from .tinymodel.train import main as train_main
    sys.exit(train_main(ctx.args))


@main.command("tasks")
def tasks_command():
    """List the tasks."""
    from .tasks import describe_tasks
    for name, desc in describe_tasks():
        click.echo(f"{name:18s} {desc}")


@main.command("decoders")
def decoders_command():
    """List the decoders."""
    from .decoders import decoder_names, describe_decoder
    for name in decoder_names():
        click.echo(f"{name:18s} {describe_decoder(name)}".rstrip())


@main.command("calibrate")
@model_options
@click.option("--batch-size", default=8, show_default=True, type=T.POSITIVE)
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
    click.echo(f"step time = {res['beta0'] * 1e3:.3f} ms + {res['beta_tok'] * 1e6:.2f} us/token + "
               f"{res['beta_attn'] * 1e9:.3f} ns/KV position read + "
               f"{res['beta_qk'] * 1e9:.3f} ns/(query x KV position)"
               + (f" beyond a row's first {res['qk_free']} tokens" if res["beta_qk"] and res["qk_free"] else "")
               + ("" if res["beta_qk"] else " (query x KV term not significant)")
               + (f" + {res['beta_multi'] * 1e9:.3f} ns/KV position read by a row of more than {res['qk_free']} "
                  "tokens" if res.get("beta_multi") else "")
               + (f" + {res['beta_sparse'] * 1e9:.3f} ns/KV position read scattered through a sparse view"
                  if res["beta_sparse"] else " (sparse-view term not significant)")
               + (f" + {res['beta_capture'] * 1e9:.3f} ns/KV position whose scores a row captured"
                  if res.get("beta_capture") else " (capture term not significant)"))
    from .decoders.scheduler import CostModel, fit_problem
    problem = fit_problem(CostModel.from_dict(res, "calibration"))
    if problem:
        click.echo(f"warning: this fit will be rejected by aspire ({problem}): calibrate on an idle machine",
                   err=True)
    click.echo(f"R^2 {res['r2']:.3f}; held-out relative error median {res['heldout_rel_err_median']:.1%}, "
               f"max {res['heldout_rel_err_max']:.1%} over {res['n_samples']} steps")
    click.echo(f"saved {path}")


def _register_commands():
    from .diagnose_cli import COMMANDS as diagnose_commands
    from .gate import COMMANDS as gate_commands
    from .harness.store_cli import COMMANDS as store_commands
    from .harness.sweep_cli import COMMANDS as sweep_commands
    from .lm_eval_cli import COMMANDS as lm_eval_commands
    from .report.cli import COMMANDS as report_commands
    from .simulator.cli import COMMANDS as simulator_commands
    for cmd in (*store_commands, *sweep_commands, *report_commands, *gate_commands, *lm_eval_commands,
                *diagnose_commands, *simulator_commands):
        main.add_command(cmd)


_register_commands()


if __name__ == "__main__":
    main()
