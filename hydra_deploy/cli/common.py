"""What every hydra-* command shares: --quiet/--debug/--json, one-line errors, exit codes."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hydra_deploy.errors import HydraError, command_spelling
from hydra_deploy.options import PARAMETER_FLAGS

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for `yes | head`


def parser(prog: str, description: str, examples: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog="examples:\n" + examples,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quiet", action="store_true", help="print only errors (and --json output)")
    p.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    return p


def run(main: Callable[[argparse.Namespace], int | None], args: argparse.Namespace) -> int:
    """Run a command body; HydraErrors become one line on stderr and a non-zero exit."""
    # our own progress lines at INFO; other libraries (exporters, optimizers) only when they warn
    logging.basicConfig(
        level=logging.WARNING,
        format="%(levelname)s: %(name)s: %(message)s" if args.debug else "%(message)s",
    )
    logging.getLogger("hydra_deploy").setLevel(
        logging.ERROR if args.quiet else (logging.DEBUG if args.debug else logging.INFO)
    )
    try:
        with command_spelling(PARAMETER_FLAGS):  # warnings and advice name the flags
            code = int(main(args) or 0)
            sys.stdout.flush()  # inside the try: a closed pipe raises here, not at exit
            return code
    except HydraError as err:
        if args.debug:
            raise
        print(f"error: {err}", file=sys.stderr)
        return EXIT_ERROR
    except ModuleNotFoundError as err:  # an extra this command needs is not installed
        from hydra_deploy.optional import DEPENDENCIES, missing_message

        top = (err.name or "").partition(".")[0]
        if args.debug or top not in DEPENDENCIES:
            raise
        print(f"error: {missing_message(top, reason=err)}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (`hydra-run ... | head`): stop quietly, as `yes` does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's flush at exit would raise again
        return EXIT_BROKEN_PIPE


def add_allow_decisions_mismatch(group: Any) -> None:
    """``--allow-decisions-mismatch``, on every command that applies hydra-calibrate's decisions."""
    group.add_argument(
        "--allow-decisions-mismatch",
        action="store_true",
        help="apply the decisions of hydra-calibrate even on other numbers than they were fitted "
        "on (another backend, precision or engine file), with a warning: their guarantees do "
        "not cover these numbers (default: refused, with the command that fits them again)",
    )


def refuse_existing(path: Path, overwrite: bool) -> None:
    if path.exists() and not overwrite:
        raise HydraError(f"{str(path)!r} exists; pass --overwrite to replace it")


def print_table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [
        "  ".join(
            c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
