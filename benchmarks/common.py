"""What the benchmark scripts share: the machine they ran on, progress bars, notes on stderr.

The scripts run as ``python benchmarks/<name>.py`` from the repository root, so this folder is on
``sys.path`` and ``import common`` finds this module.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hydra_deploy.bench.latency.machine import cpu_model, load_average
from hydra_deploy.bench.latency.machine import machine_info as machine  # Python, platform, CPU

__all__ = [
    "add_output_options",
    "cpu_model",
    "load_average",
    "machine",
    "note",
    "progress_bar",
    "refuse_existing",
]


@contextlib.contextmanager
def progress_bar(total: int, quiet: bool, unit: str = "run") -> Iterator[Any]:
    """A tqdm bar when tqdm is importable and not --quiet; otherwise a no-op with .update()."""

    class _Null:
        def update(self, n: int = 1) -> None:
            pass

        def set_description(self, desc: str) -> None:
            pass

    if quiet:
        yield _Null()
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield _Null()
        return
    with tqdm(total=total, unit=unit, dynamic_ncols=True) as bar:
        yield bar


def add_output_options(
    parser: argparse.ArgumentParser,
    out_help: str,
    *,
    default: Path | None = None,
    overwrite_help: str = "replace existing output files",
    quiet_help: str = "no progress notes",
) -> None:
    """``--out`` (its default and help the script's), ``--overwrite`` and ``--quiet``: every
    benchmark's output options."""
    parser.add_argument("--out", type=Path, default=default, help=out_help)
    parser.add_argument("--overwrite", action="store_true", help=overwrite_help)
    parser.add_argument("--quiet", action="store_true", help=quiet_help)


def note(args: argparse.Namespace, message: str) -> None:
    """A progress line on stderr unless --quiet."""
    if not args.quiet:
        print(message, file=sys.stderr)


def refuse_existing(json_out: Path, overwrite: bool) -> Path | None:
    """The report's markdown path beside ``json_out``; None (and one ``error:`` line on stderr)
    when either exists and ``overwrite`` is off."""
    markdown_out = json_out.with_suffix(".md")
    for path in (json_out, markdown_out):
        if path.exists() and not overwrite:
            print(f"error: {path} exists; pass --overwrite to replace it", file=sys.stderr)
            return None
    return markdown_out
