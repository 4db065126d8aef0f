"""The `aspire-bench` command line. User errors print one line and exit 2 (no traceback)."""
from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import click

from .errors import UserError
from .harness.tables import format_option


def parse_decoder_args(pairs: tuple[str, ...]) -> dict:
    from .decoders import parse_value
    out = {}
    for p in pairs:
        if "=" not in p:
            raise UserError(f"--decoder-arg {p!r} is not of the form key=value")
        k, v = p.split("=", 1)
        out[k.strip().replace("-", "_")] = parse_value(v.strip())
    return out


def model_options(f):
    for opt in reversed([
        click.option("--model", default="tiny", show_default=True,
                     help="HF checkpoint directory, or `tiny` (the bundled model)."),
        click.option("--dtype", default="float32", show_default=True, help="float32 | bfloat16 | float16 | auto (the checkpoint's own)"),
        click.option("--device", default="cpu", show_default=True, help="cpu | cuda"),
        click.option("--attention-backend", default="auto", show_default=True, help="auto | torch | cpu | triton (auto: triton on CUDA, cpu on CPU)"),
    ]):
        f = opt(f)
    return f


class TokenCount(click.ParamType):
    """A number of tokens: 4096, 4k or 4.5k (k = 1024), as context buckets are written."""
    name = "tokens"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        from .tasks.buckets import parse_bucket
        try:
            lo, hi = parse_bucket(value)
        except UserError as e:
            self.fail(f"{e}; here one length, e.g. 4096 or 4k", param, ctx)
        if lo != hi:
            self.fail(f"{value!r} is a window; give one length, e.g. 4096 or 4k", param, ctx)
        return lo


def decoder_options(f, max_new_help: str = "Default: the task's own."):
    for opt in reversed([
        click.option("--decoder", default="ar", show_default=True, help="ar | magicdec | vegas | aspire | ..."),
        click.option("--decoder-arg", "decoder_args", multiple=True, metavar="K=V",
                     help="Decoder setting, repeatable (e.g. gamma=4)."),
        click.option("--batch-size", default=8, show_default=True, type=int),
        click.option("--max-new-tokens", default=None, type=int, help=max_new_help),
        click.option("--temperature", default=0.0, show_default=True, type=float),
        click.option("--top-k", default=0, show_default=True, type=int),
        click.option("--top-p", default=1.0, show_default=True, type=float),
        click.option("--seed", default=0, show_default=True, type=int),
    ]):
        f = opt(f)
    return f


class Main(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UserError as e:
            click.secho(f"error: {e}", fg="red", err=True)
            sys.exit(2)


@click.group(cls=Main)
@click.version_option(package_name="aspire-bench")
@click.option("--threads", default=None, type=int, envvar="ASPIRE_BENCH_THREADS",
              help="CPU threads for torch (default: torch's). On a busy machine 1 is often faster.")
def main(threads):
    """Benchmark and evaluate long-context speculative decoders (AR, MagicDec, Vegas, ASPIRE)."""
    if threads:
        import torch
        torch.set_num_threads(threads)


def read_prompts(path: Path, tokenizer) -> list[tuple[str, list[int]]]:
    if not path.exists():
        raise UserError(f"prompts file {path} does not exist")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n} is not valid JSON ({e.msg})") from e
        rid = str(obj.get("id", n))
        if "input_ids" in obj:
            rows.append((rid, [int(t) for t in obj["input_ids"]]))
        elif "prompt" in obj:
            if tokenizer is None:
                raise UserError("text prompts need a tokenizer in the checkpoint directory; give input_ids")
            rows.append((rid, tokenizer.encode(obj["prompt"])))
        else:
            raise UserError(f'{path}:{n} needs "prompt" or "input_ids"')
    return rows


@main.command()
@model_options
@functools.partial(decoder_options, max_new_help="Default: 128.")
@click.option("--prompts", "prompts_path", required=True, type=click.Path(path_type=Path),
              help='JSONL with {"id", "prompt"} or {"id", "input_ids"} per line.')
