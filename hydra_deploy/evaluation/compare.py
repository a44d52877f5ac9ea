"""Parity of an export across backends: PyTorch (reference), ONNX Runtime and a TensorRT engine.

``compare_export(export_dir, engine=None)`` rebuilds the fused model from the export folder in
PyTorch (float32, the reference), runs the same inputs through ONNX Runtime and, when given, a
TensorRT engine, and reports each backend against the tolerance of its precision
(:mod:`hydra_deploy.parity`: the table, the per-member and per-score checks).

ONNX Runtime's CPU kernels do not run BF16 MatMul: for BF16 exports that backend is skipped with
the reason. torch is imported when :func:`compare_export` runs.

An export with decisions (``hydra-calibrate``) gets decision checks too (:func:`decision_checks`):
the reference's decisions are :func:`~hydra_deploy.decisions.apply_decisions` of the PyTorch
member logits; a backend's are its graph outputs when ``model.onnx`` computes them (``--in-graph``:
``graph:calibrated_probs``, ``graph:prediction_set``, ``graph:accept``, ``graph:ood_flag``), else
``apply_decisions`` of its member logits (``decisions:...``). ``calibrated_probs`` is held to the
probs tolerance; the bool decisions to the argmax agreement, counted over the examples whose
deciding score lies farther from its threshold than that score's tolerance (an example on the
threshold may fall either way within tolerance: it is not counted). A record fitted on another
``model.onnx`` gets no checks (warned); the runners are loaded without their decisions, so a
stale record never stops the comparison of the numbers.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from hydra_deploy.arrays import read_array_file
from hydra_deploy.decisions import (
    apply_decisions,
    calibrated_scores,
    class_room,
    decision_margin,
    set_floor,
)
from hydra_deploy.engines.inputs import pick_inputs
from hydra_deploy.engines.runner import load_runner
from hydra_deploy.errors import HydraError, RunnerError
from hydra_deploy.export_folder import (
    MODEL_FILE,
    DecisionRecord,
    ExportInfo,
    file_sha256,
    read_info,
)
from hydra_deploy.optional import lazy_module
from hydra_deploy.parity import (
    BackendReport,
    Check,
    CompareReport,
    Tolerance,
    compare_outputs,
    tolerance_for,
)
from hydra_deploy.progress import progress
from hydra_deploy.set_scores import set_score
from hydra_deploy.uncertainty.metrics import ood_score

torch = lazy_module("torch", purpose="the PyTorch reference of hydra-compare")
export_package = lazy_module("hydra_deploy.export")  # (imports torch: when a comparison runs)

logger = logging.getLogger("hydra_deploy")
#: The bool decisions compared (per example: the whole set, the answer, the flag).
BOOL_DECISIONS = ("prediction_set", "accept", "ood_flag")


def _load_inputs(
    inputs: Any, export: ExportInfo, hydra: Any, batch: int, seed: int
) -> tuple[dict[str, np.ndarray], str]:
    """The inputs by name: given (array, .npy, .npz), or the model's own seeded example inputs
    (random pixels; random token ids with padded rows for text models)."""
    names = [spec["name"] for spec in export.inputs]
    if inputs is None:
        example = hydra.example_inputs(batch, seed)
        example = (example,) if not isinstance(example, (tuple, list)) else example
        arrays = {name: t.numpy() for name, t in zip(names, example, strict=True)}
        return arrays, f"the model's example inputs, seed {seed}"
    if isinstance(inputs, np.ndarray):
        if len(names) > 1:
            raise HydraError(f"the model takes {names}: pass a .npz holding each of them")
        return {names[0]: inputs.astype(np.float32, copy=False)}, "array"
    path = Path(inputs)
    if not path.exists():
        raise HydraError(f"the inputs file {str(path)!r} does not exist; check the path")
    if path.suffix.lower() != ".npz" and len(names) > 1:
        raise HydraError(f"the model takes {names}: pass a .npz holding each of them")
    loaded = read_array_file(
        path,
        what="the inputs",
        hint="give a complete .npy (np.save) or .npz (np.savez) of preprocessed arrays",
    )
    if isinstance(loaded, dict):
        picked = pick_inputs(loaded, names, str(path))
        if isinstance(picked, dict):  # a text model: int64 ids, zeros where token types are absent
            first = picked[names[0]]
            arrays = {
                n: picked[n].astype(np.int64) if n in picked else np.zeros_like(first, np.int64)
                for n in names
            }
            return arrays, str(path)
        array = picked
    else:
        array = loaded
    if array.dtype.kind != "f":
        raise HydraError(
            f"the inputs {path} are {array.dtype}, not floats"
            + (" (raw pixels?)" if array.dtype == np.uint8 else "")
            + "; give preprocessed float inputs, as hydra-run feeds the model"
        )
    if array.ndim == len(export.inputs[0]["shape"]) - 1:
        array = array[None]
    return {names[0]: np.asarray(array, dtype=np.float32)}, str(path)


def compare_export(
    export_dir: str | os.PathLike,
    *,
    engine: str | os.PathLike | None = None,
    inputs: str | os.PathLike | np.ndarray | None = None,
    batch: int = 8,
    seed: int = 0,
    providers: Any = None,
    tolerance: Tolerance | None = None,
) -> CompareReport:
    """Compare ONNX Runtime (and ``engine``, a TensorRT engine file) with PyTorch on one batch.

    ``inputs``: a .npy/.npz file or an array of preprocessed inputs; default ``batch`` random
    normal examples (``seed``). ``tolerance`` overrides the per-precision table for every backend.
    Returns a :class:`CompareReport`; it does not raise on a mismatch (check ``report.passed``).
    A requested engine that cannot be loaded (TensorRT missing) raises RunnerError.
    """
    folder = Path(export_dir)
    export, record = _read_export(folder)
    if batch < 1:
        raise HydraError(f"batch must be at least 1, got {batch}")
    precision = export.precision
    with progress(2 + (engine is not None), desc="comparing", unit="step") as steps:
        steps.describe("comparing: PyTorch reference")
        hydra = export_package.load_export(folder, check=False).float().eval()
        x, source = _load_inputs(inputs, export, hydra, batch, seed)
        reference = _reference(hydra, x, source)
        steps.update()
        steps.describe("comparing: ONNX Runtime")
        reports = [
            _onnxruntime_report(folder, precision, x, reference, providers, tolerance, record)
        ]
        steps.update()
        if engine is not None:
            steps.describe("comparing: TensorRT")
            reports.append(_engine_report(engine, precision, x, reference, tolerance, record))
            steps.update()
    count = len(next(iter(x.values())))
    return CompareReport(str(folder), precision, "pytorch fp32", count, source, reports)


def _engine_report(
    engine: str | os.PathLike,
    precision: str,
    x: dict[str, np.ndarray],
    reference: np.ndarray,
    tolerance: Tolerance | None,
    record: DecisionRecord | None,
) -> BackendReport:
    """A TensorRT engine against the reference, at its own precision's tolerance."""
    with load_runner(engine, backend="tensorrt", decisions=False) as runner:
        engine_precision = runner.precision or precision
        report = BackendReport(runner.backend, str(engine), engine_precision, "skipped")
        bounds = tolerance or tolerance_for(engine_precision)
        _fill(report, reference, runner(x), bounds, record)
    return report


