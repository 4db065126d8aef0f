"""`aspire-bench report`: the store's runs as static HTML leaderboards. cli.py adds COMMANDS."""
from __future__ import annotations

from pathlib import Path

import click

from aspire_bench.harness.store_cli import store_option
from aspire_bench.harness.tables import examples
from aspire_bench.report import write_report


@click.command(epilog=examples("aspire-bench report --out leaderboards/",
                               "aspire-bench report --store sweep.db --out /tmp/boards"))
@store_option
@click.option("--out", "out_dir", default="leaderboards", show_default=True, type=click.Path(path_type=Path),
              help="Directory for the HTML pages (created).")
def report(store_path, out_dir):
    """Write HTML leaderboards (index, plots, run pages) that work offline."""
    index = write_report(store_path, out_dir)
    click.echo(f"leaderboards -> {index}")


COMMANDS = [report]