@click.option("--out", "out_path", required=True, type=click.Path(path_type=Path))
def generate(model, dtype, device, attention_backend, decoder, decoder_args, batch_size, max_new_tokens,
             temperature, top_k, top_p, seed, prompts_path, out_path):
    """Generate for your own prompts with any decoder; writes one JSON row per prompt."""
    from .decoders import Request, SamplingParams, get_decoder
    from .engine import Engine
    from .progress import TokenProgress
    dec = get_decoder(decoder, **parse_decoder_args(decoder_args))
    engine = Engine.from_pretrained(model, dtype, device, attention_backend)
    tok = engine.tokenizer
    prompts = read_prompts(prompts_path, tok)
    reqs = [Request(rid, ids, max_new_tokens or 128) for rid, ids in prompts]
    params = SamplingParams(temperature, top_k, top_p, seed, engine.cfg.eos_token_ids)
    with TokenProgress(sum(r.max_new_tokens for r in reqs), f"{decoder}") as bar:
        out = dec.generate(engine, reqs, params, batch_size, progress=bar.advance)
    tmp = out_path.with_suffix(out_path.suffix + ".tmp")
    with tmp.open("w") as f:
        for r in out.results:
            text = tok.decode(r.output_ids, skip_special_tokens=True) if tok is not None else None
            f.write(json.dumps({"id": r.id, "output_ids": r.output_ids, "text": text,
                                "finish_reason": r.finish_reason}) + "\n")
    tmp.replace(out_path)  # atomic: never a half-written output file
    click.echo(f"wrote {len(out.results)} rows to {out_path}")


@main.command("run")
@model_options
@decoder_options
@click.option("--task", default="code-completion", show_default=True, help="See `aspire-bench tasks`.")
@click.option("--data", default=None, help="Local dataset file/dir (json, jsonl, parquet) instead of the Hub cache.")
@click.option("--limit", default=8, show_default=True, type=int, help="Samples to run.")
@click.option("--context-len", default=None, help="Context bucket, e.g. 4k, 16k, 32k, 30-40k.")
@click.option("--repeat", default=1, show_default=True, type=int, help="Measured repeats (median stored).")
@click.option("--parity", is_flag=True, help="Also run AR greedy and compare token for token.")
@click.option("--store", default="aspire_results.db", show_default=True, help="SQLite results store.")
@click.option("--tag", default=None, help="Free label stored with the run.")
@click.option("--group", default=None, envvar="ASPIRE_BENCH_GROUP",
              help="Runs measured side by side share a group; speedups over AR are taken within it.")
@format_option
def run_command(model, dtype, device, attention_backend, decoder, decoder_args, batch_size, max_new_tokens,
                temperature, top_k, top_p, seed, task, data, limit, context_len, repeat, parity, store, tag, group,
                fmt):
    """Run a decoder on a task, print a summary and store the run."""
    from .harness.runner import RunConfig, run
    from .harness.tables import info, print_summary
    cfg = RunConfig(model=model, decoder=decoder, decoder_args=parse_decoder_args(decoder_args), task=task,
                    data=data, limit=limit, context_len=context_len, batch_size=batch_size,
                    max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                    repeat=repeat, parity=parity, dtype=dtype, device=device,
                    attention_backend=attention_backend)
    result = run(cfg, store=store, tag=tag, group=group)
    print_summary([result.record], title=f"{task} on {model}", fmt=fmt, baselines=_group_ar_runs(store, group))
    info(f"stored run {result.run_id} in {store}", fmt)


def _group_ar_runs(store: str, group: str | None) -> list:
    """The AR runs stored in `group`: the speedup of a run joining a group is over them."""
    if group is None:
        return []
    from .harness.store import Store
    with Store(store) as st:
        return [st.get_run(s["run_id"]) for s in st.list_runs(group=group, decoder="ar", status="ok")]


