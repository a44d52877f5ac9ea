"""hydra-calibrate and its library: the record written through the export's own runner, applied by
hydra-run as numpy applies it, refused when stale, atomic, one-line errors."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import shutil
from dataclasses import replace

import numpy as np
import pytest
from helpers.vit import tiny_vit

from hydra_deploy.cli.calibrate import build_parser
from hydra_deploy.cli.calibrate import main as calibrate_main
from hydra_deploy.cli.run import main as run_main
from hydra_deploy.decisions import apply_decisions, fit_decisions
from hydra_deploy.engines import load_runner
from hydra_deploy.errors import RunnerError
from hydra_deploy.evaluation.calibrate import calibrate, data_sha256, store_decisions
from hydra_deploy.evaluation.evaluate import load_eval_data
from hydra_deploy.export import export_onnx
from hydra_deploy.export_folder import file_sha256, read_info
from hydra_deploy.fusion import fuse
from hydra_deploy.specs import HydraSpec
from hydra_deploy.uncertainty import ensemble_scores

CLASSES = ["ant", "bee", "cat", "dog", "eel"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny ViT export and labelled data it mostly gets right (85% of labels its own
    predictions), plus unlabelled noise."""
    backbone = tiny_vit("token")
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=3, heads_per_member=2, seed=1)
    root = tmp_path_factory.mktemp("calibrate")
    export = root / "export"
    export_onnx(fuse(backbone, spec), export, batch=(1, 2, 4), class_names=CLASSES, validate=False)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(500, 3, 16, 16)).astype(np.float32)
    with load_runner(export) as runner:
        logits = runner(x)["member_logits"]
    y = np.where(
        rng.random(500) < 0.85, ensemble_scores(logits)["prediction"], rng.integers(0, 5, 500)
    )
    np.savez(root / "calib.npz", x=x, y=y)
    np.savez(root / "noise.npz", x=(3 * rng.normal(size=(40, 3, 16, 16))).astype(np.float32))
    return {"root": root, "export": export, "x": x, "y": y, "logits": logits}


@pytest.fixture()
def export(built, tmp_path):
    """A fresh copy of the export for a test that writes into it."""
    copy = tmp_path / "export"
    shutil.copytree(built["export"], copy)
    return copy


