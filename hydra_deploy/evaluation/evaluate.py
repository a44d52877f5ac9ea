"""Evaluate a Hydra ensemble on in-distribution data and OOD sets (numpy only at import).

:func:`evaluate` runs any runner (an export folder, ``.onnx`` or engine path, or an object called
as ``runner(inputs) -> {"member_logits": [B, M, C], ...}``) over the data, scores the outputs with
:func:`~hydra_deploy.uncertainty.scores.ensemble_scores` and returns a JSON-ready report:

- on the ID data: :func:`~hydra_deploy.uncertainty.metrics.classification_metrics` of the ensemble
  probabilities (ECE with ``bins`` equal-width bins on the max probability), the reliability table,
  and AURC / E-AURC with each score as the confidence;
- per OOD set and per score: AUROC, AUPR and FPR95 with **OOD as the positive class** and the score
  turned into an OOD score by :func:`~hydra_deploy.uncertainty.metrics.ood_score` (``-msp``);
- on a calibrated export (``hydra-calibrate``: ``runner.decisions``; ``decisions=False`` leaves it
  out), a ``decisions`` section from :func:`~hydra_deploy.decisions.decision_metrics`, each
  number beside the target its rule was fitted for: on the ID data the prediction sets'
  empirical coverage (target >= 1 - alpha), mean size and share of empty sets, the selective
  risk (target <= the rule's risk, with probability >= 1 - delta) and the share answered at tau,
  ECE and NLL before and after the temperature, the share of ID inputs flagged as OOD (target
  <= alpha_ood); on each OOD set the share flagged (and answered, and the mean set size).

:func:`write_report` writes ``report.json``, ``report.md``, ``reliability.png`` and one
``hist_<score>.png`` per score into a folder (with decisions also ``risk_coverage.png`` and, with
prediction sets, ``set_sizes.png``), built in a temporary folder and renamed into place.

Data (ID must be labelled, OOD sets need no labels):

- a ``.npz`` with ``x`` (or the model's input name, or ``input_ids``/``attention_mask`` for text
  models) and, for ID, ``y``; a ``.npy`` array (OOD only);
- an image folder: for ID, one sub-folder per class, named after its class; for OOD, every image
  under the folder; images are preprocessed from the export's ``hydra.json``;
- text models: a ``.tsv`` (``label<TAB>text`` per line, or ``label<TAB>text<TAB>second text`` for
  sentence pairs) for ID, a ``.txt`` (one text a line) or ``.tsv`` for OOD;
- in memory: an array (OOD), a dict of arrays, or a tuple ``(x, y)``.

Files are read by :mod:`hydra_deploy.userdata`, as fine-tuning, head selection and ``hydra-run``
read them. Class names (``.tsv`` labels, class sub-folders) become indices by the rule fine-tuning uses too,
:func:`hydra_deploy.labels.label_indices`: through the model's ``class_names`` (hydra.json; a BERT
export records its checkpoint's ``id2label``), a name that is not one of them refused; a model
without class names takes the sorted names as classes ``0, 1, ...`` (warned) only when there are
as many as it has classes. A ``.tsv`` may give class indices instead; class sub-folders named
``0..C-1`` are class indices, and a :class:`~hydra_deploy.labels.NamedClasses` (``--labels FILE``)
names the classes (:func:`hydra_deploy.labels.folder_class_indices`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hydra_deploy.arrays import read_array_file
from hydra_deploy.atomic import atomic_write_json, atomic_write_text, staging_dir
from hydra_deploy.decisions import apply_decisions, decision_metrics, describe_split
from hydra_deploy.engines.inputs import pick_inputs
from hydra_deploy.engines.runner import load_runner
from hydra_deploy.engines.runner_base import Runner, check_shape
from hydra_deploy.engines.scoring import run_member_logits
from hydra_deploy.engines.sources import iter_batches, model_family, with_batch_axis
from hydra_deploy.errors import DataError, HydraError, counted, spelled
from hydra_deploy.evaluation.torch_runner import TorchRunner
from hydra_deploy.labels import (
    NamedClasses,
    class_names_to_use,
    folder_class_indices,
    split_class_names,
)
from hydra_deploy.progress import progress
from hydra_deploy.uncertainty import plots
from hydra_deploy.uncertainty.metrics import (
    ECE_BINS,
    _check_bins,
    classification_metrics,
    ood_metrics,
    ood_score,
    reliability_bins,
)
from hydra_deploy.uncertainty.scores import SCALAR_SCORES, ensemble_scores
from hydra_deploy.userdata import (
    find_images,
    labelled_images,
    read_text_file,
    text_items,
)

DEFAULT_SCORES = ("msp", "predictive_entropy", "mutual_information")
#: Scores that measure how members differ: identically 0 for one member, so not applicable there.
SPREAD_SCORES = ("mutual_information", "disagreement")
NOT_APPLICABLE = "not applicable: one member, so the score is 0 for every example by definition"
REPORT_FILES = ("report.json", "report.md", "reliability.png")


@dataclass
class EvalData:
    """One data set ready to run: arrays, a dict of arrays, image paths or texts; labels or None."""

    name: str
    source: str
    kind: str  # "array" | "images" | "text"
    count: int
    array: Any = None
    images: list[Path] | None = None
    texts: list[str] | None = None
    labels: np.ndarray | None = None
    class_names: list[str] | None = field(default=None)
    #: the second text of each example of a sentence-pair ``.tsv`` (None: single texts)
    pairs: list[str] | None = None

    def batches(self, runner: Runner, size: int) -> Iterator[Any]:
        """The model's inputs, ``size`` examples at a time (hydra-run's batching)."""
        texts = None if self.texts is None else text_items(self.texts, self.pairs)
        items = {"images": self.images, "text": texts}.get(self.kind, self.array)
        for _, inputs in iter_batches(runner, self.kind, items, size):
            yield inputs


# ---------------------------------------------------------------------------------------------
# Reading data
# ---------------------------------------------------------------------------------------------


def _input_names(runner: Runner) -> tuple[str, ...]:
    return tuple(getattr(runner, "input_names", ()) or ())


def _rows(value: Any, name: str) -> int:
    if isinstance(value, Mapping):
        counts = {k: len(v) for k, v in value.items()}
        if len(set(counts.values())) != 1:
            raise HydraError(f"{name}: the input arrays differ in length: {counts}")
        return next(iter(counts.values()))
    return len(value)


def _labels(y: Any, count: int, name: str) -> np.ndarray:
    labels = np.asarray(y)
    if labels.ndim != 1 or labels.shape[0] != count:
        raise HydraError(
            f"{name}: labels 'y' must be 1-D with one label per example ({count}), got shape "
            f"{labels.shape}"
        )
    if labels.dtype == np.bool_ or not np.issubdtype(labels.dtype, np.integer):
        if np.issubdtype(labels.dtype, np.floating) and np.all(labels == np.round(labels)):
            labels = labels.astype(np.int64)
        else:
            raise HydraError(
                f"{name}: labels 'y' must be integer class indices, got {labels.dtype}"
            )
    return labels.astype(np.int64)


def _from_arrays(x: Any, y: Any, runner: Runner, name: str, source: str) -> EvalData:
    if isinstance(x, Mapping):
        x = pick_inputs(x, _input_names(runner), f"{name}: {source}")
    else:
        x = with_batch_axis(np.asarray(x), runner)  # one example without its batch axis
    count = _rows(x, name)
    if count == 0:
        raise HydraError(f"{name} ({source}) is empty: it holds no examples")
    _check_shapes(x, runner, f"{name} ({source}, {counted(count, 'example')}): ")
    labels = None if y is None else _labels(y, count, name)
    return EvalData(name, source, "array", count, array=x, labels=labels)


def _check_shapes(x: Any, runner: Runner, where: str) -> None:
    """The whole file's shapes against the model's inputs, before it is cut into batches (whose
    errors would name a batch of 32, not the file)."""
    specs = {spec.name: spec for spec in getattr(runner, "inputs", None) or ()}
    if not isinstance(x, Mapping):
        x = {next(iter(specs)): x} if len(specs) == 1 else {}
    for key, array in x.items():
        if key in specs:
            check_shape(specs[key], np.shape(array), where)


def _num_classes(runner: Runner) -> int | None:
    """The model's class count: its class names', a PyTorch model's, or its output's last axis."""
    names = getattr(runner, "class_names", None)
    if names:
        return len(names)
    count = getattr(getattr(runner, "model", None), "num_classes", None)
    if isinstance(count, int):
        return count
    for output in getattr(runner, "outputs", None) or ():
        if getattr(output, "name", None) == "member_logits" and len(output.shape) == 3:
            classes = output.shape[2]
            return classes if isinstance(classes, int) and classes > 0 else None
    return None


def _image_folder(
    path: Path, runner: Runner, name: str, labelled: bool, given: NamedClasses | None = None
) -> EvalData:
    if not labelled:
        try:
            images = find_images([path])
        except HydraError as err:
            raise HydraError(f"{name}: {err}") from err
        return EvalData(name, str(path), "images", len(images), images=images)
    images, owners, classes = labelled_images(path, name=name, error=HydraError)
    indices, _ = folder_class_indices(
        classes,
        getattr(runner, "class_names", None),
        _num_classes(runner),
        source=f"{name}: {path}",
        given=given,
    )
    index = dict(zip(classes, indices, strict=True))
    return EvalData(
        name,
        str(path),
        "images",
        len(images),
        images=images,
        labels=np.asarray([index[cls] for cls in owners], np.int64),
        class_names=classes,
    )


def _text_file(
    path: Path, runner: Runner, name: str, labelled: bool, given: NamedClasses | None = None
) -> EvalData:
    """A ``.txt`` (OOD) or ``.tsv`` (label<TAB>text[<TAB>second text]), read by
    :func:`hydra_deploy.userdata.read_text_file`; an OOD ``.tsv``'s labels may be anything."""
    table = read_text_file(path, name=name, error=HydraError)
    if not labelled:
        return EvalData(name, str(path), "text", len(table), texts=table.texts, pairs=table.pairs)
    names = class_names_to_use(getattr(runner, "class_names", None), given, _num_classes(runner))
    labels, classes = table.label_indices(names, _num_classes(runner), name=name, error=DataError)
    return EvalData(
        name,
        str(path),
        "text",
        len(table),
        texts=table.texts,
        pairs=table.pairs,
        labels=np.asarray(labels, np.int64),
        class_names=classes,
    )


