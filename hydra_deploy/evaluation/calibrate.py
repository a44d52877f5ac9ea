"""Fit an export's decisions on labelled data and store them in it (``hydra-calibrate``).

:func:`calibrate` runs the export through its own runner (so the fit sees the deployed numbers:
an FP16 export is calibrated on FP16 outputs), reads the labelled data the way ``hydra-eval``
does (:func:`~hydra_deploy.evaluation.evaluate.load_eval_data`: image folders, ``.npz``,
``.tsv``), fits the decisions with :func:`~hydra_deploy.decisions.fit_decisions` and measures them
on both parts of the data. :func:`store_decisions` writes the record into ``hydra.json`` (and,
``in_graph``, the decisions into ``model.onnx`` as outputs), atomically: an interrupted call
(a kill included) leaves the old model.onnx and hydra.json or the new pair, never one of each.
The record names the numbers it was fitted on (backend, precision, engine file).

This is uncertainty calibration (temperature, conformal thresholds), not TensorRT's INT8
calibration.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from hydra_deploy.decisions import (
    decision_metrics,
    fit_decisions,
    split_rows,
    temperature_at_bound,
)
from hydra_deploy.engines.backends import backend_of
from hydra_deploy.engines.runner import load_runner
from hydra_deploy.engines.runner_base import Runner
from hydra_deploy.errors import HydraError, ParameterError, counted, spelled
from hydra_deploy.evaluation.evaluate import EvalData, load_eval_data, member_logits
from hydra_deploy.export_folder import (
    MODEL_FILE,
    DecisionRecord,
    ExportFolderError,
    ExportInfo,
    file_sha256,
    read_info,
    write_decisions,
)
from hydra_deploy.optional import lazy_module
from hydra_deploy.options import CalibrationOptions
from hydra_deploy.uncertainty.scores import ensemble_scores

# --in-graph only: the graph's writers (onnx, and torch through hydra_deploy.export)
onnx = lazy_module("onnx", purpose="hydra-calibrate --in-graph", error=ExportFolderError)
decision_graph = lazy_module("hydra_deploy.export.decision_graph", purpose="--in-graph")
exporter = lazy_module("hydra_deploy.export.exporter", purpose="--in-graph")

logger = logging.getLogger("hydra_deploy")

__all__ = [
    "CHANCE_AFTER",
    "Calibration",
    "ChanceCheck",
    "at_chance",
    "calibrate",
    "carry_decisions",
    "data_sha256",
    "fitted_numbers",
    "store_decisions",
]


@dataclass(frozen=True)
class Calibration:
    """A fitted record and what it does: ``parts`` maps ``"temperature"`` (the part T was fitted
    on) and ``"quantile"`` (the part the thresholds were fitted on) to
    :func:`~hydra_deploy.decisions.decision_metrics`; ``ood`` maps each OOD set given to its
    flag rate (and answered share, mean set size)."""

    record: DecisionRecord
    parts: Mapping[str, Mapping[str, Any]]
    ood: Mapping[str, Mapping[str, Any]]


def data_sha256(data: EvalData) -> str:
    """The SHA-256 of labelled data as read: its labels and its inputs (array bytes, image file
    bytes in order, or texts, each with its second text for sentence pairs)."""
    digest = hashlib.sha256()
    if data.labels is not None:
        digest.update(np.ascontiguousarray(data.labels, dtype=np.int64).tobytes())
    if data.kind == "images":
        for path in data.images or ():
            digest.update(Path(path).read_bytes())
    elif data.kind == "text":
        texts = data.texts or []
        for text, pair in zip(texts, data.pairs or [None] * len(texts), strict=True):
            second = b"" if pair is None else b"\t" + pair.encode("utf-8")  # sentence pairs
            digest.update(text.encode("utf-8") + second + b"\0")
    else:
        arrays = data.array if isinstance(data.array, Mapping) else {"x": data.array}
        for name in sorted(arrays):
            array = np.ascontiguousarray(arrays[name])
            digest.update(f"{name}:{array.dtype}:{array.shape}".encode())
            digest.update(array.tobytes())
    return digest.hexdigest()


def fitted_numbers(runner: Runner) -> dict[str, Any]:
    """What the record names of the numbers it is fitted on (:class:`DecisionRecord`'s
    ``backend``, ``precision`` and ``engine_sha256``), as the runner's backend row proves them
    (:class:`~hydra_deploy.engines.backends.ModelProof`): ONNX Runtime and the graph's precision
    (hydra.json), TensorRT with the engine's precision (its JSON sidecar) and the engine file's
    hash, or a registered backend's own."""
    backend = backend_of(runner)
    if backend is None:
        raise HydraError(
            f"decisions are fitted on the outputs of an export's model.onnx (ONNX Runtime, or "
            f"another registered backend) or of a TensorRT engine built from it, not on a "
            f"{type(runner).__name__}; load it with load_runner(EXPORT_DIR, decisions=False)"
        )
    proof = backend.proof
    precision = proof.precision(runner)
    if precision is None and not proof.binds_file:
        precision = "fp32"  # an ONNX file outside an export folder: the exporter's default
    return {
        "backend": backend.records_as,
        "precision": precision,
        "engine_sha256": proof.file_sha256(runner),
    }