def invoke(main, *argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_calibrate_fits_what_fit_decisions_fits_on_the_runners_logits(built):
    with load_runner(built["export"], decisions=False) as runner:
        calibration = calibrate(runner, (built["x"], built["y"]), risk=0.3, sets="aps")
    data = load_eval_data((built["x"], built["y"]), None, name="--data", labelled=True)
    expected = fit_decisions(
        built["logits"],
        built["y"],
        onnx_sha256=file_sha256(built["export"] / "model.onnx"),
        data_sha256=data_sha256(data),
        risk=0.3,
        sets="aps",
        class_names=CLASSES,
    )
    assert calibration.record == replace(expected, backend="onnxruntime", precision="fp32")
    assert calibration.parts["quantile"]["count"] + calibration.parts["temperature"]["count"] == 500
    assert calibration.parts["quantile"]["coverage"] >= 0.9


def test_temperature_uses_the_given_t_instead_of_fitting_one(built, export):
    """--temperature 1 keeps the model's own probabilities: the record holds T = 1 and every
    threshold fitted on them, as fit_decisions(temperature=1) fits them; a T outside the search
    range is refused with the flag's name."""
    data = str(built["root"] / "calib.npz")
    code, out, err = invoke(
        calibrate_main, str(export), "--data", data, "--temperature", "1", "--risk", "0.3", "--json"
    )
    assert code == 0, err
    record = read_info(export).decisions
    loaded = load_eval_data(data, None, name="--data", labelled=True)
    expected = fit_decisions(
        built["logits"],
        built["y"],
        onnx_sha256=file_sha256(built["export"] / "model.onnx"),
        data_sha256=data_sha256(loaded),
        risk=0.3,
        class_names=CLASSES,
        temperature=1.0,
    )
    assert record.temperature == 1.0 and json.loads(out)["decisions"]["temperature"] == 1.0
    assert record == replace(expected, backend="onnxruntime", precision="fp32")
    fitted = fit_decisions(
        built["logits"], built["y"], onnx_sha256="0" * 64, data_sha256="0" * 64, risk=0.3
    )
    assert fitted.temperature != 1.0  # the data would have fitted another T
    code, _, err = invoke(
        calibrate_main, str(export), "--data", data, "--temperature", "0", "--overwrite"
    )
    assert code == 1 and err == "error: --temperature must be a number in [0.05, 20], got 0.0\n"


def test_decisions_are_fitted_on_an_int8_folder_s_own_logits(built, tmp_path):
    """INT8 moves the logits, so the decisions of an INT8 export are fitted on its own: the
    record names the INT8 file and equals fit_decisions on the INT8 runner's logits."""
    from helpers.int8 import quantized_folder

    folder = quantized_folder(built["export"], tmp_path / "int8", "static")
    code, _, err = invoke(
        calibrate_main, str(folder), "--data", str(built["root"] / "calib.npz"), "--risk", "0.3"
    )
    assert code == 0, err
    with load_runner(folder, decisions=False) as runner:
        logits = runner(built["x"])["member_logits"]
    assert np.abs(logits - built["logits"]).max() > 0  # INT8 moved them
    record = read_info(folder).decisions
    data = load_eval_data(str(built["root"] / "calib.npz"), None, name="--data", labelled=True)
    expected = fit_decisions(
        logits,
        built["y"],
        onnx_sha256=file_sha256(folder / "model.onnx"),
        data_sha256=data_sha256(data),
        risk=0.3,
        class_names=CLASSES,
    )
    assert record.to_dict() == replace(expected, backend="onnxruntime", precision="int8").to_dict()


def test_command_writes_the_record_and_hydra_run_applies_it(built, export):
    code, out, err = invoke(
        calibrate_main,
        str(export),
        "--data",
        str(built["root"] / "calib.npz"),
        "--risk",
        "0.3",
        "--ood-check",
        f"noise={built['root'] / 'noise.npz'}",
    )
    assert code == 0, err
    assert "temperature part" in out and "OOD set noise:" in out and "wrote the decisions" in out
    record = read_info(export).decisions
    assert f"fitted on {record.n_temperature + record.n_quantile} calibration examples (" in out
    assert record is not None and record.selective is not None and record.ood is not None
    code, out, err = invoke(run_main, str(export), str(built["root"] / "calib.npz"), "--json", "-")
    assert code == 0, err
    results = json.loads(out)["results"]
    expected = apply_decisions(built["logits"], record)
    for i, result in enumerate(results):
        assert result["confidence"] == pytest.approx(float(expected["confidence"][i]), rel=1e-5)
        members = np.flatnonzero(expected["prediction_set"][i])
        assert result["prediction_set"] == [CLASSES[c] for c in members]
        assert result["accept"] == bool(expected["accept"][i])
        assert result["ood_flag"] == bool(expected["ood_flag"][i])
        assert result["prediction"] == int(expected["prediction"][i])
    code, out, _ = invoke(run_main, str(export), str(built["root"] / "noise.npz"))
    assert code == 0 and "prediction set" in out and ("answer" in out or "abstain" in out)
    code, out, _ = invoke(
        run_main, str(export), str(built["root"] / "noise.npz"), "--raw", "--json", "-"
    )
    assert code == 0 and "confidence" not in json.loads(out)["results"][0]
    code, out, _ = invoke(run_main, str(export), str(built["root"] / "noise.npz"), "--csv", "-")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert list(rows[0])[-4:] == ["confidence", "prediction_set", "accept", "ood_flag"]
    noise = np.load(built["root"] / "noise.npz")["x"]
    with load_runner(export) as runner:
        sets = apply_decisions(runner(noise)["member_logits"], record)["prediction_set"]
    for row, members in zip(rows, sets, strict=True):
        assert row["prediction_set"] == "|".join(CLASSES[c] for c in np.flatnonzero(members))


def test_json_output_and_existing_decisions_need_overwrite(built, export):
    data = str(built["root"] / "calib.npz")
    code, out, err = invoke(calibrate_main, str(export), "--data", data, "--json", "--sets", "raps")
    assert code == 0, err
    report = json.loads(out)
    assert report["decisions"]["sets"]["method"] == "raps"
    assert set(report["parts"]) == {"temperature", "quantile"}
    code, _, err = invoke(calibrate_main, str(export), "--data", data)
    assert code == 1 and "already holds decisions; pass --overwrite" in err
    code, _, err = invoke(
        calibrate_main, str(export), "--data", data, "--overwrite", "--sets", "none", "--quiet"
    )
    assert code == 0, err
    assert read_info(export).decisions.sets is None


def test_a_stale_record_is_refused_by_the_runner_with_the_refit_command(built, export):
    assert invoke(calibrate_main, str(export), "--data", str(built["root"] / "calib.npz"))[0] == 0
    backbone = tiny_vit("token", seed=1)  # another model in the same folder, the old record kept
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=3, heads_per_member=2, seed=2)
    record = json.loads((export / "hydra.json").read_text())["decisions"]
    export_onnx(fuse(backbone, spec), export, batch=(1, 2, 4), validate=False, overwrite=True)
    info = json.loads((export / "hydra.json").read_text())
    (export / "hydra.json").write_text(json.dumps({**info, "decisions": record}))
    with pytest.raises(
        RunnerError, match=r"fitted on another model.onnx .* hydra-calibrate .* --overwrite"
    ):
        load_runner(export)
    with load_runner(export, decisions=False) as runner:  # raw scores still run
        assert runner.decisions is None
    code, _, err = invoke(run_main, str(export), str(built["root"] / "noise.npz"))
    assert code == 1 and "hydra-calibrate" in err and "\n" not in err.strip()
    assert invoke(run_main, str(export), str(built["root"] / "noise.npz"), "--raw")[0] == 0