def _unread_kind(path: Path, name: str, text: bool, labelled: bool) -> str:
    """Why ``path`` is not read as data, and the kinds that are (a text model's or an image
    model's; a .csv of text: saved tab-separated)."""
    what = f"a {path.suffix} file" if path.suffix else "a file without a suffix"
    labels = " and labels y" if labelled else ""
    if text:
        accepted = (
            "a .tsv (label<TAB>text, one example per line) or .txt text file, or a .npz of "
            f"token ids{labels}"
        )
        if path.suffix.lower() == ".csv":
            accepted += "; a .csv: save it tab-separated as .tsv"
    else:
        accepted = f"an image folder (one sub-folder per class) or a .npz of image arrays x{labels}"
    return f"{name}: cannot tell what {str(path)!r} is ({what}, not read as data): give {accepted}"


def load_eval_data(data: Any, runner: Runner, *, name: str, labelled: bool) -> EvalData:
    """Read one data set (a path or in-memory arrays); ID data (``labelled``) must carry labels."""
    if isinstance(data, EvalData):
        return data
    data, given = split_class_names(data)  # a --labels file's names beside the path
    if isinstance(data, tuple):
        if len(data) != 2:
            raise HydraError(f"{name}: a tuple of data must be (x, y), got {len(data)} items")
        x, y = data
        return _from_arrays(x, y if labelled else None, runner, name, "arrays")
    if isinstance(data, Mapping):
        arrays = dict(data)
        y = arrays.pop("y", None)
        if labelled and y is None:
            raise HydraError(f"{name}: in-distribution data needs labels 'y'")
        return _from_arrays(arrays, y if labelled else None, runner, name, "arrays")
    if isinstance(data, np.ndarray):
        if labelled:
            raise HydraError(f"{name}: in-distribution data needs labels: pass (x, y)")
        return _from_arrays(data, None, runner, name, "array")
    if not isinstance(data, (str, os.PathLike)):
        raise HydraError(f"{name}: cannot read data of type {type(data).__name__}")
    path = Path(data)
    if not path.exists():
        raise HydraError(
            f"{name}: {str(path)!r} does not exist; check the path: give an image folder, a .npz"
            + (" or a .tsv/.txt text file" if model_family(runner).text else "")
        )
    suffix = path.suffix.lower()
    family = model_family(runner)
    if path.is_dir():
        if family.text:
            raise HydraError(
                f"{name}: {path} is an image folder, but MODEL is a text model; give a .tsv/.txt "
                "text file (label<TAB>text) or a .npz of token ids"
            )
        return _image_folder(path, runner, name, labelled, given)
    if suffix in (".txt", ".tsv"):
        if not family.text:
            raise HydraError(
                f"{name}: {path} is text, but MODEL is a {family.name} model, which takes images; "
                "give an image folder (one subfolder per class) or a .npz of image arrays"
            )
        return _text_file(path, runner, name, labelled, given)
    if suffix not in (".npz", ".npy"):
        raise HydraError(_unread_kind(path, name, family.text, labelled))
    if suffix == ".npy" and labelled:
        raise HydraError(
            f"{name}: {path} is a .npy array without labels; in-distribution data is a .npz with "
            "x and y"
        )
    loaded = read_array_file(
        path, prefix=f"{name}: ", what="", hint="give a complete .npz (np.savez) or .npy"
    )
    if not isinstance(loaded, dict):
        return _from_arrays(loaded, None, runner, name, str(path))
    arrays = loaded
    y = arrays.pop("y", None)
    if labelled and y is None:
        raise HydraError(
            f"{name}: {path} has no labels 'y' (arrays: {sorted(arrays)}); save them beside the "
            "inputs, np.savez(path, x=x, y=labels), or give the file as an OOD set "
            + spelled("(ood={NAME: FILE})", "(hydra-eval --ood NAME=FILE)")
            + ", which needs no labels"
        )
    if not arrays:
        raise HydraError(f"{name}: {path} holds no input arrays")
    return _from_arrays(arrays, y if labelled else None, runner, name, str(path))


