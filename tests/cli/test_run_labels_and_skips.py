"""hydra-run's output names (``predicted_name``; ``true_class``/``true_name`` from class
sub-folders) and ``--skip-unreadable`` (a truncated JPEG, a text file named ``x.png``)."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging

import numpy as np
import pytest
from helpers.vit import tiny_vit
from PIL import Image

from hydra_deploy.cli.run import main
from hydra_deploy.engines import load_runner
from hydra_deploy.engines.preprocess import UnreadableImageError
from hydra_deploy.engines.sources import score_inputs
from hydra_deploy.errors import RunnerError
from hydra_deploy.export import export_onnx
from hydra_deploy.fusion import fuse
from hydra_deploy.specs import HydraSpec

CLASSES = ["ant", "bee", "cat", "dog", "eel"]


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    backbone = tiny_vit("token")
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=2, heads_per_member=2, seed=1)
    out = tmp_path_factory.mktemp("labels") / "export"
    export_onnx(fuse(backbone, spec), out, batch=(1, 2, 4), class_names=CLASSES, validate=False)
    return out


def _image(path, seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (20, 20, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)


@pytest.fixture
def labelled(tmp_path):
    """images/ant/0.jpg, images/ant/1.jpg, images/cat/0.jpg: class sub-folders, as hydra-eval
    reads them."""
    for seed, name in enumerate(["ant/0.jpg", "ant/1.jpg", "cat/0.jpg"]):
        _image(tmp_path / "images" / name, seed)
    return tmp_path / "images"


def invoke(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def test_class_sub_folders_give_the_true_class(export_dir, labelled, tmp_path):
    code, _, err = invoke(export_dir, labelled, "--json", tmp_path / "s.json", "--quiet")
    assert code == 0, err
    results = json.loads((tmp_path / "s.json").read_text())["results"]
    assert [r["true_name"] for r in results] == ["ant", "ant", "cat"]
    assert [r["true_class"] for r in results] == [0, 0, 2]  # the model's names, not their order
    for r in results:
        assert r["predicted_name"] == CLASSES[r["prediction"]]
        assert r["label"] == r["predicted_name"]  # the old name, kept for one release
    code, _, err = invoke(export_dir, labelled, "--csv", tmp_path / "s.csv", "--quiet")
    rows = list(csv.DictReader((tmp_path / "s.csv").open()))
    assert [(r["true_class"], r["true_name"]) for r in rows] == [("0", "ant")] * 2 + [("2", "cat")]
    code, out, _ = invoke(export_dir, labelled)
    assert out.splitlines()[0].split()[:4] == ["input", "true", "class", "prediction"]
    assert out.splitlines()[2].split()[1] == "ant"


def test_no_true_class_without_class_folders(export_dir, labelled, tmp_path):
    _image(labelled / "loose.png", 9)  # an image beside the class folders: no labelled layout
    code, _, err = invoke(export_dir, labelled, "--json", tmp_path / "s.json", "--quiet")
    assert code == 0, err
    for r in json.loads((tmp_path / "s.json").read_text())["results"]:
        assert "true_class" not in r and "true_name" not in r


def test_sub_folders_that_are_not_the_models_classes(export_dir, tmp_path, caplog):
    _image(tmp_path / "shots" / "monday" / "a.jpg", 1)
    _image(tmp_path / "shots" / "tuesday" / "b.jpg", 2)
    _image(tmp_path / "more.jpg", 3)
    runner = load_runner(export_dir)
    with caplog.at_level(logging.INFO, logger="hydra_deploy"):
        results = score_inputs(runner, [tmp_path / "shots", tmp_path / "more.jpg"])
    assert [r["true_name"] for r in results] == ["monday", "tuesday", None]
    assert [r["true_class"] for r in results] == [None, None, None]
    assert "true_class is null for the images of" in caplog.text and "'monday'" in caplog.text


@pytest.fixture
def with_unreadable(labelled):
    """labelled/ plus a truncated JPEG and a text file named x.png."""
    whole = (labelled / "ant" / "0.jpg").read_bytes()
    (labelled / "cat" / "truncated.jpg").write_bytes(whole[: len(whole) // 2])
    (labelled / "cat" / "x.png").write_text("not an image\n")
    return labelled


def test_an_unreadable_image_stops_the_run_naming_it_and_the_flag(export_dir, with_unreadable):
    code, _, err = invoke(export_dir, with_unreadable)
    assert code == 1 and err.count("\n") == 1
    assert "cannot read the image" in err and "truncated.jpg" in err
    assert "pass --skip-unreadable to skip such files" in err


def test_skip_unreadable_skips_warns_counts_and_lists(
    export_dir, with_unreadable, tmp_path, caplog
):
    target = tmp_path / "s.json"
    with caplog.at_level(logging.INFO, logger="hydra_deploy"):
        code, _, err = invoke(export_dir, with_unreadable, "--skip-unreadable", "--json", target)
    assert code == 0, err
    report = json.loads(target.read_text())
    assert report["count"] == 3 and len(report["results"]) == 3
    assert [s["input"] for s in report["skipped"]] == [
        str(with_unreadable / "cat" / "truncated.jpg"),
        str(with_unreadable / "cat" / "x.png"),
    ]
    assert "cannot identify image file" in report["skipped"][1]["reason"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings[0].startswith(f"skipped {with_unreadable / 'cat' / 'truncated.jpg'}: ")
    assert warnings[1].startswith(f"skipped {with_unreadable / 'cat' / 'x.png'}: ")
    assert warnings[2] == "skipped 2 unreadable files of 5; see the warnings above"
    code, _, _ = invoke(export_dir, with_unreadable, "--json", target, "--overwrite")
    assert code == 1  # without the flag: refused as before


def test_skipping_in_python_and_nothing_readable(export_dir, with_unreadable, tmp_path):
    runner = load_runner(export_dir, decisions=False)
    with pytest.raises(UnreadableImageError, match=r"pass skipped=\[\] to skip such files"):
        score_inputs(runner, [with_unreadable])
    skipped: list[dict[str, str]] = []
    results = score_inputs(runner, [with_unreadable], batch_size=2, skipped=skipped)
    assert [r["true_name"] for r in results] == ["ant", "ant", "cat"]  # rows stay aligned
    assert [s["input"].rsplit("/", 1)[1] for s in skipped] == ["truncated.jpg", "x.png"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "a.png").write_text("text")
    (broken / "b.jpg").write_bytes(b"\xff\xd8\xff")
    with pytest.raises(RunnerError, match="none of the 2 images could be read"):
        score_inputs(runner, [broken], skipped=[])