def _model_sha256(runner: Runner) -> str:
    """The hash the record names: the ONNX file run (an engine's: the file it was built from)."""
    backend = backend_of(runner)
    sha = None if backend is None else backend.proof.model_sha256(runner)
    if sha is None:
        raise HydraError(
            f"cannot tell which model.onnx {runner.path} was built from (no onnx_sha256 in "
            "its JSON sidecar); build the engine with hydra-build, or calibrate the export "
            "folder in ONNX Runtime"
        )
    return sha


def calibrate(
    runner: Runner,
    data: Any,
    options: CalibrationOptions | None = None,
    *,
    ood: Mapping[str, Any] | None = None,
    batch_size: int | None = None,
    **keywords: Any,
) -> Calibration:
    """Fit the decisions of an export on labelled in-distribution ``data``.

    ``runner``: a runner of the export (:func:`~hydra_deploy.engines.load_runner`; loaded with
    ``decisions=False``, so an old record does not matter). ``data``: what ``hydra-eval --id``
    takes (a path or in-memory arrays). ``ood``: optional ``{name: data}`` OOD sets, only to
    report the flag rate on them (they choose nothing). ``options``: how the decisions are fitted,
    a :class:`~hydra_deploy.options.CalibrationOptions` (hydra-calibrate's flags), or its fields
    as keyword arguments (``alpha``, ``sets``, ``class_conditional``, ``risk``, ``delta``,
    ``accept_score``, ``ood_alpha``, ``ood_score``, ``holdout``, ``seed``: the keyword arguments
    of :func:`~hydra_deploy.decisions.fit_decisions`); the hashes and class names come from the
    runner and the data, and the record names the numbers it was fitted on
    (:func:`fitted_numbers`): a runner of another backend, precision or engine file refuses it."""
    if options is None:
        options = CalibrationOptions(**keywords)
    elif keywords:
        raise ParameterError(
            f"give the fitting options as `options` or as keyword arguments, not both (got "
            f"{', '.join(sorted(keywords))} beside `options`)"
        )
    numbers = fitted_numbers(runner)
    labelled = load_eval_data(data, runner, name="--data", labelled=True)
    assert labelled.labels is not None
    logits = member_logits(
        runner,
        labelled,
        batch_size,
        desc="calibrating: running the model",
        each=ChanceCheck(labelled.labels),
    )
    names = getattr(runner, "class_names", None)
    record = fit_decisions(
        logits,
        labelled.labels,
        onnx_sha256=_model_sha256(runner),
        data_sha256=data_sha256(labelled),
        class_names=names if names and len(names) == logits.shape[2] else None,
        **options.fit_kwargs(),
    )
    record = replace(record, **numbers)
    t_rows, q_rows = split_rows(len(logits), record.holdout, record.seed)
    parts = {
        "temperature": decision_metrics(logits[t_rows], labelled.labels[t_rows], record),
        "quantile": decision_metrics(logits[q_rows], labelled.labels[q_rows], record),
    }
    flagged = {}
    for name, value in (ood or {}).items():
        unlabelled = load_eval_data(value, runner, name=f"--ood {name}", labelled=False)
        desc = f"calibrating: OOD set {name}"
        flagged[name] = decision_metrics(
            member_logits(runner, unlabelled, batch_size, desc=desc), None, record
        )
    return Calibration(record, parts, flagged)