# ---------------------------------------------------------------------------------------------
# Running and scoring
# ---------------------------------------------------------------------------------------------


def member_logits(
    runner: Runner,
    data: EvalData,
    batch_size: int | None = None,
    *,
    desc: str | None = None,
    each: Callable[[np.ndarray], None] | None = None,
) -> np.ndarray:
    """The runner's ``member_logits`` [N, M, C] over ``data``, batch by batch, its progress shown
    (:mod:`hydra_deploy.progress`; ``desc``: what the step is called, default "running the
    model on <data name>"). ``each`` is called with every batch's logits as it comes."""
    if data.kind == "images" and not getattr(runner, "preprocessing", None):
        raise HydraError(
            f"{data.name}: the model comes without its hydra.json, so images cannot be "
            "preprocessed for it: run the export folder, or pass .npz arrays"
        )
    size = batch_size or getattr(runner, "max_batch", None) or 32
    parts = []
    with progress(
        data.count, desc=desc or f"running the model on {data.name}", unit="example"
    ) as bar:
        for batch in data.batches(runner, size):
            logits = run_member_logits(runner, batch, batch_size=batch_size)
            parts.append(logits)
            bar.update(len(logits))
            if each is not None:
                each(logits)
    return np.concatenate(parts)


def _jsonable_bins(table: Mapping[str, np.ndarray]) -> dict[str, list]:
    def clean(values: np.ndarray) -> list:
        return [None if not np.isfinite(v) else float(v) for v in np.asarray(values, np.float64)]

    return {
        "edges": clean(table["edges"]),
        "count": [int(c) for c in table["count"]],
        "accuracy": clean(table["accuracy"]),
        "confidence": clean(table["confidence"]),
    }