@main.command("demo")
@click.option("--store", default="aspire_results.db", show_default=True)
@click.option("--out", default="leaderboards/demo", show_default=True, help="Leaderboard directory.")
@click.option("--contexts", default=None, help="Comma-separated context buckets (default: the demo sweep's).")
@click.option("--max-new-tokens", default=None, type=int, help="Default: the demo sweep's.")
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
@click.option("--contexts", default="4k,16k,32k", show_default=True)
@click.option("--batch-sizes", default="1,8", show_default=True)
@click.option("--decoders", default=",".join(("ar", "magicdec", "vegas", "aspire", "aspire-fixed", "aspire-fsm",
                                              "aspire-norefresh")), show_default=True)
@click.option("--repeat", default=3, show_default=True, type=int)
@click.option("--max-new-tokens", default=128, show_default=True, type=int)
@click.option("--sampling", default="greedy,paper", show_default=True,
              help="Sampling settings, each run on the same prefilled requests: greedy (parity is checked), "
                   "paper (temperature 0.7, top-k 50, top-p 0.9, the ASPIRE paper's), or temperature:top_k:top_p.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--limit", default=None, type=int, help="Requests per cell (default: the batch size).")
@click.option("--store", default="aspire_results.db", show_default=True)
@click.option("--json", "json_out", default=None, type=click.Path(path_type=Path), help="Also write the table as JSON.")
@format_option
def bench_command(model, dtype, device, attention_backend, task, contexts, batch_sizes, decoders, repeat,
                  max_new_tokens, sampling, seed, limit, store, json_out, fmt):
    """Decoders side by side on the same requests: tok/s, ratios, acceptance, parity, bandwidth."""
    from .harness.bench import bench, bench_table, parse_sampling
    from .harness.tables import emit, info
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]
    try:
        samplings = [parse_sampling(x) for x in split(sampling)]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--sampling") from None
    rows, bw = bench(model, task, split(contexts), [int(b) for b in split(batch_sizes)], split(decoders), repeat,
                     max_new_tokens, samplings, seed, limit, store, dtype, device, attention_backend)
    data = [{"context": r.context, "batch_size": r.batch_size, "sampling": r.sampling,
             "decoder": r.record.config["decoder"], "run_id": r.record.run_id, **r.record.aggregates} for r in rows]
    emit(bench_table(rows, bw), fmt, data=data)
    if json_out:
        json_out.write_text(json.dumps(data, indent=1))
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
    from .decoders import decoder_names
    for name in decoder_names():
        click.echo(name)


@main.command("calibrate")
@model_options
@click.option("--batch-size", default=8, show_default=True, type=int)
@click.option("--context-len", default=4096, show_default=True, type=TokenCount(),
              help="Context of each request in tokens (4096 or 4k).")
@click.option("--repeats", default=3, show_default=True, type=int)
@click.option("--out", default=None, type=click.Path(path_type=Path),
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
               f"{res['beta_qk'] * 1e12:.3f} ps/(query x KV position)"
               + ("" if res["beta_qk"] else " (query x KV term not significant: the paper's three terms)"))
    from .decoders.scheduler import CostModel, fit_problem
    problem = fit_problem(CostModel.from_dict(res, "calibration"))
    if problem:
        click.echo(f"warning: this fit will be rejected by aspire ({problem}): calibrate on an idle machine",
                   err=True)
    click.echo(f"R^2 {res['r2']:.3f}; held-out relative error median {res['heldout_rel_err_median']:.1%}, "
               f"max {res['heldout_rel_err_max']:.1%} over {res['n_samples']} steps")
    click.echo(f"saved {path}")


def _register_commands():
    from .gate import COMMANDS as gate_commands
    from .harness.store_cli import COMMANDS as store_commands
    from .harness.sweep_cli import COMMANDS as sweep_commands
    from .lm_eval_cli import COMMANDS as lm_eval_commands
    from .report.cli import COMMANDS as report_commands
    for cmd in (*store_commands, *sweep_commands, *report_commands, *gate_commands, *lm_eval_commands):
        main.add_command(cmd)


_register_commands()


if __name__ == "__main__":
    main()
