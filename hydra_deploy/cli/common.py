"""What every hydra-* command shares: --quiet/--debug/--json, one-line errors, exit codes."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra_deploy.errors import HydraError, ParameterError, command_spelling
from hydra_deploy.optional import DEPENDENCIES, missing_message
from hydra_deploy.options import PARAMETER_FLAGS, from_args, spelling

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


def entry_point(
    build_parser: Callable[[], argparse.ArgumentParser],
    main_body: Callable[[argparse.Namespace], int | None],
    prog: str,
) -> Callable[[list[str] | None], int]:
    """A command's ``main(argv=None)``: parse ``argv`` (None: the command line) with
    ``build_parser()``, run ``main_body`` through :func:`run`; returns the exit code."""

    def main(argv: list[str] | None = None) -> int:
        return run(main_body, build_parser().parse_args(argv))

    main.__doc__ = f"Entry point of ``{prog}``; returns the exit code."
    return main


@contextlib.contextmanager
def flags_named(flags: Mapping[str, str]) -> Iterator[None]:
    """A ParameterError raised inside names the command's flags (``flags``: parameter -> flag,
    others ``--name-with-dashes``)."""
    try:
        yield
    except ParameterError as err:
        err.args = (err.for_command(flags),)
        raise


def options(group: type, args: argparse.Namespace, *, prefix: str = "", **given: Any) -> Any:
    """:func:`~hydra_deploy.options.from_args`, its ParameterError naming the command's flags."""
    with flags_named(spelling(group, prefix)):
        return from_args(group, args, prefix=prefix, **given)


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