@pytest.mark.parametrize("when", ["json", "onnx", "switch"])
def test_an_interrupted_calibration_leaves_the_folder_as_it_was(built, export, monkeypatch, when):
    with load_runner(export, decisions=False) as runner:
        record = calibrate(runner, (built["x"], built["y"])).record
    before = {p.name: p.read_bytes() for p in export.iterdir() if p.is_file()}

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    if when == "json":
        import hydra_deploy.evaluation.calibrate as module

        monkeypatch.setattr(module, "write_decisions", interrupted)
        with pytest.raises(KeyboardInterrupt):
            store_decisions(export, record)
    elif when == "switch":  # hydra.json announced the new pair; the rename of model.onnx fails
        import hydra_deploy.export_folder as module

        pytest.importorskip(
            "hydra_deploy.export.decision_graph", reason="the in-graph decisions module"
        )
        monkeypatch.setattr(module, "_replace_model", interrupted)
        with pytest.raises(KeyboardInterrupt):
            store_decisions(export, record, in_graph=True)
    else:
        import onnx

        def interrupted(model, path, *args, **kwargs):
            with open(path, "wb") as handle:
                handle.write(b"half")
            raise KeyboardInterrupt

        monkeypatch.setattr(onnx, "save", interrupted)
        pytest.importorskip(
            "hydra_deploy.export.decision_graph", reason="the in-graph decisions module"
        )
        with pytest.raises(KeyboardInterrupt):
            store_decisions(export, record, in_graph=True)
    after = {p.name: p.read_bytes() for p in export.iterdir() if p.is_file()}
    assert after == before
    assert not [p for p in os.listdir(export) if p.startswith(".")]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--alpha", "1.5"], "--alpha must be in (0, 1)"),
        (["--risk", "0"], "--risk must be in (0, 1)"),
        (["--risk", "0.1", "--delta", "2"], "--delta must be in (0, 1)"),
        (["--holdout", "1"], "--holdout must be in (0, 1)"),
        (["--alpha", "0.0001"], "--alpha 0.0001 needs at least 9999 for the thresholds"),
        (["--risk", "0.001"], "the best these data can guarantee is"),
        (["--class-conditional", "--alpha", "0.01"], "too few for class-conditional sets: class"),
        (["--class-conditional", "--sets", "none"], "--class-conditional needs prediction sets"),
        (["--batch-size", "0"], "--batch-size must be at least 1"),
        (["--seed", "-1"], "--seed must be at least 0, got -1"),
        (["--engine", "m.engine", "--in-graph"], "--in-graph rewrites model.onnx, so no engine"),
    ],
)
def test_errors_are_one_line(built, export, argv, message):
    code, _, err = invoke(
        calibrate_main, str(export), "--data", str(built["root"] / "calib.npz"), *argv
    )
    assert code == 1
    assert message in err
    assert err.count("\n") == 1
    assert read_info(export).decisions is None  # nothing written


def test_data_errors_are_one_line(built, export, tmp_path):
    root = built["root"]
    code, _, err = invoke(calibrate_main, str(export), "--data", str(root / "noise.npz"))
    assert code == 1 and "has no labels 'y'" in err
    np.savez(tmp_path / "bad.npz", x=built["x"][:20], y=np.full(20, 7))
    code, _, err = invoke(calibrate_main, str(export), "--data", str(tmp_path / "bad.npz"))
    assert code == 1 and "outside the model's classes 0..4" in err
    code, _, err = invoke(
        calibrate_main, str(export / "model.onnx"), "--data", str(root / "calib.npz")
    )
    assert code == 1 and "is not an export folder" in err


