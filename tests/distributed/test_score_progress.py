"""hydra-score-dataset's progress: in a log, one line of its own (items received, shards written)
instead of Ray Data's bars (a block of lines every 10 s there); in a terminal, Ray Data's bars;
with --quiet, neither. stdout (--json) is the same either way."""

from __future__ import annotations

import contextlib
import io
import json
import logging

import numpy as np
import pytest
from helpers.decisions import tiny_export
from helpers.progress import every_update, progress_lines
from helpers.ray_local import local_ray
from PIL import Image

pytest.importorskip(
    "pyarrow", reason="hydra-score-dataset needs pyarrow: pip install 'hydra-deploy[ray]'"
)
pytest.importorskip(
    "ray.data", reason="hydra-score-dataset needs Ray Data: pip install 'hydra-deploy[ray]'"
)

from hydra_deploy.cli.score_dataset import main
from hydra_deploy.distributed.ray_score import cluster

#: what differs between two runs of the same data: times
TIMES = {"seconds", "ray_start_seconds", "scoring_seconds", "items_per_second"}
TIMES |= {"items_per_second_scoring", "out"}


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    with local_ray():
        yield


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("score-progress")
    export = tiny_export(root / "export")
    images = root / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i in range(12):
        pixels = rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(images / f"{i:02d}.png")
    return export, images


@pytest.fixture()
def logs(monkeypatch, caplog):
    with every_update(monkeypatch, caplog) as captured:
        yield captured


def invoke(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def test_a_log_gets_lines_per_block_and_quiet_none(setup, tmp_path, logs):
    export, images = setup
    argv = [export, images, "--shard-size", 4, "--batch-size", 2, "--actors", 1, "--json"]
    code, out, err = invoke(*argv, "--out", tmp_path / "a")
    assert code == 0, err
    lines = progress_lines(logs)
    assert lines and all(line.startswith("scoring, ") for line in lines)
    assert lines[-1].startswith("scoring, 3/3 shards written: 12/12 items (100%)")
    logs.clear()
    code, quiet, err = invoke(*argv, "--out", tmp_path / "b", "--quiet")
    assert code == 0 and err == ""
    assert not progress_lines(logs)
    loud, still = json.loads(out), json.loads(quiet)
    assert {k: v for k, v in loud.items() if k not in TIMES} == {
        k: v for k, v in still.items() if k not in TIMES
    }


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("terminal", "progress", "bars"),
    [(True, True, True), (False, True, False), (True, False, False), (False, False, False)],
)
def test_ray_data_bars_in_a_terminal_only(monkeypatch, terminal, progress, bars):
    """Ray Data's own bars: in a terminal when not --quiet; off in a log (ours instead), and its
    "Progress bars disabled" warning is not said there."""
    monkeypatch.setattr("sys.stderr", _Terminal() if terminal else io.StringIO())
    assert cluster.ray_bars_shown(progress) is bars
    says_off = logging.getLogger(cluster._RAY_PROGRESS_LOGGER)
    level = says_off.level
    with cluster._data_context(progress) as context:
        assert context.enable_progress_bars is bars
        assert says_off.level == (level if bars else logging.ERROR)
    assert says_off.level == level
