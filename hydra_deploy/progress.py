"""Progress of a long step, where the user sees it: a bar in a terminal, a line now and then in a log.

Every step of a command that can take more than a few seconds (INT8 calibration, hydra-calibrate's
pass, fine-tuning, hydra-eval, Ray shards) reports through :func:`progress` or :func:`track`:

- stderr is a terminal and tqdm is installed: a tqdm bar on stderr that disappears when done;
- otherwise (a log file, a CI job, the core install without tqdm): one INFO line on the
  ``hydra_deploy.progress`` logger every :data:`LOG_EVERY_S` seconds, e.g.
  ``calibrating: 120/400 batches (30%), 45 s, about 1:45 left``, so a log shows the job is alive;
- nothing when the ``hydra_deploy`` logger is above INFO: a command's ``--quiet``, or a library
  user who has not turned our logs on (a library does not print unasked).

stdout is never written (it carries results and ``--json`` output). Standard library only (tqdm is
imported when a bar is shown, and is optional): the edge runtime uses this too::

    with progress(total=len(batches), desc="calibrating", unit="batch") as bar:
        for batch in batches:
            ...
            bar.update()

    for member in track(members, desc="fine-tuning", unit="member"):
        ...
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from hydra_deploy.errors import plural

__all__ = ["LOG_EVERY_S", "Progress", "progress", "track"]

T = TypeVar("T")

#: Seconds between two log lines when no bar is shown (a module attribute: tests set it to 0).
LOG_EVERY_S = 30.0

log = logging.getLogger("hydra_deploy.progress")


def _is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


def _clock(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}:{seconds:02d}"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}"


class Progress:
    """One step's progress (see the module's docstring); use :func:`progress` to make one."""

    def __init__(
        self, total: int | None, desc: str, unit: str, enabled: bool, bar: bool | None
    ) -> None:
        self.total = None if total is None else int(total)
        self.desc = desc
        self.unit = unit
        self.done = 0
        self.enabled = enabled
        self._start = time.monotonic()
        self._last_line = self._start
        self._bar: Any = None
        if enabled and (_is_terminal() if bar is None else bar):
            try:
                from tqdm.auto import tqdm
            except ImportError:  # the core install: log lines instead
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(
                    total=self.total,
                    desc=desc,
                    unit=unit,
                    file=sys.stderr,
                    dynamic_ncols=True,
                    leave=False,
                )

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        """``n`` more units done."""
        self.done += int(n)
        if self._bar is not None:
            self._bar.update(n)
        elif self.enabled:
            now = time.monotonic()
            if now - self._last_line >= LOG_EVERY_S:
                self._last_line = now
                log.info("%s", self.line(now))

    def describe(self, desc: str) -> None:
        """Change what the step is called (a bar's label; the next log line's start)."""
        self.desc = desc
        if self._bar is not None:
            self._bar.set_description(desc)

    def line(self, now: float | None = None) -> str:
        """``desc: done/total unit (pct), elapsed, about T left``."""
        elapsed = (time.monotonic() if now is None else now) - self._start
        unit = plural(self.unit)
        if not self.total:
            return f"{self.desc}: {self.done} {unit}, {_clock(elapsed)}"
        share = self.done / self.total
        text = f"{self.desc}: {self.done}/{self.total} {unit} ({math.floor(100 * share)}%)"
        text += f", {_clock(elapsed)}"
        if 0 < share < 1:
            text += f", about {_clock(elapsed * (1 - share) / share)} left"
        return text

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self._start


def progress(
    total: int | None = None,
    *,
    desc: str,
    unit: str = "it",
    enabled: bool | None = None,
    bar: bool | None = None,
) -> Progress:
    """A :class:`Progress` for ``total`` units (None: unknown); a context manager.

    ``enabled`` None: on when the ``hydra_deploy`` logger passes INFO (the commands set it; their
    ``--quiet`` turns it off). ``bar`` None: a tqdm bar when stderr is a terminal.
    """
    if enabled is None:
        enabled = logging.getLogger("hydra_deploy").isEnabledFor(logging.INFO)
    return Progress(total, desc, unit, enabled, bar)


def track(
    items: Iterable[T],
    *,
    desc: str,
    total: int | None = None,
    unit: str = "it",
    enabled: bool | None = None,
) -> Iterator[T]:
    """Yield ``items``, one unit of progress each (``total`` defaults to ``len(items)``)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with progress(total, desc=desc, unit=unit, enabled=enabled) as bar:
        for item in items:
            yield item
            bar.update()