def test_help_says_it_is_not_int8_calibration():
    text = build_parser().format_help()
    assert "not TensorRT's INT8 calibration" in text and "examples:" in text


def test_in_graph_decisions_survive_reload_and_an_fp32_re_export_but_not_fp16(
    built, export, tmp_path, caplog
):
    from hydra_deploy.cli.export import main as export_main
    from hydra_deploy.export import load_export

    data = str(built["root"] / "calib.npz")
    assert (
        invoke(calibrate_main, str(export), "--data", data, "--risk", "0.3", "--in-graph")[0] == 0
    )
    info = read_info(export)
    assert info.decisions.in_graph and info.onnx_sha256 == file_sha256(export / "model.onnx")
    names = [o["name"] for o in info.record["outputs"]]
    assert names == ["member_logits", "calibrated_probs", "prediction_set", "accept", "ood_flag"]
    with load_runner(export) as runner:
        graph = runner(built["x"][:8])
    numpy = apply_decisions(graph["member_logits"], info.decisions)
    for name in ("prediction_set", "accept", "ood_flag"):
        np.testing.assert_array_equal(graph[name], numpy[name])
    load_export(export)  # checked against the file without its decision outputs

    kept, dropped = tmp_path / "kept", tmp_path / "fp16"
    assert invoke(export_main, "--from", str(export), "--out", str(kept), "--quiet")[0] == 0
    again = read_info(kept)
    assert again.class_names == tuple(CLASSES)  # a re-export keeps the class names
    assert again.decisions is not None and again.decisions.in_graph
    assert again.decisions.onnx_sha256 == file_sha256(kept / "model.onnx")
    assert again.decisions.temperature == info.decisions.temperature
    with load_runner(kept) as runner:
        assert runner.decisions == again.decisions
    code, _, err = invoke(
        export_main, "--from", str(export), "--out", str(dropped), "--precision", "fp16"
    )
    assert code == 0, err
    assert read_info(dropped).decisions is None
    warned = [r.getMessage() for r in caplog.records if "are not kept" in r.getMessage()]
    assert warned and "hydra-calibrate" in warned[0]


def test_a_bert_export_is_calibrated_from_a_tsv(tmp_path):
    from helpers.bert import tiny_text_export

    export = tiny_text_export(tmp_path)
    words = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran"]
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(words, rng.integers(2, 7))) for _ in range(240)]
    (tmp_path / "texts.txt").write_text("\n".join(texts) + "\n")
    code, out, err = invoke(run_main, str(export), str(tmp_path / "texts.txt"), "--json", "-")
    assert code == 0, err
    predicted = [r["prediction"] for r in json.loads(out)["results"]]
    labels = [p if rng.random() < 0.9 else int(rng.integers(0, 5)) for p in predicted]
    tsv = tmp_path / "calib.tsv"
    tsv.write_text("".join(f"{y}\t{t}\n" for y, t in zip(labels, texts, strict=True)))
    code, _, err = invoke(
        calibrate_main, str(export), "--data", str(tsv), "--alpha", "0.2", "--quiet"
    )
    assert code == 0, err
    record = read_info(export).decisions
    assert record is not None and record.num_classes == 5
    code, out, err = invoke(run_main, str(export), "--text", "the cat sat", "--json", "-")
    assert code == 0, err
    result = json.loads(out)["results"][0]
    assert {"confidence", "prediction_set", "ood_flag"} <= set(result)