def _read_export(folder: Path) -> tuple[ExportInfo, DecisionRecord | None]:
    """The export's record and its decisions (None when fitted on another model.onnx: warned)."""
    if not folder.exists():
        raise HydraError(
            f"{str(folder)!r} does not exist; give the folder hydra-export wrote (--out DIR)"
        )
    if not folder.is_dir():
        raise HydraError(
            f"{str(folder)!r} is not an export folder; give the folder hydra-export wrote "
            "(--out DIR)"
        )
    export = read_info(folder)
    if not export.onnx_path.is_file():
        raise HydraError(
            f"{str(folder)!r} is not an export folder: {MODEL_FILE} is missing; give the folder "
            "hydra-export wrote (--out DIR)"
        )
    record = export.decisions
    if record is not None and record.onnx_sha256 != file_sha256(export.onnx_path):
        logger.warning(
            "the decisions in %s were fitted on another model.onnx: their checks are left out "
            "(fit them again with hydra-calibrate %s --data LABELLED --overwrite)",
            export.path,
            folder,
        )
        record = None
    return export, record


def _reference(hydra: Any, x: dict[str, np.ndarray], source: str) -> np.ndarray:
    """The PyTorch model's member logits on ``x`` (finite inputs, finite outputs)."""
    if len(next(iter(x.values()))) == 0:
        raise HydraError("the inputs are an empty batch; give at least one example")
    bad = [n for n, a in x.items() if a.dtype.kind == "f" and not np.isfinite(a).all()]
    if bad:
        raise HydraError(
            f"the inputs ({source}) hold NaN or infinite values in {bad[0]!r}; fix the data"
        )
    with torch.no_grad():
        tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in x.values()]
        reference = hydra(*tensors).numpy()
    if not np.isfinite(reference).all():
        raise HydraError("the PyTorch reference returns NaN/inf for these inputs; check the inputs")
    return reference


def _onnxruntime_report(
    folder: Path,
    precision: str,
    x: dict[str, np.ndarray],
    reference: np.ndarray,
    providers: Any,
    tolerance: Tolerance | None,
    record: DecisionRecord | None,
) -> BackendReport:
    """ONNX Runtime against the reference, or skipped with the reason (BF16 on its CPU)."""
    report = BackendReport("onnxruntime", str(folder / MODEL_FILE), precision, "skipped")
    if precision == "bf16":
        report.reason = (
            "ONNX Runtime's CPU kernels do not implement BF16 MatMul/Softmax "
            "(NOT_IMPLEMENTED); build a TensorRT engine and pass --engine"
        )
        return report
    try:
        runner = load_runner(folder, providers=providers, decisions=False)
    except RunnerError as err:
        if "NOT_IMPLEMENTED" not in str(err):
            raise
        report.reason = str(err)
        return report
    with runner:
        outputs = runner(x)
    _fill(report, reference, outputs, tolerance or tolerance_for(precision), record)
    return report


