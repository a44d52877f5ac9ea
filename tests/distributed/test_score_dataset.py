"""hydra-score-dataset: Ray Data scoring equals the local runner; crash, resume and refusals.

One local Ray cluster (2 CPUs) serves the module; the CLI runs in-process and finds it connected.
The crash test runs the CLI in a subprocess with its own cluster and kills it with SIGKILL.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.ray_local import local_ray
from helpers.vit import tiny_vit
from PIL import Image
from sklearn.datasets import load_digits, load_sample_image

pytest.importorskip(
    "pyarrow", reason="hydra-score-dataset needs pyarrow: pip install 'hydra-deploy[ray]'"
)
pytest.importorskip(
    "ray.data", reason="hydra-score-dataset needs Ray Data: pip install 'hydra-deploy[ray]'"
)

import pyarrow.parquet as pq

from hydra_deploy.cli.score_dataset import main
from hydra_deploy.distributed.ray_score import (
    MANIFEST,
    TEST_DELAY_ENV,
    Manifest,
    unwrap_ray_error,
)
from hydra_deploy.engines import load_runner
from hydra_deploy.engines.preprocess import find_images, preprocess_images
from hydra_deploy.errors import HydraError, RunnerError, ServeError
from hydra_deploy.export import export_onnx
from hydra_deploy.fusion import fuse
from hydra_deploy.specs import HydraSpec
from hydra_deploy.uncertainty import SCALAR_SCORES, ensemble_scores

CLASSES = ["ant", "bee", "cat", "dog", "eel"]
ATOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    """One local cluster for the module: in-process main() calls find Ray connected and keep it."""
    with local_ray():
        yield


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    backbone = tiny_vit("token")
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=3, heads_per_member=2, seed=1)
    out = tmp_path_factory.mktemp("score") / "export"
    export_onnx(fuse(backbone, spec), out, batch=(1, 2, 4), class_names=CLASSES, validate=False)
    return out


@pytest.fixture(scope="module")
def text_export(tmp_path_factory):
    """A tiny BERT export with a 12-word WordLevel tokenizer (helpers.bert.tiny_text_export)."""
    from helpers.bert import tiny_text_export as make

    return make(tmp_path_factory.mktemp("text"))


def make_images(folder: Path, count: int, seed: int = 0) -> Path:
    """``count`` real photographs (random crops of scikit-learn's samples) and digits, nested."""
    rng = np.random.default_rng(seed)
    photos = [load_sample_image("china.jpg"), load_sample_image("flower.jpg")]
    digits = load_digits().images
    (folder / "nested").mkdir(parents=True, exist_ok=True)
    for i in range(count):
        where = folder / "nested" if i % 3 == 0 else folder
        if i % 5 == 4:
            pixels = (digits[i] * 255 / 16).astype(np.uint8)
            Image.fromarray(pixels).resize((24, 24)).save(where / f"digit{i:02d}.bmp")
            continue
        photo = photos[i % 2]
        h, w = rng.integers(24, 160, 2)
        y, x = rng.integers(0, photo.shape[0] - h), rng.integers(0, photo.shape[1] - w)
        suffix = ".jpg" if i % 2 else ".png"
        Image.fromarray(photo[y : y + h, x : x + w]).save(where / f"photo{i:02d}{suffix}")
    (folder / "notes.md").write_text("not an image")  # skipped in folders
    return folder


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return make_images(tmp_path_factory.mktemp("images"), 24)


def invoke(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def local_scores(export_dir: Path, files: list[Path]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """hydra-run's path: one runner, preprocess_images, ensemble_scores."""
    runner = load_runner(export_dir)
    logits = runner(preprocess_images(files, runner.preprocessing))["member_logits"]
    return ensemble_scores(logits), logits


def parts(out: Path) -> list[Path]:
    return sorted(out.glob("part-*.parquet"))


def temp_files(out: Path) -> list[Path]:
    return sorted(p for p in out.iterdir() if p.name.startswith("."))


def part_stats(out: Path) -> dict[str, tuple[int, int, bytes]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes()) for p in parts(out)}


# --- scoring equals the local runner ---------------------------------------------------------------
def test_images_scored_on_two_actors_equal_the_local_runner(export_dir, images, tmp_path):
    out = tmp_path / "scores.parquet"
    code, stdout, err = invoke(
        export_dir,
        images,
        "--out",
        out,
        "--shard-size",
        5,
        "--actors",
        2,
        "--threads",
        1,
        "--batch-size",
        4,
        "--member-logits",
        "--json",
        "--quiet",
    )
    assert code == 0, err
    assert err == ""  # --quiet: no Ray noise
    summary = json.loads(stdout)
    files = find_images([images])
    assert len(files) == 24
    assert summary["items"] == summary["items_scored"] == 24
    assert summary["shards"] == summary["shards_done"] == 5 and summary["shards_skipped"] == 0
    assert summary["actors"] == 2 and summary["threads"] == 1 and summary["batch_size"] == 4
    assert [p.name for p in parts(out)] == [f"part-{i:05d}.parquet" for i in range(5)]
    assert temp_files(out) == []

    table = pq.read_table(out)  # the folder reads as one table, in input order
    assert table.column_names == [
        "item",
        "shard",
        "prediction",
        "predicted_name",
        "label",
        *SCALAR_SCORES,
        "probs",
        "member_logits",
        "unreadable",
    ]
    assert str(table.schema.field("probs").type) == "list<element: float>"
    assert str(table.schema.field("msp").type) == "float"
    assert table["item"].to_pylist() == [str(p) for p in files]  # each once, sorted, recursive
    assert table["shard"].to_pylist() == [i // 5 for i in range(24)]
    expected, logits = local_scores(export_dir, files)
    np.testing.assert_array_equal(table["prediction"].to_numpy(), expected["prediction"])
    assert table["predicted_name"].to_pylist() == [CLASSES[p] for p in expected["prediction"]]
    assert table["label"].to_pylist() == table["predicted_name"].to_pylist()  # the old name
    assert table["unreadable"].to_pylist() == [None] * 24
    for name in SCALAR_SCORES:
        np.testing.assert_allclose(table[name].to_numpy(), expected[name], atol=ATOL, rtol=0)
    np.testing.assert_allclose(
        np.array(table["probs"].to_pylist()), expected["probs"], atol=ATOL, rtol=0
    )
    np.testing.assert_allclose(
        np.array(table["member_logits"].to_pylist()), logits, atol=ATOL, rtol=0
    )
    import pandas as pd

    frame = pd.read_parquet(out)
    assert list(frame["item"]) == [str(p) for p in files]

    manifest = json.loads((out / MANIFEST).read_text())
    info = json.loads((export_dir / "hydra.json").read_text())
    assert manifest["onnx_sha256"] == info["onnx_sha256"]
    assert manifest["items"] == 24 and manifest["shard_size"] == 5 and manifest["batch_size"] == 4
    assert [s["items"] for s in manifest["shards"]] == [5, 5, 5, 5, 4]
    assert manifest["columns"] == table.column_names and manifest["member_logits"] is True
    assert Manifest.from_dict(manifest).to_dict() == manifest  # JSON round trip


def test_text_lines_equal_the_local_runner(text_export, tmp_path):
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("the cat sat\n\na dog ran on the mat\nthe mat\n")  # the empty line is skipped
    second.write_text("dog\ncat cat cat\nthe the\nran\nsat on a mat\n")
    out = tmp_path / "text.parquet"
    code, stdout, err = invoke(
        text_export, first, second, "--out", out, "--shard-size", 3, "--quiet", "--json"
    )
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["items"] == 8 and summary["shards"] == 3  # shards cross file boundaries
    table = pq.read_table(out)
    assert table["item"].to_pylist() == [f"{first}:{i}" for i in (1, 2, 3)] + [
        f"{second}:{i}" for i in (1, 2, 3, 4, 5)
    ]
    assert table["shard"].to_pylist() == [0, 0, 0, 1, 1, 1, 2, 2]
    runner = load_runner(text_export)
    lines = [
        "the cat sat",
        "a dog ran on the mat",
        "the mat",
        "dog",
        "cat cat cat",
        "the the",
        "ran",
        "sat on a mat",
    ]
    expected = ensemble_scores(runner(runner.text_encoder()(lines))["member_logits"])
    np.testing.assert_array_equal(table["prediction"].to_numpy(), expected["prediction"])
    assert table["label"].to_pylist() == [None] * 8  # the export has no class names
    for name in SCALAR_SCORES:
        np.testing.assert_allclose(table[name].to_numpy(), expected[name], atol=ATOL, rtol=0)


# --- crash and resume ------------------------------------------------------------------------------
def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the CLI's process group, then any of its session left (Ray workers make groups
    of their own), each by its pid."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        left = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) == proc.pid:  # field 6 of stat: the session id
                    left.append(int(stat.parent.name))
        if not left:
            return
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


def assert_tables_equal(got, want) -> None:
    assert got.column_names == want.column_names
    for name in ("item", "shard", "prediction", "label"):
        assert got[name].to_pylist() == want[name].to_pylist(), name
    for name in (*SCALAR_SCORES, "probs"):
        np.testing.assert_allclose(
            np.array(got[name].to_pylist()),
            np.array(want[name].to_pylist()),
            atol=1e-6,
            rtol=0,
            err_msg=name,
        )


def test_sigkill_then_resume_keeps_finished_parts_untouched(export_dir, images, tmp_path, caplog):
    out = tmp_path / "crash.parquet"
    argv = [str(export_dir), str(images), "--out", str(out), "--shard-size", "4", "--threads", "1"]
    env = {**os.environ, TEST_DELAY_ENV: "0.5"}  # 2 batches per shard: >= 1 s per shard
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hydra_deploy.cli.score_dataset",
            *argv,
            "--actors",
            "1",
            "--num-cpus",
            "1",
            "--quiet",
        ],
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while not (out / "part-00000.parquet").exists():
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "no part appeared within 120 s"
            time.sleep(0.05)
    finally:
        _kill_session(proc)
    before = part_stats(out)
    assert 1 <= len(before) < 6, sorted(before)  # killed midway: some parts, not all
    (out / ".part-00005.parquet.x1y2z3.tmp").write_bytes(b"half a part")  # a crash mid-write

    code, stdout, err = invoke(*argv, "--resume", "--json", "--quiet")
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["shards_skipped"] == len(before)
    assert summary["shards_done"] == 6 - len(before)
    assert summary["items_scored"] == 24 - 4 * len(before)
    after = part_stats(out)
    assert len(after) == 6 and temp_files(out) == []
    for name, stat in before.items():
        assert after[name] == stat, f"{name} was rewritten"  # same inode, mtime and bytes

    clean = tmp_path / "clean.parquet"
    code, _, err = invoke(*argv[:3], clean, *argv[4:], "--quiet")
    assert code == 0, err
    assert_tables_equal(pq.read_table(out), pq.read_table(clean))

    caplog.clear()
    code, stdout, err = invoke(*argv, "--resume")  # complete: nothing to do, nothing touched
    assert code == 0, err
    assert "nothing to do: all 6 shard(s)" in caplog.text
    assert part_stats(out) == after


def test_undecodable_image_stops_the_run_and_keeps_finished_parts(
    export_dir, tmp_path, monkeypatch
):
    folder = make_images(tmp_path / "images", 11, seed=3)
    broken = folder / "zz_broken.jpg"  # sorted last: shard 2 of 3
    broken.write_bytes(b"\xff\xd8 this is not a JPEG")
    out = tmp_path / "scores.parquet"
    monkeypatch.setenv(TEST_DELAY_ENV, "0.3")
    code, stdout, err = invoke(
        export_dir,
        folder,
        "--out",
        out,
        "--shard-size",
        4,
        "--actors",
        1,
        "--threads",
        1,
        "--quiet",
    )
    assert code == 1 and stdout == ""
    assert err.startswith("error: cannot read the image") and str(broken) in err
    assert "--resume" in err and "Traceback" not in err and err.count("\n") == 1
    finished = parts(out)
    assert 1 <= len(finished) <= 2 and not (out / "part-00002.parquet").exists()
    assert temp_files(out) == []
    files = find_images([folder])
    expected, _ = local_scores(export_dir, files[:8])
    for path in finished:  # complete and right
        table = pq.read_table(path)
        shard = int(path.stem.split("-")[1])
        assert table["item"].to_pylist() == [str(p) for p in files[4 * shard : 4 * shard + 4]]
        np.testing.assert_allclose(
            table["msp"].to_numpy(), expected["msp"][4 * shard : 4 * shard + 4], atol=ATOL
        )

    before = part_stats(out)
    Image.fromarray(load_sample_image("china.jpg")[:50, :60]).save(
        broken, format="JPEG"
    )  # repaired
    monkeypatch.delenv(TEST_DELAY_ENV)
    code, _, err = invoke(
        export_dir, folder, "--out", out, "--shard-size", 4, "--resume", "--quiet"
    )
    assert code == 0, err
    assert len(parts(out)) == 3 and pq.read_table(out).num_rows == 12
    assert {k: v for k, v in part_stats(out).items() if k in before} == before


# --- refusals ---------------------------------------------------------------------------------------
def test_existing_out_and_mismatched_resume_are_refused(export_dir, images, tmp_path):
    out = tmp_path / "scores.parquet"
    base = [export_dir, images, "--out", out, "--shard-size", 8, "--quiet"]
    assert invoke(*base)[0] == 0
    before = part_stats(out)
    assert len(before) == 3

    code, _, err = invoke(*base)
    assert code == 1 and "exists" in err and "--resume" in err and "--overwrite" in err

    other_model = tmp_path / "other-export"
    shutil.copytree(export_dir, other_model)
    with open(other_model / "model.onnx", "ab") as handle:
        handle.write(b"\0")  # another file: another sha256
    code, _, err = invoke(other_model, *base[1:], "--resume")
    assert code == 1 and "the model differs" in err and "--overwrite" in err

    fewer = tmp_path / "fewer"
    shutil.copytree(images, fewer)
    next(fewer.rglob("*.png")).unlink()
    code, _, err = invoke(export_dir, fewer, *base[2:], "--resume")
    assert code == 1 and "the inputs differ (24 items in OUT, 23 now" in err
    assert "the first difference is in shard part-00000.parquet" in err
    code, _, err = invoke(*base[:5], 4, "--member-logits", "--resume", "--quiet")
    assert code == 1 and "the shard size differs (8 in OUT, 4 now)" in err
    assert "without --member-logits in OUT, with now" in err
    assert part_stats(out) == before  # no refusal touched OUT

    (out / "README.txt").write_text("mine")
    code, _, err = invoke(*base, "--overwrite")
    assert code == 1 and "did not write (README.txt)" in err
    (out / "README.txt").unlink()

    code, _, err = invoke(*base[:5], 12, "--overwrite", "--quiet")  # starts over, 2 parts
    assert code == 0, err
    assert [p.name for p in parts(out)] == ["part-00000.parquet", "part-00001.parquet"]
    assert json.loads((out / MANIFEST).read_text())["shard_size"] == 12


# --- an export with decisions (hydra-calibrate) ------------------------------------------------------
def test_decision_columns_equal_the_local_decisions_and_raw_leaves_them_out(images, tmp_path):
    from helpers.decisions import calibrated_export

    from hydra_deploy.decisions import apply_decisions

    export, _ = calibrated_export(tmp_path / "calibrated")
    out = tmp_path / "scores.parquet"
    base = [export, images, "--shard-size", 12, "--batch-size", 4, "--quiet"]
    code, stdout, err = invoke(*base, "--out", out, "--json")
    assert code == 0, err
    assert json.loads(stdout)["decisions"] == ["confidence", "prediction_set", "accept", "ood_flag"]
    table = pq.read_table(out)
    assert table.column_names[-6:] == [
        "probs",
        "confidence",
        "prediction_set",
        "accept",
        "ood_flag",
        "unreadable",
    ]
    assert str(table.schema.field("prediction_set").type) == "list<element: int64>"
    assert str(table.schema.field("accept").type) == "bool"
    runner = load_runner(export)
    logits = runner(preprocess_images(find_images([images]), runner.preprocessing))["member_logits"]
    want = apply_decisions(logits, runner.decisions)
    np.testing.assert_array_equal(table["prediction"].to_numpy(), want["prediction"])
    np.testing.assert_allclose(table["confidence"].to_numpy(), want["confidence"], atol=ATOL)
    assert table["prediction_set"].to_pylist() == [
        np.flatnonzero(row).tolist() for row in want["prediction_set"]
    ]
    for name in ("accept", "ood_flag"):
        assert table[name].to_pylist() == want[name].tolist(), name
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["columns"] == table.column_names and manifest["decisions_sha256"]

    raw = tmp_path / "raw.parquet"
    assert invoke(*base, "--out", raw, "--raw")[0] == 0
    table = pq.read_table(raw)
    assert table.column_names[-2] == "probs" and "confidence" not in table.column_names
    expected, _ = local_scores(export, find_images([images]))
    np.testing.assert_array_equal(table["prediction"].to_numpy(), expected["prediction"])
    assert json.loads((raw / MANIFEST).read_text())["decisions_sha256"] is None
    code, _, err = invoke(*base, "--out", raw, "--resume")
    assert code == 1 and "the decisions differ (raw scores in OUT, decisions now" in err

    stale = tmp_path / "stale"
    shutil.copytree(export, stale)
    info = json.loads((stale / "hydra.json").read_text())
    info["decisions"]["onnx_sha256"] = "0" * 64  # fitted on another model.onnx
    (stale / "hydra.json").write_text(json.dumps(info))
    code, _, err = invoke(stale, *base[1:], "--out", tmp_path / "never")
    assert code == 1 and "hydra-calibrate" in err and "--overwrite" in err
    assert not (tmp_path / "never").exists()  # refused before anything ran


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--actors", "0"], "--actors must be an integer of at least 1, got 0"),
        (["--batch-size", "0"], "--batch-size must be at least 1"),
        (["--shard-size", "0"], "--shard-size must be an integer of at least 1"),
        (["--batch-size", "5"], "--batch-size 5 exceeds the export's maximum batch 4"),
        (["--address", "127.0.0.1:1"], "cannot connect to the Ray cluster at 127.0.0.1:1"),
        (
            ["--address", "ray://127.0.0.1:1"],
            "cannot connect to the Ray cluster at ray://127.0.0.1:1",
        ),
        (["--address", "http://head:8265"], "is not 'auto', HOST:PORT"),
        (["--address", "auto", "--num-cpus", "2"], "--num-cpus sizes a local cluster"),
        (["--resume", "--overwrite"], None),  # argparse: exclusive, exit 2
    ],
    ids=lambda v: v[0] if isinstance(v, list) else "",
)
def test_bad_arguments_are_one_line_errors(export_dir, images, tmp_path, extra, message):
    out = tmp_path / "scores.parquet"
    if message is None:
        with pytest.raises(SystemExit) as exit_info, contextlib.redirect_stderr(io.StringIO()):
            main([str(export_dir), str(images), "--out", str(out), *extra])
        assert exit_info.value.code == 2
        return
    code, stdout, err = invoke(export_dir, images, "--out", out, *extra, "--quiet")
    assert code == 1 and stdout == ""
    assert message in err and err.startswith("error: ") and err.count("\n") == 1, err
    assert not out.exists()  # refused before anything was written