#: examples seen before :class:`ChanceCheck` judges the accuracy (or all of them, when fewer)
CHANCE_AFTER = 64


def at_chance(logits: np.ndarray, labels: np.ndarray) -> str | None:
    """Why decisions fitted on these member ``logits`` [N, M, C] and ``labels`` guarantee little
    when the fused mean's top-1 accuracy is not above chance, else None. The test is one-sided:
    the accuracy K/N is at most 1/C + 3 sigma, sigma the binomial standard deviation of the
    accuracy of a model that guesses (p = 1/C: sqrt(p(1 - p)/N))."""
    n, classes = len(labels), logits.shape[2]
    right = int(np.sum(ensemble_scores(logits)["prediction"] == np.asarray(labels)))
    chance = 1.0 / classes
    if right / n > chance + 3.0 * math.sqrt(chance * (1.0 - chance) / n):
        return None
    return (
        f"after {counted(n, 'example')} the model is right on {right} ({100 * right / n:.1f}%), "
        f"about chance ({100 * chance:.3g}%) for {counted(classes, 'class')}: its weights look "
        "untrained or the labels do not match its classes"
        + spelled("", " (--labels)")
        + "; the decisions fitted on it will guarantee little"
    )


class ChanceCheck:
    """Called with each batch's member logits during the pass over the calibration data: after
    the first :data:`CHANCE_AFTER` examples (all of them, when fewer) logs :func:`at_chance`'s
    warning, once, when the model is at chance, so the user hears it before the full pass."""

    def __init__(self, labels: np.ndarray, after: int = CHANCE_AFTER) -> None:
        self.labels = np.asarray(labels)
        self.after = min(int(after), len(self.labels))
        self.parts: list[np.ndarray] = []
        self.seen = 0
        self.warning: str | None = None
        self.judged = False

    def __call__(self, logits: np.ndarray) -> None:
        if self.judged:
            return
        self.parts.append(np.asarray(logits))
        self.seen += len(logits)
        if self.seen < self.after:
            return
        self.judged = True
        self.warning = at_chance(np.concatenate(self.parts), self.labels[: self.seen])
        self.parts = []
        if self.warning is not None:
            logger.warning("%s", self.warning)


def store_decisions(
    export: str | os.PathLike, record: DecisionRecord, *, in_graph: bool = False
) -> ExportInfo:
    """Store ``record`` as ``decisions`` in the export's hydra.json; ``in_graph`` also adds the
    decisions to ``model.onnx`` as outputs (replacing any there), ``onnx_sha256``, ``outputs``
    and the record's hash following the new file. Written through
    :func:`~hydra_deploy.export_folder.write_decisions`: the new model.onnx is written under a
    temporary name, then the pair is switched by one rename, so an interruption (a kill
    included) leaves the old model.onnx and hydra.json or the new ones, never one of each."""
    info = read_info(export)
    current = file_sha256(info.onnx_path)
    if current != record.onnx_sha256:
        raise ExportFolderError(
            f"the decisions were fitted on another model.onnx than {info.folder}'s (sha256 "
            f"{record.onnx_sha256[:12]}..., the folder holds {current[:12]}...); fit them on "
            "this folder"
        )
    if in_graph and record.fitted_numbers()[0] == "tensorrt":
        raise ExportFolderError(
            "decisions fitted on a TensorRT engine's outputs cannot go into model.onnx: the new "
            "file is not the one the engine was built from; fit them in ONNX Runtime for the "
            "graph (an engine built from the new file then applies them with "
            "allow_decisions_mismatch=True), or store them without in_graph"
        )
    graph_had = bool(info.decisions is not None and info.decisions.in_graph)
    if not in_graph and not graph_had:
        return write_decisions(info.folder, replace(record, in_graph=False))
    model = decision_graph.remove_decisions(onnx.load(str(info.onnx_path)))
    if in_graph:
        model = decision_graph.add_decisions(model, record)
    fd, staged = tempfile.mkstemp(prefix=f".{MODEL_FILE}.", suffix=".tmp", dir=info.folder)
    os.close(fd)
    try:
        onnx.save(model, staged)
        stored = replace(record, onnx_sha256=file_sha256(staged), in_graph=in_graph)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(staged)
        raise
    outputs = [exporter.tensor_info(value) for value in model.graph.output]
    return write_decisions(info.folder, stored, model=staged, outputs=outputs)