def _fill(
    report: BackendReport,
    reference: np.ndarray,
    outputs: dict[str, np.ndarray],
    tolerance: Tolerance,
    record: Any = None,
) -> None:
    report.status, report.tolerance = "compared", tolerance
    report.members, report.scores = compare_outputs(reference, outputs, tolerance)
    if record is not None:
        report.scores += decision_checks(record, reference, outputs, tolerance)


def _score_bound(name: str, tolerance: Tolerance) -> float:
    return tolerance.probs if name == "msp" else tolerance.entropy


def _undecided(record: Any, reference: np.ndarray, tolerance: Tolerance) -> dict[str, np.ndarray]:
    """Per bool decision, where the reference's deciding score lies within its tolerance of the
    threshold (``prediction_set``: [B, C], per class; the others [B]): a backend within
    tolerance may decide those either way."""
    scores = calibrated_scores(reference, record.temperature)
    probs, found = scores["probs"], {}
    if record.sets is not None:
        rule = record.sets
        qhat = np.asarray(rule.qhat) if rule.class_conditional else rule.qhat[0]
        score = set_score(rule.method)
        room = class_room(probs, rule.method, rule.params)
        order = np.argsort(-probs, axis=1, kind="stable")
        ranks = np.empty_like(order)
        np.put_along_axis(ranks, order, np.arange(1, probs.shape[1] + 1)[None, :], axis=1)
        bound = tolerance.probs * score.room_drift(ranks)
        near = np.zeros(probs.shape, dtype=bool)
        if score.sorts:  # a tie within tolerance may rank either way
            ranked = np.take_along_axis(probs, order, axis=1)
            close = np.diff(ranked, axis=1) > -2 * tolerance.probs
            tied = np.zeros(probs.shape, dtype=bool)
            tied[:, :-1] |= close
            tied[:, 1:] |= close
            np.put_along_axis(near, order, tied, axis=1)
        found["prediction_set"] = near | (np.abs(room - set_floor(qhat)) <= bound)
    if record.selective is not None:
        rule = record.selective
        bound = _score_bound(rule.score, tolerance)
        # the comparison apply_decisions makes: past tau by its margin
        side = 1.0 if rule.score == "msp" else -1.0
        bar = rule.tau + side * decision_margin(rule.tau)
        found["accept"] = np.abs(scores[rule.score] - bar) <= bound
    if record.ood is not None:
        rule = record.ood
        bound = _score_bound(rule.score, tolerance)
        bar = rule.threshold + decision_margin(rule.threshold)
        found["ood_flag"] = np.abs(ood_score(scores, rule.score) - bar) <= bound
    return found


def decision_checks(
    record: Any, reference: np.ndarray, outputs: dict[str, np.ndarray], tolerance: Tolerance
) -> list[Check]:
    """A backend's decisions against the reference's (see the module docstring): its graph
    outputs where ``model.onnx`` computes them (``graph:<name>``), else ``apply_decisions`` of its
    member logits (``decisions:<name>``). ``calibrated_probs``: max abs difference within the
    probs tolerance; ``prediction_set`` (the whole set of an example), ``accept``, ``ood_flag``:
    the share of examples that agree, leaving out entries within tolerance of the threshold, at
    least the argmax agreement."""
    expected = apply_decisions(reference, record)
    got = outputs.get("member_logits")
    computed = apply_decisions(got, record, allow_nonfinite=True) if got is not None else {}
    undecided = _undecided(record, reference, tolerance)
    checks = []

    def actual(name: str) -> tuple[str, np.ndarray]:
        if name in outputs:
            return f"graph:{name}", np.asarray(outputs[name])
        return f"decisions:{name}", computed[name]

    label, value = actual("calibrated_probs")
    diff = np.asarray(value, dtype=np.float64) - expected["calibrated_probs"]
    worst = float(np.abs(diff).max()) if np.isfinite(diff).all() else float("inf")
    checks.append(Check(label, worst, tolerance.probs, worst <= tolerance.probs))
    for name in BOOL_DECISIONS:
        if name not in expected:
            continue
        label, value = actual(name)
        agree = (np.asarray(value, dtype=bool) == expected[name]) | undecided[name]
        if agree.ndim == 2:  # a set agrees when every class decided agrees
            agree = agree.all(axis=1)
        share = float(agree.mean())
        checks.append(
            Check(label, share, tolerance.argmax, share >= tolerance.argmax, kind="agreement")
        )
    return checks
