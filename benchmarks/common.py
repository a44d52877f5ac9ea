"""What the benchmark scripts share: the machine they ran on, progress bars, notes on stderr.

The scripts run as ``python benchmarks/<name>.py`` from the repository root, so this folder is on
``sys.path`` and ``import common`` finds this module.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for text_line in Path("/proc/cpuinfo").read_text().splitlines():
            if text_line.startswith("model name"):
                return text_line.split(":", 1)[1].strip()
    return platform.processor() or None


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages (None where the platform has none)."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def machine() -> dict[str, Any]:
    """Python, platform and CPU of this run (each script adds its libraries and threads)."""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
    }


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


def note(args: argparse.Namespace, message: str) -> None:
    """A progress line on stderr unless --quiet."""
    if not args.quiet:
        print(message, file=sys.stderr)