def _check_scores(scores: Sequence[str]) -> tuple[str, ...]:
    names = tuple(scores)
    if not names:
        raise HydraError("give at least one score")
    unknown = [s for s in names if s not in SCALAR_SCORES]
    if unknown:
        raise HydraError(f"unknown score(s) {unknown}; choose from {list(SCALAR_SCORES)}")
    return tuple(dict.fromkeys(names))


def _is_torch_module(obj: Any) -> bool:
    """A torch ``nn.Module`` (checked without importing torch: this module is numpy-only)."""
    return any(
        cls.__module__ == "torch.nn.modules.module" and cls.__name__ == "Module"
        for cls in type(obj).__mro__
    )


def evaluate(
    runner_or_path: Any,
    id_data: Any,
    ood: Mapping[str, Any] | None = None,
    *,
    batch_size: int | None = None,
    bins: int = ECE_BINS,
    scores: Sequence[str] = DEFAULT_SCORES,
    return_scores: bool = False,
    decisions: bool = True,
) -> dict[str, Any] | tuple[dict[str, Any], dict[str, Any]]:
    """Report of a Hydra ensemble on ``id_data`` (labelled) and the OOD sets ``ood`` by name.

    ``runner_or_path``: a runner (anything called as ``runner(inputs)`` returning a dict holding
    ``member_logits`` [B, M, C]), a fused PyTorch ``HydraModel`` (run through
    :class:`TorchRunner`) or a path for :func:`~hydra_deploy.engines.load_runner` (opened and
    closed here). ``bins``: ECE/reliability bins. ``scores``: which of ``SCALAR_SCORES`` rank
    examples for OOD detection (OOD positive; see :func:`ood_score`) and misclassification.

    With ``return_scores`` also returns the per-example arrays (``{"id": ensemble_scores + labels,
    "ood": {name: ensemble_scores}}``, and ``"decisions"``: see :func:`decisions_section`) that
    :func:`write_report` plots.

    ``decisions``: when the runner holds decisions (``runner.decisions``: a calibrated export),
    add the report's ``decisions`` section; False leaves it out (and a path is then loaded
    without them: ``load_runner(..., decisions=False)``).
    """
    names = _check_scores(scores)
    bins = _check_bins(bins)  # before the model runs
    if batch_size is not None and int(batch_size) < 1:
        raise HydraError(f"batch size must be at least 1, got {batch_size}")
    ood = dict(ood or {})
    if isinstance(runner_or_path, (str, os.PathLike)):
        with load_runner(runner_or_path, decisions=decisions) as runner:
            return evaluate(
                runner,
                id_data,
                ood,
                batch_size=batch_size,
                bins=bins,
                scores=names,
                return_scores=return_scores,
                decisions=decisions,
            )
    runner = runner_or_path
    if _is_torch_module(runner):
        runner = TorchRunner(runner)
    id_set, ood_sets = _load_sets(runner, id_data, ood)

    id_logits = member_logits(runner, id_set, batch_size, desc="evaluating on the ID data")
    id_scores = ensemble_scores(id_logits)
    members, classes = id_scores["member_probs"].shape[1:]
    _check_labels(id_set.labels, classes)
    void = [s for s in names if members == 1 and s in SPREAD_SCORES]  # ranks nothing for M = 1
    ood_logits, ood_arrays = {}, {}
    for name, data in ood_sets.items():  # each set checked once it has run
        ood_logits[name] = member_logits(
            runner, data, batch_size, desc=f"evaluating on {data.name}"
        )
        ood_arrays[name] = _ood_scores(name, ood_logits[name], id_scores)
    report: dict[str, Any] = {
        **_model_fields(runner, members, classes),
        "counts": {"id": id_set.count, "ood": {n: d.count for n, d in ood_sets.items()}},
        "scores": list(names),
        "not_applicable": {s: NOT_APPLICABLE for s in void},
        "conventions": _conventions(bins),
        "id": _id_report(id_set, id_scores, names, void, bins),
        "ood": {
            name: _ood_report(data, ood_arrays[name], id_scores, names, void)
            for name, data in ood_sets.items()
        },
    }
    record = getattr(runner, "decisions", None) if decisions else None
    arrays: dict[str, Any] = {"id": {**id_scores, "labels": id_set.labels}, "ood": ood_arrays}
    if record is not None:
        report["decisions"], arrays["decisions"] = decisions_section(
            record, id_logits, id_set.labels, ood_logits, bins
        )
    if return_scores:
        return report, arrays
    return report


