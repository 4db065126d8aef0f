"""`aspire-bench sweep SWEEP.yaml`: run a sweep file's cells and print their summary. cli.py adds COMMANDS."""
from __future__ import annotations

from pathlib import Path

import click

from .store_cli import store_option
from .tables import columns_option, examples, format_option, info, print_sweep_summary


@click.command(epilog=examples("aspire-bench sweep aspire_bench/sweeps/demo.yaml --dry-run",
                               "aspire-bench sweep my_sweep.yaml --resume --store sweep.db"))
@click.argument("sweep_file", type=click.Path(path_type=Path))
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="local: cell by cell in this process; ray: one Ray task per cell.")
@click.option("--resume", is_flag=True, help="Skip the cells already stored with status ok (same config hash).")
@store_option
@click.option("--ray-address", default=None, help="Existing Ray cluster (e.g. auto, ray://host:10001); "
              "default: start a local one.")
@click.option("--dry-run", is_flag=True, help="List the cells and exit.")
@columns_option
@format_option
def sweep(sweep_file, executor, resume, store_path, ray_address, dry_run, columns, fmt):
    """Run a sweep: models x tasks x contexts x batch sizes x ... x decoders (see docs/sweeps.md)."""
    from .schema import check_sweep_file
    check_sweep_file(sweep_file)  # before the heavy imports below: a bad file fails at once
    from .sweep import load_sweep, run_sweep
    sw = load_sweep(sweep_file)
    from .tables import summary_table
    summary_table([], columns=columns)  # an unknown --columns name fails before the sweep runs
    if dry_run:
        for cell in sw.cells:
            click.echo(f"{cell.index:4d}  {cell.label()}  {cell.config_hash[:12]}")
        click.echo(f"{len(sw.cells)} cells in sweep {sw.name}")
        return
    try:
        out = run_sweep(sw, store_path, executor=executor, resume=resume, ray_address=ray_address)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"the cells that finished are stored in {store_path}; `aspire-bench sweep {sweep_file} "
                                f"--resume --store {store_path}` runs the rest") from None
    print_sweep_summary(out.records, sw.name, fmt, columns)
    info(f"sweep {sw.name}: {out.ran} cells run, {out.skipped} already stored, {len(out.failed)} failed; "
         f"invocation {out.invocation}, store {store_path}", fmt)
    for rec in out.failed:
        c = rec.config
        click.secho(f"  failed: {c['decoder']} {c['task']} {c.get('context_len') or '-'} on {c['model']}: "
                    f"{rec.error}", fg="red", err=True)


COMMANDS = [sweep]