def carry_decisions(
    source: str | os.PathLike, target: str | os.PathLike, inputs: Mapping[str, np.ndarray]
) -> DecisionRecord | None:
    """Carry ``source``'s decisions into ``target``, its re-export (``hydra-export --from``), when
    they still hold: the source's record was fitted on its model.onnx in ONNX Runtime (not on a
    TensorRT engine's outputs), and the two files give the same ``member_logits``, bit for bit,
    on ``inputs`` (named model inputs). Returns the record
    stored in ``target`` (in its graph too when it was in the source's), else None."""
    source_info = read_info(source)
    record = source_info.decisions
    if record is None or file_sha256(source_info.onnx_path) != record.onnx_sha256:
        return None
    if record.fitted_numbers()[0] != "onnxruntime":  # an engine's numbers: not compared here
        return None
    with (
        load_runner(source, decisions=False) as before,
        load_runner(target, decisions=False) as after,
    ):
        same = np.array_equal(
            before(dict(inputs))["member_logits"], after(dict(inputs))["member_logits"]
        )
    if not same:
        return None
    target_info = read_info(target)
    moved = replace(record, onnx_sha256=file_sha256(target_info.onnx_path), in_graph=False)
    return store_decisions(target, moved, in_graph=record.in_graph).decisions


def describe_parts(calibration: Calibration) -> list[list[str]]:
    """Table rows (what, temperature part, quantile part) of a calibration, for the command."""
    record, parts = calibration.record, calibration.parts
    t, q = parts["temperature"], parts["quantile"]

    def pct(value: Any) -> str:
        return "-" if value is None else f"{100 * value:.1f}%"

    def num(value: Any, digits: int = 3) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    rows = [
        ["examples", str(t["count"]), str(q["count"])],
        ["accuracy", pct(t["accuracy"]), pct(q["accuracy"])],
        ["ECE before T", pct(t["ece_raw"]), pct(q["ece_raw"])],
        [
            f"ECE after T = {record.temperature:.3f}"
            + (" (at its bound!)" if temperature_at_bound(record.temperature) else ""),
            pct(t["ece"]),
            pct(q["ece"]),
        ],
        [
            "NLL before / after T",
            f"{t['nll_raw']:.3f} / {t['nll']:.3f}",
            f"{q['nll_raw']:.3f} / {q['nll']:.3f}",
        ],
    ]
    if record.sets is not None:
        rows.append(
            [
                f"{record.sets.method.upper()} set coverage (target >= {1 - record.sets.alpha:g})",
                pct(t["coverage"]),
                pct(q["coverage"]),
            ]
        )
        rows.append(["mean set size", num(t["mean_set_size"], 2), num(q["mean_set_size"], 2)])
        rows.append(["empty sets", pct(t["empty_sets"]), pct(q["empty_sets"])])
    if record.selective is not None:
        s = record.selective
        rows.append(
            [
                f"answered at tau = {s.tau:.4g} ({s.score}, {s.procedure} test)",
                pct(t["answered"]),
                pct(q["answered"]),
            ]
        )
        rows.append(
            [
                f"selective risk (target <= {s.target_risk:g}, delta {s.delta:g})",
                pct(t["selective_risk"]),
                pct(q["selective_risk"]),
            ]
        )
    if record.ood is not None:
        o = record.ood
        rule = (
            f"confidence < {-o.threshold:.4g}"
            if o.score == "msp"
            else f"{o.score} > {o.threshold:.4g}"
        )
        rows.append(
            [
                f"ID flagged as OOD ({rule}; target <= {o.alpha:g})",
                pct(t["flag_rate"]),
                pct(q["flag_rate"]),
            ]
        )
    return rows


def quantile_part_note() -> str:
    """What the two columns mean (printed under the table)."""
    return (
        "T (and RAPS's parameters, the threshold grid) were fitted on the temperature part, every "
        "threshold on the quantile part: the quantile part's coverage is the one the guarantee "
        "covers by construction, the temperature part's is an out-of-sample check of it."
    )