def _load_sets(
    runner: Runner, id_data: Any, ood: Mapping[str, Any]
) -> tuple[EvalData, dict[str, EvalData]]:
    """The ID data (labelled) and the OOD sets by name, read before the model runs."""
    id_set = load_eval_data(id_data, runner, name="ID data", labelled=True)
    ood_sets = {
        n: load_eval_data(d, runner, name=f"OOD set {n!r}", labelled=False) for n, d in ood.items()
    }
    return id_set, ood_sets


def _model_fields(runner: Runner, members: int, classes: int) -> dict[str, Any]:
    """The report's first entries: which model, run how."""
    return {
        "model": str(getattr(runner, "export_dir", None) or getattr(runner, "path", "") or runner),
        "backend": getattr(runner, "backend", None),
        "precision": getattr(runner, "precision", None),
        "family": getattr(runner, "family", None),
        "members": int(members),
        "classes": int(classes),
        "class_names": getattr(runner, "class_names", None),
    }


def _check_labels(labels: np.ndarray, classes: int) -> None:
    bad = (labels < 0) | (labels >= classes)
    if bad.any():
        first = int(np.argmax(bad))
        raise HydraError(
            f"ID data: labels must lie in [0, {classes - 1}] (the model has {classes} classes); "
            f"{int(bad.sum())} do not (first: label {labels[first]} at index {first})"
        )


def _conventions(bins: int) -> dict[str, str]:
    """How the report's numbers are defined."""
    return {
        "probs": "mean over members of the member softmax",
        "ece": f"{bins} equal-width bins of [0, 1] on the max probability, right-closed",
        "ood": "OOD is the positive class; the OOD score is -msp for msp, the score as it is "
        "otherwise; FPR95 is the FPR at the first threshold with TPR >= 0.95",
        "selective": "AURC/E-AURC with the score as confidence (msp as it is, minus the others)",
    }


