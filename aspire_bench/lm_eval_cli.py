"""`aspire-bench lm-eval ...`: lm-eval's own command line with the `aspire` model registered.

lm-eval 0.4.x only knows a third-party model once the module that registers it is imported, so
this command imports the plugin and hands every remaining argument to lm-eval unchanged:

    aspire-bench lm-eval --model aspire --model_args pretrained=tiny,decoder=aspire \
        --tasks aspire_aime_mini --include_path examples/lm_eval_tasks
    aspire-bench lm-eval run ...    # newer lm-eval's subcommands (run, ls, validate) pass through too

cli.py adds COMMANDS to the main group.
"""
from __future__ import annotations

import sys

import click

from .errors import UserError
from .harness.tables import examples


def _skip_builtin_tasks() -> None:
    """Index only --include_path tasks: lm-eval otherwise parses its ~14k built-in task YAMLs on
    every start (about a minute on a loaded 2-core machine)."""
    from lm_eval.tasks import TaskManager
    init = TaskManager.__init__
    if getattr(init, "_aspire_no_defaults", False):
        return

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("include_defaults", False)
        init(self, *args, **kwargs)

    __init__._aspire_no_defaults = True
    TaskManager.__init__ = __init__


def run_lm_eval(args: list[str], skip_builtin_tasks: bool = False) -> int:
    """Run lm-eval's CLI on `args` with the plugin registered; returns its exit status."""
    try:
        import lm_eval.__main__ as lm_main
    except ImportError as e:
        raise UserError(f"lm-eval is not installed ({e}): pip install 'aspire-bench[lm-eval]'") from e
    from . import lm_eval_plugin  # noqa: F401  (registers the `aspire` model)
    if skip_builtin_tasks:
        _skip_builtin_tasks()
    # Both lm-eval's CLIs (0.4.5's argparse `cli_evaluate` and the newer subcommand `HarnessCLI`)
    # read sys.argv, so the arguments go there rather than into a version-specific API.
    saved = sys.argv
    sys.argv = ["lm-eval", *args]
    try:
        lm_main.cli_evaluate()
    except SystemExit as e:  # argparse --help / usage errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0


def with_model_arg(args: list[str], pair: str) -> list[str]:
    """lm-eval arguments with `pair` appended to --model_args (added when absent)."""
    out = list(args)
    for i, a in enumerate(out):
        if a == "--model_args" and i + 1 < len(out):
            out[i + 1] = f"{out[i + 1]},{pair}" if out[i + 1] else pair
            return out
        if a.startswith("--model_args="):
            out[i] = f"{a},{pair}" if a != "--model_args=" else f"{a}{pair}"
            return out
    return [*out, "--model_args", pair]


@click.command("lm-eval", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                            "help_option_names": []},
               epilog=examples("aspire-bench lm-eval --model aspire --model_args pretrained=tiny,decoder=aspire "
                               "--tasks aspire_aime_mini --include_path examples/lm_eval_tasks --limit 4"))
@click.option("--skip-builtin-tasks", is_flag=True,
              help="Only load tasks from --include_path (faster start; built-in task names are then unknown).")
@click.option("--ar-reference", is_flag=True,
              help="Also run AR on the same requests, stored in the same group, so the leaderboard shows the "
                   "decoder's speedup (adds ar_reference=true to --model_args; needs store=PATH there).")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def lm_eval_command(skip_builtin_tasks, ar_reference, args):
    """Run lm-eval with the aspire model: all arguments go to lm-eval (`--help` prints lm-eval's help).

    e.g. aspire-bench lm-eval --model aspire --model_args pretrained=tiny,decoder=aspire,decoder.gamma_init=4
    --tasks aspire_aime_mini --include_path examples/lm_eval_tasks --limit 2"""
    args = list(args)
    if ar_reference:
        args = with_model_arg(args, "ar_reference=true")
    status = run_lm_eval(args, skip_builtin_tasks)
    if status:
        sys.exit(status)


COMMANDS = [lm_eval_command]
