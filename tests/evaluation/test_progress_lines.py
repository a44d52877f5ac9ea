"""Progress of hydra-calibrate's, hydra-eval's and hydra-compare's passes (a log gets
hydra_deploy.progress lines, --quiet none, stdout unchanged), and hydra-calibrate's warning on a
model at chance, given after the first batches."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import shutil

import numpy as np
import pytest
from helpers.decisions import images, labelled_like_model, tiny_export
from helpers.progress import every_update, progress_lines

from hydra_deploy.cli.calibrate import main as calibrate_main
from hydra_deploy.cli.compare import main as compare_main
from hydra_deploy.cli.eval import main as eval_main
from hydra_deploy.engines import load_runner
from hydra_deploy.evaluation.calibrate import CHANCE_AFTER, ChanceCheck, at_chance


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny export (5 classes), data it is right on (its own predictions) and data at chance
    (random labels), 200 examples each, and unlabelled noise."""
    root = tmp_path_factory.mktemp("progress")
    export = tiny_export(root / "export")
    x = images(200, seed=3)
    with load_runner(export) as runner:
        _, right = labelled_like_model(runner, x, keep=1.0)
    np.savez(root / "right.npz", x=x, y=right)
    np.savez(root / "chance.npz", x=x, y=np.random.default_rng(4).integers(0, 5, len(x)))
    np.savez(root / "noise.npz", x=images(20, seed=5, scale=3.0))
    return {"root": root, "export": export, "right": right}


@pytest.fixture()
def export(built, tmp_path):
    copy = tmp_path / "export"
    shutil.copytree(built["export"], copy)
    return copy


@pytest.fixture()
def logs(monkeypatch, caplog):
    with every_update(monkeypatch, caplog) as captured:
        yield captured


def invoke(main, *argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def chance_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "about chance" in r.getMessage()
    ]


def calibrate_json(export, data, *flags) -> tuple[dict, str]:
    code, out, err = invoke(calibrate_main, str(export), "--data", str(data), "--json", *flags)
    assert code == 0, err
    return json.loads(out), err


def test_calibrate_shows_its_pass_in_a_log_and_nothing_when_quiet(built, tmp_path, logs):
    first = tmp_path / "first"
    shutil.copytree(built["export"], first)
    report, _ = calibrate_json(first, built["root"] / "right.npz", "--batch-size", "4")
    lines = progress_lines(logs)
    assert lines[0].startswith("calibrating: running the model: 4/200 examples (2%)")
    assert lines[-1].startswith("calibrating: running the model: 200/200 examples (100%)")
    logs.clear()
    second = tmp_path / "second"
    shutil.copytree(built["export"], second)
    quiet, err = calibrate_json(second, built["root"] / "right.npz", "--batch-size", "4", "--quiet")
    assert not progress_lines(logs) and err == ""
    assert quiet == {**report, "export": str(second)}  # stdout: the same JSON
    assert report["export"] == str(first)


def test_a_model_at_chance_is_warned_about_after_the_first_batches(built, export, logs):
    calibrate_json(export, built["root"] / "chance.npz", "--batch-size", "4")
    said = chance_warnings(logs)
    assert len(said) == 1
    assert said[0].startswith(f"after {CHANCE_AFTER} examples the model is right on ")
    assert "about chance (20%) for 5 classes" in said[0]
    assert "(--labels)" in said[0] and "will guarantee little" in said[0]
    # said when 64 of the 200 examples had run, before the rest of the pass
    order = [r.getMessage() for r in logs.records]
    at = order.index(said[0])
    assert order[at - 1].startswith(f"calibrating: running the model: {CHANCE_AFTER}/200 examples")
    assert any(m.startswith("calibrating: running the model: 200/200") for m in order[at:])


def test_a_model_that_is_right_gets_no_warning(built, export, logs):
    calibrate_json(export, built["root"] / "right.npz", "--batch-size", "4", "--risk", "0.1")
    assert not chance_warnings(logs)


@pytest.mark.parametrize("classes", [2, 5, 1000])
def test_at_chance_is_a_one_sided_three_sigma_test(classes):
    """Right on K of n: at chance while K/n <= 1/C + 3 sqrt(p(1-p)/n), p = 1/C; above it from
    the next example right on."""
    n, p = 64, 1 / classes
    bar = p + 3 * np.sqrt(p * (1 - p) / n)
    last = int(np.floor(bar * n + 1e-9))  # the most right answers still at chance
    rng = np.random.default_rng(classes)
    labels = rng.integers(0, classes, n)
    for right, expected in ((last, True), (last + 1, False)):
        predicted = np.where(np.arange(n) < right, labels, (labels + 1) % classes)
        logits = np.full((n, 2, classes), -5.0, np.float32)
        logits[np.arange(n), :, predicted] = 5.0
        said = at_chance(logits, labels)
        assert (said is not None) == expected, (right, bar * n)
        if said:
            assert said.startswith(f"after 64 examples the model is right on {right} ")
            assert "(--labels)" not in said  # the library's spelling: no flag


def test_the_check_waits_for_its_examples_and_judges_once(caplog):
    labels = np.zeros(10, np.int64)
    wrong = np.zeros((4, 1, 3), np.float32)
    wrong[:, 0, 1] = 5.0
    check = ChanceCheck(labels)  # fewer than CHANCE_AFTER: judged on all 10
    caplog.set_level(logging.WARNING, logger="hydra_deploy")
    check(wrong)
    assert not check.judged
    check(wrong)
    check(wrong[:2])
    assert check.judged and check.warning is not None
    check(wrong)
    assert len(chance_warnings(caplog)) == 1 and "after 10 examples" in check.warning


def test_eval_shows_each_data_set_in_a_log_and_nothing_when_quiet(built, tmp_path, logs):
    root = built["root"]
    argv = [str(built["export"]), "--id", str(root / "right.npz"), "--batch-size", "4"]
    argv += ["--ood", f"noise={root / 'noise.npz'}", "--json"]
    code, out, err = invoke(eval_main, *argv, "--out", str(tmp_path / "a"))
    assert code == 0, err
    lines = progress_lines(logs)
    assert lines[0].startswith("evaluating on the ID data: 4/200 examples (2%)")
    assert any(line.startswith("evaluating on OOD set 'noise': 20/20 examples") for line in lines)
    logs.clear()
    code, quiet, err = invoke(eval_main, *argv, "--out", str(tmp_path / "b"), "--quiet")
    assert code == 0 and err == ""
    assert not progress_lines(logs)
    assert json.loads(quiet) == json.loads(out)


def test_compare_shows_its_steps_in_a_log_and_nothing_when_quiet(built, logs):
    argv = [str(built["export"]), "--batch", "6", "--json"]
    code, out, err = invoke(compare_main, *argv)
    assert code == 0, err
    lines = progress_lines(logs)
    assert any(line.startswith("comparing: PyTorch reference") for line in lines)
    assert lines[-1].startswith("comparing: ") and " 2/2 " in lines[-1]
    logs.clear()
    code, quiet, err = invoke(compare_main, *argv, "--quiet")
    assert code == 0 and err == ""
    assert not progress_lines(logs)
    assert json.loads(quiet) == json.loads(out)
