"""hydra-run and its preprocessing: equal to timm's eval transform; JSON/CSV equal the library."""

from __future__ import annotations

import contextlib
import csv
import io
import json
from importlib import import_module
from pathlib import Path

import numpy as np
import pytest
from helpers.vit import tiny_vit
from PIL import Image
from sklearn.datasets import load_digits, load_sample_image

from hydra_deploy.cli.run import build_parser, main
from hydra_deploy.engines import load_runner
from hydra_deploy.engines.preprocess import preprocess_image, preprocess_images
from hydra_deploy.errors import RunnerError
from hydra_deploy.export import export_onnx
from hydra_deploy.fusion import fuse
from hydra_deploy.specs import HydraSpec
from hydra_deploy.uncertainty import SCALAR_SCORES, ensemble_scores

CLASSES = ["ant", "bee", "cat", "dog", "eel"]


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    backbone = tiny_vit("token")
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=3, heads_per_member=2, seed=1)
    out = tmp_path_factory.mktemp("run") / "export"
    export_onnx(fuse(backbone, spec), out, batch=(1, 2, 4), class_names=CLASSES, validate=False)
    return out


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Real photographs (scikit-learn's samples, cut down) and digits, in every format read."""
    folder = tmp_path_factory.mktemp("images")
    china, flower = load_sample_image("china.jpg"), load_sample_image("flower.jpg")
    Image.fromarray(china[::4, ::4]).save(folder / "china.jpg", quality=95)
    Image.fromarray(flower[100:260:2, 200:420:2]).save(folder / "flower.png")
    (folder / "nested" / "deeper").mkdir(parents=True)
    digits = load_digits().images[:3]
    for i, digit in enumerate(digits):
        pixels = (digit * 255 / 16).astype(np.uint8)
        Image.fromarray(pixels).resize((24, 24), Image.Resampling.NEAREST).save(
            folder / "nested" / f"digit{i}.bmp"
        )  # grayscale, converted to RGB
    rgba = np.dstack([china[:40, :30], np.full((40, 30), 200, np.uint8)])
    Image.fromarray(rgba, "RGBA").save(folder / "nested" / "deeper" / "alpha.webp")
    (folder / "notes.md").write_text("not an image")  # skipped in folders
    return folder


def invoke(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


CONFIGS = [
    dict(
        input_size=(3, 224, 224),
        interpolation="bicubic",
        mean=(0.485, 0.456, 0.406),
        std=(0.229, 0.224, 0.225),
        crop_pct=0.9,
        crop_mode="center",
    ),
    dict(
        input_size=(3, 16, 16),
        interpolation="bilinear",
        mean=(0.5,) * 3,
        std=(0.5,) * 3,
        crop_pct=0.875,
        crop_mode="center",
    ),
    dict(
        input_size=(3, 48, 64),
        interpolation="bicubic",
        mean=(0.5,) * 3,
        std=(0.25,) * 3,
        crop_pct=0.95,
        crop_mode="center",
    ),
    dict(
        input_size=(3, 32, 32),
        interpolation="lanczos",
        mean=(0.4, 0.5, 0.6),
        std=(0.2,) * 3,
        crop_pct=1.0,
        crop_mode="squash",
    ),
    dict(
        input_size=(3, 40, 40),
        interpolation="bilinear",
        mean=(0.485, 0.456, 0.406),
        std=(0.229, 0.224, 0.225),
        crop_pct=0.8,
        crop_mode="border",
    ),
    dict(
        input_size=(1, 20, 20),
        interpolation="nearest",
        mean=(0.5,),
        std=(0.5,),
        crop_pct=0.9,
        crop_mode="center",
    ),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c['crop_mode']}-{c['input_size']}")
def test_preprocessing_equals_timm_eval_transform(config, images):
    from timm.data import create_transform

    transform = create_transform(**config, is_training=False)
    files = sorted(p for p in images.rglob("*") if p.suffix != ".md" and p.is_file())
    assert len(files) == 6
    for path in files:
        mode = "RGB" if config["input_size"][0] == 3 else "L"
        with Image.open(path) as image:
            expected = transform(image.convert(mode)).numpy()
        ours = preprocess_image(path, config)
        assert ours.dtype == np.float32 and ours.shape == expected.shape, path
        # the same Pillow resampling and float32 arithmetic: equal to float32 rounding
        np.testing.assert_allclose(ours, expected, atol=1e-6, rtol=0, err_msg=str(path))


def test_bad_preprocessing_configs_are_refused(images):
    path = next(images.glob("*.jpg"))
    with pytest.raises(RunnerError, match="no preprocessing config"):
        preprocess_image(path, None)
    with pytest.raises(RunnerError, match="interpolation 'cubic' is not supported"):
        preprocess_image(path, dict(CONFIGS[1], interpolation="cubic"))
    with pytest.raises(RunnerError, match="cannot read the image"):
        preprocess_image(images / "notes.md", CONFIGS[1])


def _expected(export_dir, x: np.ndarray) -> dict[str, np.ndarray]:
    runner = load_runner(export_dir)
    return ensemble_scores(runner(x)["member_logits"])


def test_image_folder_to_json(export_dir, images, tmp_path):
    target = tmp_path / "scores.json"
    code, out, err = invoke(str(export_dir), str(images), "--json", str(target), "--top-k", "3")
    assert code == 0, err
    assert "wrote 6 results" in out
    report = json.loads(target.read_text())
    files = sorted(p for p in images.rglob("*") if p.is_file() and p.suffix != ".md")
    assert [r["input"] for r in report["results"]] == [str(p) for p in files]  # sorted, recursive
    assert report["backend"] == "onnxruntime" and report["count"] == 6
    runner = load_runner(export_dir)
    expected = _expected(export_dir, preprocess_images(files, runner.preprocessing))
    for row, result in enumerate(report["results"]):
        assert result["prediction"] == expected["prediction"][row]
        assert result["label"] == CLASSES[result["prediction"]]
        for name in SCALAR_SCORES:
            assert result[name] == pytest.approx(float(expected[name][row]), abs=1e-6), name
        top = [entry["class"] for entry in result["top_k"]]
        assert top[0] == result["prediction"] and len(top) == 3
        probs = [entry["prob"] for entry in result["top_k"]]
        assert probs == sorted(probs, reverse=True)


def test_arrays_to_csv(export_dir, tmp_path):
    rng = np.random.default_rng(0)
    batch = rng.standard_normal((6, 3, 16, 16)).astype(np.float32)
    np.save(tmp_path / "batch.npy", batch)  # 6 > max batch 4: split
    np.savez(tmp_path / "named.npz", pixel_values=batch[:2])
    np.savez(tmp_path / "x.npz", x=batch[2:3])
    np.save(tmp_path / "single.npy", batch[5])  # one example without its batch axis
    target = tmp_path / "out" / "scores.csv"
    code, _, err = invoke(
        str(export_dir),
        str(tmp_path / "batch.npy"),
        str(tmp_path / "named.npz"),
        str(tmp_path / "x.npz"),
        str(tmp_path / "single.npy"),
        "--csv",
        str(target),
        "--batch-size",
        "3",
        "--quiet",
    )
    assert code == 0, err
    rows = list(csv.DictReader(target.open()))
    assert [r["input"] for r in rows[:2]] == [f"{tmp_path / 'batch.npy'}[{i}]" for i in range(2)]
    assert len(rows) == 10
    everything = np.concatenate([batch, batch[:2], batch[2:3], batch[5:6]])
    expected = _expected(export_dir, everything)
    for row, result in enumerate(rows):
        assert int(result["prediction"]) == expected["prediction"][row]
        assert result["label"] == CLASSES[int(result["prediction"])]
        for name in SCALAR_SCORES:
            assert float(result[name]) == pytest.approx(float(expected[name][row]), abs=1e-6)


def test_table_and_stdout_json(export_dir, images):
    code, out, _ = invoke(str(export_dir), str(images / "china.jpg"), str(images / "flower.png"))
    assert code == 0
    header = out.splitlines()[0].split()
    assert header == [
        "input",
        "prediction",
        "msp",
        "predictive_entropy",
        "mutual_information",
        "disagreement",
    ]
    assert any(name in out.splitlines()[2] for name in CLASSES)  # class names, not indices
    code, out, _ = invoke(str(export_dir), str(images / "china.jpg"), "--json", "-")
    assert code == 0 and json.loads(out)["results"][0]["input"].endswith("china.jpg")


def test_existing_outputs_are_refused_without_overwrite(export_dir, images, tmp_path):
    target = tmp_path / "scores.json"
    target.write_text("keep me")
    code, _, err = invoke(str(export_dir), str(images), "--json", str(target))
    assert code == 1 and "exists; pass --overwrite" in err and target.read_text() == "keep me"
    code, _, err = invoke(str(export_dir), str(images), "--json", str(target), "--overwrite")
    assert code == 0, err
    assert json.loads(target.read_text())["count"] == 6
    assert [p.name for p in tmp_path.iterdir()] == ["scores.json"]  # no temporary file left


def test_input_errors_are_one_line(export_dir, images, tmp_path):
    (tmp_path / "lines.txt").write_text("a sentence\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"")
    np.savez(tmp_path / "wrong.npz", y=np.zeros((1, 3, 16, 16), np.float32))
    cases = {
        "lines.txt": "looks like text: text inputs are for text models",
        "empty": "holds no images",
        "weights.bin": "cannot tell what",
        "missing.png": "does not exist",
        "wrong.npz": "name the input array 'x' or 'pixel_values'",
    }
    for name, message in cases.items():
        code, _, err = invoke(str(export_dir), str(tmp_path / name))
        assert code == 1 and message in err and err.count("\n") == 1, (name, err)
    code, _, err = invoke(str(export_dir), str(tmp_path / "wrong.npz"))
    assert "cannot read" not in err  # a readable file with other arrays is not "unreadable"
    code, _, err = invoke(str(export_dir), str(images), "--top-k", "0")
    assert code == 1 and "--top-k must be at least 1" in err
    code, _, err = invoke(str(export_dir), str(images), "--batch-size", "5")
    assert code == 1 and "exceeds the model's maximum batch 4" in err
    code, _, err = invoke(str(export_dir), "--text", "a sentence")
    assert code == 1 and "give image files or folders as INPUT instead" in err, err


def test_nonfinite_inputs_are_refused_unless_allowed(export_dir, tmp_path):
    batch = np.random.default_rng(3).standard_normal((3, 3, 16, 16)).astype(np.float32)
    batch[1, 0, 0, 0] = np.nan
    np.save(tmp_path / "nan.npy", batch)
    code, _, err = invoke(str(export_dir), str(tmp_path / "nan.npy"))
    assert code == 1 and "NaN or infinite" in err and "--allow-nonfinite" in err
    assert err.count("\n") == 1
    target = tmp_path / "scores.json"
    code, _, err = invoke(
        str(export_dir),
        str(tmp_path / "nan.npy"),
        "--allow-nonfinite",
        "--json",
        str(target),
        "--top-k",
        "2",
    )
    assert code == 0, err
    results = json.loads(target.read_text())["results"]
    assert results[1]["prediction"] == -1 and results[1]["label"] is None
    assert all(results[1][name] is None for name in SCALAR_SCORES)
    assert all(entry["prob"] is None for entry in results[1]["top_k"])
    expected = _expected(export_dir, batch[[0, 2]])  # the finite rows score as usual
    for got, row in ((results[0], 0), (results[2], 1)):
        assert got["prediction"] == expected["prediction"][row]
        assert got["msp"] == pytest.approx(float(expected["msp"][row]), abs=1e-6)
    code, out, err = invoke(str(export_dir), str(tmp_path / "nan.npy"), "--allow-nonfinite")
    assert code == 0 and "nan" in out.splitlines()[3], err  # the table prints nan, not a crash


def test_bare_onnx_without_hydra_json_needs_arrays_for_images(export_dir, images, tmp_path):
    (tmp_path / "model.onnx").write_bytes((export_dir / "model.onnx").read_bytes())
    code, _, err = invoke(str(tmp_path / "model.onnx"), str(images / "china.jpg"))
    assert code == 1 and "without its hydra.json" in err


def test_help_has_examples():
    text = build_parser().format_help()
    assert "examples:" in text and "--overwrite" in text and "--top-k" in text


def test_a_closed_pipe_ends_quietly(export_dir, images, monkeypatch, capsys):
    """`hydra-run ... | head -1`: the reader leaves before the table is written; the command
    stops with the shell's SIGPIPE status (141) and no traceback, as `yes | head` does."""
    import os

    read, write = os.pipe()
    os.close(read)  # the reader has gone
    pipe = io.TextIOWrapper(io.FileIO(write, "w"), write_through=False)
    monkeypatch.setattr("sys.stdout", pipe)
    try:
        code = main([str(export_dir), str(images / "china.jpg"), str(images / "flower.png")])
    finally:
        monkeypatch.undo()
        with contextlib.suppress(OSError):
            pipe.close()
    assert code == 141
    assert capsys.readouterr().err == ""


def test_the_runtime_commands_mains_are_their_entry_points(capsys):
    """common.entry_point makes each command's main(argv): the console script pyproject.toml
    names, parsing argv with the command's own parser."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    scripts = tomllib.loads(pyproject)["project"]["scripts"]
    for command in ("run", "calibrate", "compare", "eval", "serve", "score_dataset", "bench"):
        prog = "hydra-" + command.replace("_", "-")
        assert scripts[prog] == f"hydra_deploy.cli.{command}:main"
        main = import_module(f"hydra_deploy.cli.{command}").main
        assert main.__doc__ == f"Entry point of ``{prog}``; returns the exit code."
        with pytest.raises(SystemExit) as done:
            main(["--help"])
        assert done.value.code == 0 and capsys.readouterr().out.startswith(f"usage: {prog} ")