#: Stores decisions in the graph (hydra-calibrate --in-graph) and is killed (SIGKILL: no cleanup)
#: on one side of the rename that switches model.onnx.
KILLED_WRITER = """
import json, os, signal, sys
from pathlib import Path

import hydra_deploy.export_folder as export_folder
from hydra_deploy.evaluation.calibrate import store_decisions

export, record, when = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
switch = export_folder._replace_model

def killed(staged, target):
    if when == "after":
        switch(staged, target)
    os.kill(os.getpid(), signal.SIGKILL)

export_folder._replace_model = killed
record = export_folder.DecisionRecord.from_dict(json.loads(record.read_text()))
store_decisions(export, record, in_graph=True)
"""


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_writer_killed_between_the_two_files_leaves_the_old_pair_or_the_new(
    built, export, tmp_path, when
):
    """hydra-calibrate --in-graph replaces model.onnx and hydra.json; a writer killed (SIGKILL)
    before or after the rename of model.onnx leaves a folder whose hydra.json describes its
    model.onnx: the old pair before, the new pair after, both runnable with their decisions."""
    pytest.importorskip("hydra_deploy.export.decision_graph", reason="the in-graph decisions")
    import signal
    import subprocess
    import sys

    with load_runner(export, decisions=False) as runner:
        record = calibrate(runner, (built["x"], built["y"]), risk=0.3).record
    old = store_decisions(export, record)  # the old pair: the decisions in hydra.json only
    old_model = (export / "model.onnx").read_bytes()
    (tmp_path / "record.json").write_text(json.dumps(record.to_dict()))
    done = subprocess.run(
        [sys.executable, "-c", KILLED_WRITER, str(export), str(tmp_path / "record.json"), when],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert "replacing" in json.loads((export / "hydra.json").read_text())  # killed mid-switch
    info = read_info(export)
    sha = file_sha256(export / "model.onnx")
    assert info.onnx_sha256 == sha == info.decisions.onnx_sha256  # one pair
    if when == "before":
        assert (export / "model.onnx").read_bytes() == old_model
        assert info.record == old.record and not info.decisions.in_graph
    else:
        assert sha != old.onnx_sha256 and info.decisions.in_graph
        assert [o["name"] for o in info.record["outputs"]][1:3] == [
            "calibrated_probs",
            "prediction_set",
        ]
        assert replace(info.decisions, onnx_sha256=record.onnx_sha256, in_graph=False) == record
    with load_runner(export) as runner:  # the runner accepts the pair, decisions applied
        assert runner.decisions == info.decisions
        assert ("calibrated_probs" in runner.output_names) == (when == "after")
    # the next write settles the folder
    store_decisions(export, replace(info.decisions, in_graph=False))
    assert "replacing" not in json.loads((export / "hydra.json").read_text())
    assert read_info(export).onnx_sha256 == file_sha256(export / "model.onnx")


def test_the_record_names_the_numbers_it_was_fitted_on(built, export):
    """An ONNX Runtime fit names ONNX Runtime and the graph's precision; decisions fitted on a
    TensorRT engine's outputs do not go into model.onnx (no engine built from the new file is
    the one they were fitted on)."""
    with load_runner(export, decisions=False) as runner:
        record = calibrate(runner, (built["x"], built["y"])).record
    assert (record.backend, record.precision, record.engine_sha256) == ("onnxruntime", "fp32", None)
    engine_fit = replace(record, backend="tensorrt", precision="fp16", engine_sha256="e" * 64)
    with pytest.raises(RunnerError, match="fitted on a TensorRT engine's outputs cannot go into"):
        store_decisions(export, engine_fit, in_graph=True)
    assert read_info(export).decisions is None
    stored = store_decisions(export, engine_fit).decisions  # in hydra.json: as fitted
    assert stored == engine_fit
    with pytest.raises(RunnerError, match=r"hydra-calibrate \S+ --data LABELLED --overwrite"):
        load_runner(export)  # ONNX Runtime refuses an engine's record


def test_what_is_dropped_is_said(tmp_path, caplog):
    """hydra-export --overwrite onto a calibrated folder says its decisions go, with the line
    that fits them again; hydra-run on an export without decisions says once it prints scores
    only (and --raw, which asks for that, says nothing)."""
    import logging

    from helpers.decisions import calibrated_export, images, tiny_export

    from hydra_deploy.cli.export import main as export_main

    plain = tiny_export(tmp_path / "plain")
    calibrated, _ = calibrated_export(tmp_path / "calibrated", risk=None)
    caplog.set_level(logging.INFO, logger="hydra_deploy")
    code, _, err = invoke(
        export_main, "--from", str(plain), "--out", str(calibrated), "--overwrite"
    )
    assert code == 0, err
    assert read_info(calibrated).decisions is None
    said = [r.getMessage() for r in caplog.records if "are removed with it" in r.getMessage()]
    assert len(said) == 1 and f"hydra-calibrate {calibrated} --data LABELLED" in said[0]

    np.savez(tmp_path / "x.npz", x=images(3, seed=2))
    for flags, expected in (((), 1), (("--raw",), 0)):
        caplog.clear()
        code, _, err = invoke(run_main, str(calibrated), str(tmp_path / "x.npz"), *flags)
        assert code == 0, err
        notes = [r.getMessage() for r in caplog.records if "scores only" in r.getMessage()]
        assert len(notes) == expected
        assert all("holds no decisions (fit them with hydra-calibrate)" in n for n in notes)
