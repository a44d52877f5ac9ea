"""hydra_deploy.progress: a bar in a terminal, log lines in a log, nothing when quiet or unasked."""

from __future__ import annotations

import io
import logging

import pytest

from hydra_deploy import progress as progress_module
from hydra_deploy.progress import progress, track


@pytest.fixture
def our_logs(caplog: pytest.LogCaptureFixture):
    """The hydra_deploy logger at INFO, as every command sets it (not --quiet)."""
    logger = logging.getLogger("hydra_deploy")
    before = logger.level
    logger.setLevel(logging.INFO)
    caplog.set_level(logging.INFO, logger="hydra_deploy.progress")
    yield caplog
    logger.setLevel(before)


def test_a_log_gets_lines_with_counts_and_time_left(our_logs, monkeypatch):
    monkeypatch.setattr(progress_module, "LOG_EVERY_S", 0.0)
    with progress(total=4, desc="calibrating", unit="batch", bar=False) as bar:
        bar.update()
        bar.update(2)
    lines = [r.getMessage() for r in our_logs.records if r.name == "hydra_deploy.progress"]
    assert lines[0].startswith("calibrating: 1/4 batches (25%), 0 s")
    assert "about" in lines[0] and "left" in lines[0]
    assert lines[1].startswith("calibrating: 3/4 batches (75%)")
    assert bar.done == 3


def test_lines_are_spaced(our_logs, monkeypatch):
    monkeypatch.setattr(progress_module, "LOG_EVERY_S", 3600.0)
    with progress(total=100, desc="x", bar=False) as bar:
        for _ in range(100):
            bar.update()
    assert not [r for r in our_logs.records if r.name == "hydra_deploy.progress"]


def test_quiet_says_nothing(caplog, monkeypatch, capsys):
    monkeypatch.setattr(progress_module, "LOG_EVERY_S", 0.0)
    logger = logging.getLogger("hydra_deploy")
    before = logger.level
    logger.setLevel(logging.ERROR)  # --quiet
    try:
        assert list(track(range(5), desc="x", unit="item")) == list(range(5))
    finally:
        logger.setLevel(before)
    assert not [r for r in caplog.records if r.name == "hydra_deploy.progress"]
    out, err = capsys.readouterr()
    assert out == "" and err == ""


def test_a_terminal_gets_a_tqdm_bar_on_stderr(our_logs, monkeypatch):
    pytest.importorskip("tqdm", reason="the bar needs tqdm (the [build] extra)")
    stderr = io.StringIO()
    monkeypatch.setattr("sys.stderr", stderr)
    with progress(total=3, desc="fine-tuning member 1", unit="step", bar=True) as bar:
        for _ in range(3):
            bar.update()
        bar.describe("fine-tuning member 2")
    assert "fine-tuning member" in stderr.getvalue()
    assert not [r for r in our_logs.records if r.name == "hydra_deploy.progress"]


def test_track_counts_len_and_unknown_totals(our_logs, monkeypatch):
    monkeypatch.setattr(progress_module, "LOG_EVERY_S", 0.0)
    assert list(track([1, 2], desc="a", unit="shard")) == [1, 2]
    assert list(track(iter([1, 2]), desc="b", unit="shard")) == [1, 2]
    lines = [r.getMessage() for r in our_logs.records if r.name == "hydra_deploy.progress"]
    assert lines[:2] == [
        lines[0],
        lines[1],
    ] and lines[0].startswith("a: 1/2 shards (50%)")
    assert lines[-1].startswith("b: 2 shards, ")


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.4, "0 s"), (59, "59 s"), (61, "1:01"), (3725, "1:02:05")]
)
def test_clock(seconds, text):
    assert progress_module._clock(seconds) == text


@pytest.mark.parametrize(
    ("n", "noun", "text"),
    [
        (1, "class", "1 class"),
        (3, "class", "3 classes"),
        (2, "batch", "2 batches"),
        (0, "image", "0 images"),
        (2, "query", "2 queries"),
        (2, "day", "2 days"),
    ],
)
def test_counted(n, noun, text):
    from hydra_deploy.errors import counted

    assert counted(n, noun) == text
