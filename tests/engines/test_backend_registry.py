"""A new runtime backend is one runner module plus one row: tests/helpers/ort_wrapped.py (ONNX
Runtime wrapped as "ort-wrapped"), registered from outside the package, runs through load_runner
and hydra-run, refuses what it does not open and keeps the decisions it computes the numbers of."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import shutil

import numpy as np
import pytest
from helpers.decisions import calibrate_export, images, labelled_like_model, tiny_export
from helpers.ort_wrapped import WRAPPED_ORT, WrappedOrtRunner

from hydra_deploy.cli.run import main as run_main
from hydra_deploy.engines.backends import (
    PathKind,
    get_backend,
    register_backend,
    unregister_backend,
)
from hydra_deploy.engines.runner import BACKENDS, load_runner
from hydra_deploy.errors import RunnerError
from hydra_deploy.evaluation.calibrate import calibrate, store_decisions


@pytest.fixture
def wrapped():
    """The row registered for one test (a plugin would register it once, at import)."""
    row = register_backend(WRAPPED_ORT)
    yield row
    unregister_backend(row.name)


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    return tiny_export(tmp_path_factory.mktemp("registry") / "export")


@pytest.fixture(scope="module")
def calibrated(export_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("registry-calibrated") / "export"
    shutil.copytree(export_dir, folder)
    calibrate_export(folder, count=400, risk=None)
    return folder


def test_a_registered_backend_runs_through_load_runner_as_onnx_runtime_does(wrapped, export_dir):
    assert list(BACKENDS) == ["onnxruntime", "tensorrt", "ort-wrapped"]
    assert wrapped.installed and get_backend("ort") is BACKENDS["onnxruntime"]
    x = images(3, seed=1)
    with load_runner(export_dir, backend="onnxruntime") as reference:
        expected = reference(x)
    for path, asked in ((export_dir, "ort-wrapped"), (export_dir / "model.onnx", "WRAPPED")):
        with load_runner(path, backend=asked) as runner:
            assert isinstance(runner, WrappedOrtRunner) and runner.backend == "ort-wrapped"
            assert (runner.min_batch, runner.max_batch) == (1, 4)  # hydra.json's profile
            outputs = runner(images(9, seed=1)[:3], batch_size=2)  # split by the template
            assert runner.export_info is not None and runner.class_names is not None
        assert outputs.keys() == expected.keys()
        for name, value in expected.items():
            np.testing.assert_allclose(outputs[name], value, atol=1e-6, err_msg=name)


def test_a_kind_of_path_it_does_not_open_names_the_backends_that_do(wrapped, tmp_path):
    engine = tmp_path / "model.engine"
    engine.write_bytes(b"not an engine")
    with pytest.raises(RunnerError, match=r"does not open .*run it with backend 'tensorrt'"):
        load_runner(engine, backend="ort-wrapped")
    unregister_backend("ort-wrapped")
    with pytest.raises(RunnerError, match=r"unknown backend 'ort-wrapped'; use 'onnxruntime' or"):
        load_runner(tmp_path, backend="ort-wrapped")
    register_backend(WRAPPED_ORT)  # for the fixture's teardown


def test_decisions_apply_where_the_row_names_the_numbers_they_were_fitted_on(
    wrapped, calibrated, caplog
):
    """Its record name is ONNX Runtime's (same numbers): decisions fitted there apply. A row
    that names other numbers refuses them, saying how to fit them again or apply them anyway."""
    with load_runner(calibrated) as reference:
        record = reference.decisions
    assert record is not None and record.backend == "onnxruntime"
    with load_runner(calibrated, backend="ort-wrapped") as runner:
        assert runner.decisions == record
    own = dataclasses.replace(WRAPPED_ORT, name="ort-own", aliases=(), record_name=None)
    register_backend(own)
    try:
        with pytest.raises(RunnerError) as caught:
            load_runner(calibrated, backend="ort-own")
        text = str(caught.value)
        assert "backend onnxruntime, this runner is ort-own" in text
        assert "allow_decisions_mismatch=True" in text and "hydra-calibrate" in text
        caplog.set_level(logging.WARNING, logger="hydra_deploy")
        with load_runner(calibrated, backend="ort-own", allow_decisions_mismatch=True) as runner:
            assert runner.decisions == record
        assert any("as asked" in r.getMessage() for r in caplog.records)
    finally:
        unregister_backend("ort-own")


def test_hydra_run_takes_the_registered_backend(wrapped, calibrated, tmp_path):
    np.savez(tmp_path / "x.npz", x=images(3, seed=2))

    def run(*flags: str) -> dict:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = run_main([str(calibrated), str(tmp_path / "x.npz"), "--json", "-", *flags])
        assert code == 0
        return json.loads(out.getvalue())

    wrapped_report, reference = run("--backend", "ort-wrapped"), run("--backend", "onnxruntime")
    assert wrapped_report["backend"] == "ort-wrapped" and reference["backend"] == "onnxruntime"
    assert wrapped_report["results"] == reference["results"]  # the decisions included
    assert "prediction_set" in json.dumps(wrapped_report["results"])


def test_a_row_is_checked_when_it_is_made_and_registered(wrapped):
    with pytest.raises(RunnerError, match=r"'ort' is taken by backend 'onnxruntime'"):
        register_backend(dataclasses.replace(WRAPPED_ORT, name="other", aliases=("ort",)))
    with pytest.raises(RunnerError, match=r"unknown path kinds \['\.xml file'\]"):
        register_backend(
            dataclasses.replace(WRAPPED_ORT, name="ir", aliases=(), opens={".xml file": print})
        )
    with pytest.raises(RunnerError, match="backend name 'Open VINO' is not usable"):
        dataclasses.replace(WRAPPED_ORT, name="Open VINO")
    # a kind of path of its own: a row adds it, and it is tried before the built-in ones
    xml = PathKind(".xml file", lambda p: p.suffix == ".xml", "ir")
    row = dataclasses.replace(
        WRAPPED_ORT, name="ir", aliases=(), opens={".xml file": print}, kinds=(xml,)
    )
    register_backend(row)
    try:
        assert get_backend("IR") is row
    finally:
        unregister_backend("ir")
    assert register_backend(WRAPPED_ORT, replace=True) is WRAPPED_ORT


def test_decisions_are_fitted_on_a_registered_backend_and_name_it(export_dir, tmp_path):
    """hydra-calibrate's binding goes through the row's proof: a backend with its own record
    name fits decisions that name it, which it then applies and ONNX Runtime refuses."""
    from hydra_deploy.evaluation.calibrate import fitted_numbers

    own = dataclasses.replace(WRAPPED_ORT, name="ort-own", aliases=(), record_name=None)
    register_backend(own)
    try:
        folder = tmp_path / "export"
        shutil.copytree(export_dir, folder)
        with load_runner(folder, backend="ort-own", decisions=False) as runner:
            assert fitted_numbers(runner) == {
                "backend": "ort-own",
                "precision": "fp32",
                "engine_sha256": None,
            }
            data = labelled_like_model(runner, images(400, seed=100), seed=0)
            calibration = calibrate(runner, data, risk=None)
        store_decisions(folder, calibration.record)
        assert calibration.record.backend == "ort-own"
        with load_runner(folder, backend="ort-own") as runner:
            assert runner.decisions == calibration.record
        with pytest.raises(RunnerError, match="backend ort-own, this runner is onnxruntime"):
            load_runner(folder)
    finally:
        unregister_backend("ort-own")