def test_bad_inputs_are_refused(export_dir, text_export, images, tmp_path):
    out = tmp_path / "scores.parquet"
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "x.npy").write_bytes(b"")
    (tmp_path / "t.txt").write_text("the cat\n")
    cases = [
        ((tmp_path / "nope", images), "the export folder"),
        ((tmp_path, images), "is not an export folder: model.onnx is missing"),
        ((export_dir, tmp_path / "missing.jpg"), "does not exist"),
        ((export_dir, empty), "holds no images"),
        ((export_dir, tmp_path / "x.npy"), "score preprocessed .npy/.npz arrays with hydra-run"),
        ((export_dir, tmp_path / "t.txt"), "looks like text"),
        ((text_export, images), "images need a vision model"),
    ]
    for (model, source), message in cases:
        code, _, err = invoke(model, source, "--out", out, "--quiet")
        assert code == 1 and message in err and err.count("\n") == 1, (source, err)
    assert not out.exists()


def test_ray_missing_names_the_extra(export_dir, images, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    code, _, err = invoke(export_dir, images, "--out", tmp_path / "o", "--quiet")
    assert code == 1 and "pip install 'hydra-deploy[ray]'" in err


def test_errors_from_actors_are_unwrapped():
    class Wrapper(
        Exception
    ):  # Ray's RayTaskError(UserCodeException) keeps the UDF's error as .cause
        def __init__(self, cause):
            super().__init__("ray::MapWorker(...).submit() traceback ...")
            self.cause = cause

    inner = RunnerError(
        "cannot read the image 'a.jpg': truncated\nFailed to apply UDF transform after 1/1 attempts"
    )
    found = unwrap_ray_error(Wrapper(inner))
    assert type(found) is RunnerError and str(found) == "cannot read the image 'a.jpg': truncated"
    lost = Exception(
        "Traceback ...\nhydra_deploy.errors.RunnerError: cannot read the image 'b.jpg': x\n"
    )
    found = unwrap_ray_error(lost)  # a Ray that lost the cause still printed its traceback
    assert type(found) is RunnerError and str(found) == "cannot read the image 'b.jpg': x"
    found = unwrap_ray_error(Wrapper(MemoryError("out of memory")))
    assert isinstance(found, ServeError) and isinstance(found, HydraError)
    assert "MemoryError: out of memory" in str(found)


def test_skip_unreadable_gives_null_scores_and_the_reason(export_dir, tmp_path, caplog):
    folder = make_images(tmp_path / "images", 5, seed=4)
    files = find_images([folder])
    whole = files[0].read_bytes()
    (folder / "truncated.jpg").write_bytes(whole[: len(whole) // 2])
    (folder / "x.png").write_text("not an image\n")
    out = tmp_path / "scores.parquet"
    base = [export_dir, folder, "--out", out, "--shard-size", 4, "--actors", 1, "--threads", 1]
    code, _, err = invoke(*base, "--quiet")
    assert code == 1 and "cannot read the image" in err and "--skip-unreadable" in err
    with caplog.at_level(logging.INFO, logger="hydra_deploy"):
        code, stdout, err = invoke(*base, "--resume", "--skip-unreadable", "--json")
    assert code == 0, err
    summary = json.loads(stdout)
    unreadable = [str(folder / "truncated.jpg"), str(folder / "x.png")]
    assert [s["input"] for s in summary["skipped"]] == unreadable
    assert "cannot identify image file" in summary["skipped"][1]["reason"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [w.split(":")[0] for w in warnings[:2]] == [f"skipped {p}" for p in unreadable]
    assert warnings[-1] == "skipped 2 unreadable files of 7; see the warnings above"
    table = pq.read_table(out)
    items = table["item"].to_pylist()
    assert items == sorted(str(p) for p in find_images([folder]))
    expected, _ = local_scores(export_dir, files)
    read = [items.index(str(p)) for p in files]
    np.testing.assert_allclose(
        table["msp"].to_numpy(zero_copy_only=False)[read], expected["msp"], atol=ATOL
    )
    for path in unreadable:
        row = items.index(path)
        assert table["unreadable"][row].as_py()
        for name in ("prediction", "predicted_name", "msp", "probs"):
            assert table[name][row].as_py() is None, name
    assert sum(r is None for r in table["unreadable"].to_pylist()) == len(files)
