"""Progress in tests: hydra_deploy.progress's log lines on every update, and the lines said."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import pytest

from hydra_deploy import progress as progress_module


@contextlib.contextmanager
def every_update(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> Iterator:
    """A progress line on every update (``LOG_EVERY_S`` 0) and the hydra_deploy logger at INFO,
    as the commands set it (and put back afterwards); yields ``caplog``."""
    monkeypatch.setattr(progress_module, "LOG_EVERY_S", 0.0)
    logger = logging.getLogger("hydra_deploy")
    before = logger.level
    logger.setLevel(logging.INFO)
    caplog.set_level(logging.INFO, logger="hydra_deploy")
    try:
        yield caplog
    finally:
        logger.setLevel(before)


def progress_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The hydra_deploy.progress lines ``caplog`` holds."""
    return [r.getMessage() for r in caplog.records if r.name == "hydra_deploy.progress"]