def _id_report(
    id_set: EvalData,
    id_scores: Mapping[str, np.ndarray],
    names: Sequence[str],
    void: Sequence[str],
    bins: int,
) -> dict[str, Any]:
    """The report's ``id`` entry: classification metrics, AURC / E-AURC per score (None for a
    score that ranks nothing), mean scores and the reliability table."""
    probs, labels = id_scores["probs"], id_set.labels
    selective = {}
    for score in names:
        if score in void:
            selective[score] = {"aurc": None, "eaurc": None, "note": NOT_APPLICABLE}
            continue
        conf = -ood_score(id_scores, score)
        metrics = classification_metrics(probs, labels, bins, confidence=conf)
        selective[score] = {"aurc": metrics["aurc"], "eaurc": metrics["eaurc"]}
    return {
        "data": id_set.source,
        "count": id_set.count,
        "ece_bins": int(bins),
        "classification": classification_metrics(probs, labels, bins),
        "selective": selective,
        "mean_scores": {s: float(np.mean(id_scores[s], dtype=np.float64)) for s in names},
        "reliability": _jsonable_bins(reliability_bins(probs, labels, bins)),
    }


def _ood_scores(
    name: str, logits: np.ndarray, id_scores: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """:func:`ensemble_scores` of an OOD set's logits, of the ID data's member and class counts."""
    got = ensemble_scores(logits)
    if got["member_probs"].shape[1:] != id_scores["member_probs"].shape[1:]:
        raise HydraError(f"OOD set {name!r}: the model gave a different output shape")
    return got


def _ood_report(
    data: EvalData,
    got: Mapping[str, np.ndarray],
    id_scores: Mapping[str, np.ndarray],
    names: Sequence[str],
    void: Sequence[str],
) -> dict[str, Any]:
    """One OOD set's entry: its mean scores and AUROC / AUPR / FPR95 per score (OOD positive)."""
    return {
        "data": data.source,
        "count": data.count,
        "mean_scores": {s: float(np.mean(got[s], dtype=np.float64)) for s in names},
        "scores": {
            s: {"auroc": None, "aupr": None, "fpr95": None, "note": NOT_APPLICABLE}
            if s in void
            else ood_metrics(ood_score(id_scores, s), ood_score(got, s))
            for s in names
        },
    }


def _meets(value: float | None, target: float, at_most: bool) -> bool | None:
    if value is None:
        return None
    return bool(value <= target + 1e-12) if at_most else bool(value >= target - 1e-12)


def decisions_section(
    record: Any,
    id_logits: np.ndarray,
    labels: np.ndarray,
    ood_logits: Mapping[str, np.ndarray],
    bins: int = ECE_BINS,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The report's ``decisions`` section for a :class:`~hydra_deploy.export_folder.DecisionRecord`
    (numbers by :func:`~hydra_deploy.decisions.decision_metrics`), and the per-example arrays its
    plots need: the calibrated ``confidence`` and whether the calibrated ``prediction`` is
    ``correct`` on the ID data, the prediction-set sizes of the ID data and of each OOD set
    (``set_sizes``: ``{"ID": ..., name: ...}``), the classes and the rules' targets.

    ``id`` holds ``checks``: one entry per guarantee, ``{"value", "target", "meets"}``
    (``meets`` None when there is nothing to measure: no example answered). The guarantees are
    marginal, over data exchangeable with the calibration data: on a finite test set a value
    scatters around its target."""
    ident = decision_metrics(id_logits, labels, record, bins=bins)
    checks: dict[str, dict[str, Any]] = {}
    section: dict[str, Any] = {
        "temperature": record.temperature,
        "rules": {
            "sets": None if record.sets is None else record.sets.to_dict(),
            "selective": None if record.selective is None else record.selective.to_dict(),
            "ood": None if record.ood is None else record.ood.to_dict(),
        },
        "calibration": {
            "onnx_sha256": record.onnx_sha256,
            "data_sha256": record.data_sha256,
            "n_temperature": record.n_temperature,
            "n_quantile": record.n_quantile,
        },
        "id": {**ident, "checks": checks},
        "ood": {},
        "conventions": {
            "prediction": "the argmax of the calibrated probabilities mean_m softmax(logits_m / T)",
            "ece": f"{bins} equal-width bins on the max probability, before (raw) and after T",
            "guarantees": "marginal, over data exchangeable with the calibration data; a finite "
            "test set scatters around the targets, and none holds under distribution shift",
        },
    }
    if record.sets is not None:
        target = 1.0 - record.sets.alpha
        checks["coverage"] = {
            "value": ident["coverage"],
            "target": target,
            "meets": _meets(ident["coverage"], target, at_most=False),
        }
    if record.selective is not None:
        rule = record.selective
        checks["selective_risk"] = {
            "value": ident["selective_risk"],
            "target": rule.target_risk,
            "meets": _meets(ident["selective_risk"], rule.target_risk, at_most=True),
        }
    if record.ood is not None:
        checks["flag_rate"] = {
            "value": ident["flag_rate"],
            "target": record.ood.alpha,
            "meets": _meets(ident["flag_rate"], record.ood.alpha, at_most=True),
        }
    decided = apply_decisions(id_logits, record)
    arrays: dict[str, Any] = {
        "confidence": decided["confidence"].astype(np.float64),
        "correct": decided["prediction"] == labels,
        "classes": int(id_logits.shape[2]),
        "set_sizes": {},
        "target_risk": None if record.selective is None else record.selective.target_risk,
        "tau_point": None,
    }
    if record.selective is not None and ident["selective_risk"] is not None:
        arrays["tau_point"] = (ident["answered"], ident["selective_risk"])
    if "prediction_set" in decided:
        arrays["set_sizes"]["ID"] = decided["prediction_set"].sum(axis=1)
    for name, logits in ood_logits.items():
        section["ood"][name] = decision_metrics(logits, None, record, bins=bins)
        if record.sets is not None:
            sets = apply_decisions(logits, record)["prediction_set"]
            arrays["set_sizes"][name] = sets.sum(axis=1)
    return section, arrays


# ---------------------------------------------------------------------------------------------
# Writing the report folder
# ---------------------------------------------------------------------------------------------


def _fmt(value: Any) -> str:
    return "—" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)


def markdown(report: Mapping[str, Any]) -> str:
    """The report as markdown tables."""
    ident = report["id"]
    lines = [
        f"# hydra-eval: {report['model']}",
        "",
        f"- backend: {report.get('backend')}, precision: {report.get('precision')}, members: "
        f"{report['members']}, classes: {report['classes']}",
        f"- ID data: `{ident['data']}` ({counted(ident['count'], 'example')})",
        *(
            f"- OOD set {n}: `{o['data']}` ({counted(o['count'], 'example')})"
            for n, o in report["ood"].items()
        ),
        "",
        f"## In-distribution classification (ECE: {ident['ece_bins']} equal-width bins)",
        "",
        "| metric | value |",
        "|---|---:|",
        *(f"| {k} | {_fmt(v)} |" for k, v in ident["classification"].items()),
        "",
        "## Misclassification detection (score as confidence)",
        "",
        "| score | AURC | E-AURC |",
        "|---|---:|---:|",
        *(
            f"| {s} | {_fmt(v['aurc'])} | {_fmt(v['eaurc'])} |"
            for s, v in ident["selective"].items()
        ),
        "",
        "## OOD detection (OOD positive)",
        "",
        "| OOD set | score | AUROC | AUPR | FPR95 |",
        "|---|---|---:|---:|---:|",
    ]
    for name, entry in report["ood"].items():
        for score, m in entry["scores"].items():
            lines.append(
                f"| {name} | {score} | {_fmt(m['auroc'])} | {_fmt(m['aupr'])} | "
                f"{_fmt(m['fpr95'])} |"
            )
    if report.get("not_applicable"):
        lines += ["", *(f"- {s}: {why}" for s, why in report["not_applicable"].items())]
    lines += [
        "",
        "## Mean scores",
        "",
        "| data | " + " | ".join(report["scores"]) + " |",
        "|---|" + "---:|" * len(report["scores"]),
        "| ID | " + " | ".join(_fmt(ident["mean_scores"][s]) for s in report["scores"]) + " |",
    ]
    for name, entry in report["ood"].items():
        lines.append(
            f"| {name} | "
            + " | ".join(_fmt(entry["mean_scores"][s]) for s in report["scores"])
            + " |"
        )
    if report.get("decisions"):
        lines += ["", *_decisions_markdown(report["decisions"])]
    return "\n".join(lines) + "\n"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def _met(check: Mapping[str, Any] | None) -> str:
    if check is None or check["meets"] is None:
        return "—"
    return "yes" if check["meets"] else "no"


def _decisions_markdown(section: Mapping[str, Any]) -> list[str]:
    """The report's decisions tables: each measured number beside its rule's target."""
    ident, rules, checks = section["id"], section["rules"], section["id"]["checks"]
    rows = [
        f"| accuracy (calibrated argmax) | {_pct(ident['accuracy'])} | | |",
        f"| ECE before T | {_pct(ident['ece_raw'])} | | |",
        f"| ECE after T = {section['temperature']:.4g} | {_pct(ident['ece'])} | | |",
        f"| NLL before / after T | {ident['nll_raw']:.4f} / {ident['nll']:.4f} | | |",
    ]
    if rules["sets"] is not None:
        sets = rules["sets"]
        check = checks["coverage"]
        kind = sets["method"].upper() + (" class-conditional" if sets["class_conditional"] else "")
        rows += [
            f"| {kind} set coverage | {_pct(check['value'])} | >= {_pct(check['target'])} "
            f"| {_met(check)} |",
            f"| mean set size | {ident['mean_set_size']:.3f} | | |",
            f"| empty sets | {_pct(ident['empty_sets'])} | | |",
        ]
    if rules["selective"] is not None:
        rule = rules["selective"]
        check = checks["selective_risk"]
        rows += [
            f"| answered at tau = {rule['tau']:.4g} ({rule['score']}) | "
            f"{_pct(ident['answered'])} | (calibration: {_pct(rule['coverage'])}) | |",
            f"| selective risk | {_pct(check['value'])} | <= {_pct(check['target'])} "
            f"(delta {rule['delta']:g}) | {_met(check)} |",
        ]
    if rules["ood"] is not None:
        rule = rules["ood"]
        check = checks["flag_rate"]
        rows.append(
            f"| ID flagged as OOD ({rule['score']}) | {_pct(check['value'])} | "
            f"<= {_pct(check['target'])} | {_met(check)} |"
        )
    lines = [
        "## Decisions (hydra-calibrate)",
        "",
        f"On the ID data ({counted(ident['count'], 'example')}), each rule beside its target:",
        "",
        "| metric | value | target | met |",
        "|---|---:|---:|:---:|",
        *rows,
    ]
    if section["ood"]:
        lines += [
            "",
            "| OOD set | flagged as OOD | answered | mean set size |",
            "|---|---:|---:|---:|",
        ]
        for name, entry in section["ood"].items():
            size = entry.get("mean_set_size")
            lines.append(
                f"| {name} | {_pct(entry.get('flag_rate'))} | {_pct(entry.get('answered'))} | "
                f"{'—' if size is None else f'{size:.3f}'} |"
            )
    n_t, n_q = section["calibration"]["n_temperature"], section["calibration"]["n_quantile"]
    lines += [
        "",
        f"- Guarantees: {section['conventions']['guarantees']}.",
        f"- Fitted on {describe_split(n_t, n_q)}.",
    ]
    return lines


def write_report(
    report: Mapping[str, Any],
    arrays: Mapping[str, Any],
    out_dir: str | os.PathLike,
    *,
    overwrite: bool = False,
) -> Path:
    """Write ``report.json``, ``report.md``, ``reliability.png`` and ``hist_<score>.png`` per
    score into ``out_dir`` (with a ``decisions`` section, also ``risk_coverage.png`` and, with
    prediction sets, ``set_sizes.png``): built in a temporary folder beside it and renamed into
    place. An existing ``out_dir`` is refused unless ``overwrite`` (then replaced as a whole)."""
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise HydraError(f"{str(out)!r} exists; pass --overwrite to replace it")
    if out.exists() and not out.is_dir():
        raise HydraError(f"{str(out)!r} exists and is not a folder")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = staging_dir(out.parent, out.name)
    except OSError as err:
        raise HydraError(f"cannot create the report folder {out}: {err}") from err
    try:
        atomic_write_json(tmp / "report.json", dict(report))
        atomic_write_text(tmp / "report.md", markdown(report))
        plots.reliability_diagram(report["id"]["reliability"], tmp / "reliability.png")
        for score in report["scores"]:
            if score in report.get("not_applicable", {}):
                continue  # one member: every example scores 0
            plots.score_histograms(
                arrays["id"][score],
                {name: got[score] for name, got in arrays["ood"].items()},
                score,
                tmp / f"hist_{score}.png",
            )
        decided = arrays.get("decisions") if report.get("decisions") else None
        if decided is not None:
            plots.risk_coverage_curve(
                decided["confidence"],
                decided["correct"],
                tmp / "risk_coverage.png",
                target_risk=decided["target_risk"],
                tau_point=decided["tau_point"],
            )
            if decided["set_sizes"]:
                plots.set_size_histogram(
                    decided["set_sizes"], decided["classes"], tmp / "set_sizes.png"
                )
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise HydraError(f"cannot write the report folder {out}: {err}") from err
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
