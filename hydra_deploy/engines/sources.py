"""Model inputs from files: the one reader of INPUT arguments, and the one way to batch them.

``hydra-run``, ``hydra-score-dataset`` and ``hydra-eval`` take the same kinds of input, read by the
same rules here:

- image files and folders of images (searched recursively, sorted), for image models; they are
  preprocessed from the export's ``hydra.json`` (:mod:`hydra_deploy.engines.preprocess`);
- ``.txt`` files, one input per non-empty line, and ``.tsv`` files (``label<TAB>text``, or
  ``label<TAB>text<TAB>second text`` for sentence pairs; the labels are not read), for text models
  (tokenized with the export's tokenizer, :mod:`hydra_deploy.engines.text`);
- ``.npy``/``.npz`` arrays of preprocessed inputs (which arrays of a ``.npz`` feed the model:
  :func:`~hydra_deploy.engines.inputs.pick_inputs`), where the command takes them.

:func:`read_source` sorts one argument into a :class:`Source`; :func:`iter_batches` and
:func:`prepare` turn examples into the model's inputs; :func:`score_inputs` is hydra-run's loop
(files in, one result per example out), callable from Python.

Files are read by :mod:`hydra_deploy.userdata`, the one reader of user data (fine-tuning, head
selection, ``hydra-eval`` and ``hydra-calibrate`` read through it too). numpy only (edge-safe).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hydra_deploy.arrays import read_array_file
from hydra_deploy.engines.inputs import pick_inputs
from hydra_deploy.engines.preprocess import (
    UnreadableImageError,
    check_config,
    preprocess_image,
    preprocess_images,
)
from hydra_deploy.engines.runner_base import Runner, is_one_example
from hydra_deploy.engines.scoring import score_batch
from hydra_deploy.errors import DataError, RunnerError, counted, spelled
from hydra_deploy.families import Family, get_family
from hydra_deploy.labels import folder_class_indices
from hydra_deploy.uncertainty import SCALAR_SCORES
from hydra_deploy.userdata import IMAGE_SUFFIXES, TEXT_FILE_SUFFIXES, find_images, read_text_file

if TYPE_CHECKING:
    from hydra_deploy.monitor import Monitor

__all__ = [
    "ARRAY",
    "ARRAY_SUFFIXES",
    "IMAGES",
    "MONITOR_FIELDS",
    "TEXT",
    "TEXT_SUFFIXES",
    "Source",
    "iter_batches",
    "model_family",
    "prepare",
    "read_arrays",
    "read_source",
    "read_sources",
    "score_inputs",
    "with_batch_axis",
]

log = logging.getLogger("hydra_deploy")

IMAGES, TEXT, ARRAY = "images", "text", "array"
ARRAY_SUFFIXES = (".npy", ".npz")
#: files that hold text: a text model reads ``.txt`` (one input per line) and ``.tsv`` (label<TAB>
#: text[<TAB>second text]); the others are refused with that advice, as are all of them for an
#: image model
TEXT_SUFFIXES = (".txt", ".csv", ".tsv", ".jsonl", ".json")


@dataclass
class Source:
    """The examples of one INPUT argument: image paths, text lines (``(text, second text)``
    tuples for sentence pairs) or arrays, and their names (``images/cat.jpg``, ``lines.txt:3``,
    ``batch.npy[0]``). ``classes``: for a folder whose images all lie in sub-folders
    (``images/cat/1.jpg``), the sub-folder of each image, its true class by the folder layout
    (None otherwise)."""

    kind: str  # IMAGES | TEXT | ARRAY
    names: list[str]
    items: list[Path] | list[str] | list[tuple[str, str]] | np.ndarray | dict[str, np.ndarray]
    classes: list[str] | None = None
    path: Path | None = None  # the INPUT argument

    def __len__(self) -> int:
        return len(self.names)


def model_family(runner: Runner) -> Family:
    """The family of a runner's model (an ONNX file without its hydra.json: an image model)."""
    return get_family(getattr(runner, "family", None) or "vit")


def with_batch_axis(array: np.ndarray, runner: Runner) -> np.ndarray:
    """``array``, with a batch axis added when it is one example of the model's first input."""
    inputs = getattr(runner, "inputs", None)
    if inputs and is_one_example(inputs[0], array.shape):
        return array[None]
    return array


def read_arrays(
    path: Path, runner: Runner, *, error: type[Exception] = RunnerError, prefix: str = ""
) -> np.ndarray | dict[str, np.ndarray]:
    """The model's inputs in a ``.npy``/``.npz`` file (a ``.npz``'s arrays picked by
    :func:`~hydra_deploy.engines.inputs.pick_inputs`)."""
    data: Any = read_array_file(
        path,
        error=error,
        prefix=prefix,
        hint="give a complete .npy (np.save) or .npz (np.savez) of preprocessed numeric arrays",
    )
    if isinstance(data, dict):
        return pick_inputs(data, tuple(getattr(runner, "input_names", ()) or ()), str(path))
    return with_batch_axis(data, runner)


def _count(data: np.ndarray | dict[str, np.ndarray]) -> tuple[int, tuple[int, ...]]:
    first = next(iter(data.values())) if isinstance(data, dict) else data
    return (len(first) if first.ndim else 0), first.shape


def read_source(
    path: str | os.PathLike,
    family: Family,
    *,
    model: str = "MODEL",
    runner: Runner | None = None,
    arrays_elsewhere: str | None = None,
) -> Source:
    """One INPUT argument as a :class:`Source`; a :class:`RunnerError` for what the model cannot
    take. ``model`` names the model argument in messages; ``runner`` (its inputs) is needed to
    read arrays, and without it an array file is refused with ``arrays_elsewhere`` (the advice)."""
    path = Path(path)
    suffix = path.suffix.lower()
    takes_arrays = runner is not None
    if not path.exists():
        raise RunnerError(f"input {str(path)!r} does not exist")
    if path.is_dir() or suffix in IMAGE_SUFFIXES:
        if family.input_kind != IMAGES:
            raise RunnerError(
                f"{path}: images need a vision model; {model} is a {family.name} model (give "
                + (".txt files or .npy/.npz token ids)" if takes_arrays else ".txt files)")
            )
        images = find_images([path])
        classes = _class_folders(path, images) if path.is_dir() else None
        return Source(IMAGES, [str(p) for p in images], images, classes, path)
    if suffix in ARRAY_SUFFIXES:
        if not takes_arrays:
            raise RunnerError(f"{path}: {arrays_elsewhere or 'array files are not read here'}")
        data = read_arrays(path, runner)
        count, shape = _count(data)
        if count == 0:
            raise RunnerError(
                f"the array file {path} holds no examples (shape {shape}); give 1 or more examples"
            )
        return Source(ARRAY, [f"{path}[{i}]" for i in range(count)], data)
    if suffix in TEXT_FILE_SUFFIXES and family.text:
        items = read_text_file(path, error=RunnerError).items
        return Source(TEXT, [f"{path}:{i}" for i in range(1, len(items) + 1)], items)
    if suffix in TEXT_SUFFIXES:
        if family.text:
            what = (
                "text models read .txt files (one input per line) and .tsv files "
                "(label<TAB>text, or label<TAB>text<TAB>second text)"
            )
        elif takes_arrays:
            what = (
                f"text inputs are for text models; {model} is a {family.name} model taking "
                f"{runner.inputs[0].describe()}: give image files, folders or preprocessed "
                ".npy/.npz arrays"
            )
        else:
            what = (
                f"text inputs are for text models; {model} is a {family.name} model: give image "
                "files or folders"
            )
        raise RunnerError(f"{path} looks like text: {what}")
    if family.text:
        wanted = ".txt files (one input per line)" + (
            ", or .npy/.npz arrays of token ids" if takes_arrays else ""
        )
    else:
        images = f"image files ({', '.join(IMAGE_SUFFIXES)})"
        wanted = (
            f"{images}, folders of images, or .npy/.npz arrays"
            if takes_arrays
            else f"{images} or folders of images"
        )
    raise RunnerError(f"cannot tell what {str(path)!r} is: give {wanted}")


def _class_folders(folder: Path, images: Sequence[Path]) -> list[str] | None:
    """The sub-folder of ``folder`` each image lies in, when every image lies in one (the labelled
    layout hydra-eval and hydra-calibrate read: ``folder/cat/1.jpg``); else None."""
    parts = [image.relative_to(folder).parts for image in images]
    return [p[0] for p in parts] if all(len(p) > 1 for p in parts) else None


def read_sources(
    paths: Sequence[str | os.PathLike],
    family: Family,
    *,
    model: str = "MODEL",
    runner: Runner | None = None,
    arrays_elsewhere: str | None = None,
) -> list[Source]:
    """:func:`read_source` of each INPUT argument, in order."""
    return [
        read_source(path, family, model=model, runner=runner, arrays_elsewhere=arrays_elsewhere)
        for path in paths
    ]


def prepare(runner: Runner, kind: str, items: Any, encoder: Any = None) -> Any:
    """The model's inputs for a batch of examples of one kind: image paths preprocessed from the
    export's config, texts tokenized (``encoder``: the runner's, made once by the caller), arrays
    as they are."""
    if kind == IMAGES:
        return preprocess_images(items, runner.preprocessing)
    if kind == TEXT:
        return (encoder or runner.text_encoder())(items)
    return items


def iter_batches(runner: Runner, kind: str, items: Any, size: int) -> Iterator[tuple[slice, Any]]:
    """``(rows, model inputs)`` for consecutive batches of at most ``size`` examples."""
    encoder = runner.text_encoder() if kind == TEXT else None  # one tokenizer for every batch
    count = len(next(iter(items.values()))) if isinstance(items, Mapping) else len(items)
    for start in range(0, count, size):
        rows = slice(start, min(start + size, count))
        if isinstance(items, Mapping):
            chunk: Any = {name: value[rows] for name, value in items.items()}
        else:
            chunk = items[rows]
        yield rows, prepare(runner, kind, chunk, encoder)


def _finite_or_none(value: float) -> float | None:
    return float(value) if np.isfinite(value) else None


def _decision_fields(
    scores: Mapping[str, np.ndarray], row: int, names: Sequence[str] | None
) -> dict[str, Any]:
    """``confidence``, ``prediction_set``, ``accept`` and ``ood_flag`` of one example, for the
    decisions the scores hold (none without decisions). The set lists class names when the model
    has them, else class indices."""
    if "confidence" not in scores:
        return {}
    fields: dict[str, Any] = {"confidence": _finite_or_none(scores["confidence"][row])}
    if "prediction_set" in scores:
        members = np.flatnonzero(scores["prediction_set"][row]).tolist()
        fields["prediction_set"] = [names[c] for c in members] if names else members
    for name in ("accept", "ood_flag"):
        if name in scores:
            fields[name] = bool(scores[name][row])
    return fields


def _all_sources(
    runner: Runner, paths: Sequence[str | os.PathLike], texts: Sequence[str] | None
) -> list[Source]:
    """The INPUT arguments and ``texts`` as sources, refusing what the runner cannot take."""
    family = model_family(runner)
    sources = read_sources(paths, family, runner=runner)
    if texts:
        if not family.text:
            raise RunnerError(
                f"--text needs a text model; MODEL is a {runner.family} model, which takes "
                "images: give image files or folders as INPUT instead"
            )
        sources.append(Source(TEXT, [f"text[{i}]" for i in range(len(texts))], list(texts)))
    if not sources:
        raise RunnerError("nothing to run: give INPUT files or --text")
    if any(s.kind == IMAGES for s in sources) and not runner.preprocessing:
        raise RunnerError(
            f"{runner.path} comes without its hydra.json, so images cannot be preprocessed for it: "
            "run the export folder (or keep hydra.json beside the file), or pass .npy/.npz arrays"
        )
    return sources


_SKIP_ADVICE = (
    "pass skipped=[] to skip such files and collect them",
    "pass --skip-unreadable to skip such files and report them",
)


def _batches(
    runner: Runner, source: Source, size: int, skipped: list[dict[str, str]] | None
) -> Iterator[tuple[list[int], Any]]:
    """``(the source's rows in the batch, model inputs)`` for consecutive batches of at most
    ``size`` examples. With ``skipped`` (a list), an image that cannot be decoded is logged, added
    to it and left out of its batch; without, it stops the run with the advice to skip it."""
    if source.kind != IMAGES or skipped is None:
        try:
            for rows, batch in iter_batches(runner, source.kind, source.items, size):
                yield list(range(rows.start, rows.stop)), batch
        except UnreadableImageError as err:
            raise UnreadableImageError(
                f"{err}; {spelled(*_SKIP_ADVICE)}", err.path, err.reason
            ) from err
        return
    check_config(runner.preprocessing)
    for start in range(0, len(source), size):
        kept, arrays = [], []
        for row in range(start, min(start + size, len(source))):
            try:
                arrays.append(preprocess_image(source.items[row], runner.preprocessing))
            except UnreadableImageError as err:
                log.warning("skipped %s: cannot read it as an image: %s", err.path, err.reason)
                skipped.append({"input": source.names[row], "reason": err.reason})
                continue
            kept.append(row)
        if kept:
            yield kept, np.stack(arrays)


def _true_classes(source: Source, runner: Runner, num_classes: int) -> list[int | None]:
    """The class index of each of ``source``'s class sub-folders, by the folder rule of
    :func:`hydra_deploy.labels.folder_class_indices` (the one hydra-eval reads labelled folders
    with); Nones, said once, when the sub-folders are not the model's classes."""
    assert source.classes is not None
    names = sorted(set(source.classes))
    try:
        indices, _ = folder_class_indices(
            names, runner.class_names, num_classes, source=str(source.path), error=DataError
        )
    except DataError as err:
        log.info("true_class is null for the images of %s: %s", source.path, err)
        return [None] * len(source)
    index = dict(zip(names, indices, strict=True))
    return [index[name] for name in source.classes]


def _result(
    name: str,
    scores: Mapping[str, np.ndarray],
    row: int,
    names: Sequence[str] | None,
    top: np.ndarray | None,
    probs: np.ndarray,
) -> dict[str, Any]:
    """One example's result (row ``row`` of a batch's ``scores``)."""
    prediction = int(scores["prediction"][row])
    predicted_name = names[prediction] if names and prediction >= 0 else None
    result: dict[str, Any] = {
        "input": name,
        "prediction": prediction,
        "predicted_name": predicted_name,
        "label": predicted_name,  # predicted_name's old name, kept for one release
    }
    result.update({s: _finite_or_none(scores[s][row]) for s in SCALAR_SCORES})
    result.update(_decision_fields(scores, row, names))
    if top is not None:
        result["top_k"] = [
            {
                "class": int(c),
                "label": names[c] if names else None,
                "prob": _finite_or_none(probs[row, c]),
            }
            for c in top[row]
        ]
    return result


#: what ``monitor=`` adds to each result: the monitored score and set mass the monitor consumed
#: (what hydra-monitor replays), then the drift test's p-value, martingale and alarm
MONITOR_FIELDS = {  # field -> the monitor's column
    "monitor_score": "scores",
    "monitor_set_mass": "set_mass",
    "monitor_pvalue": "pvalue",
    "monitor_martingale": "martingale",
    "monitor_alarm": "alarm",
}


def _watched(monitor: Monitor, member_logits: np.ndarray) -> list[dict[str, Any]]:
    """Feed one batch's member logits to ``monitor``, in order; the monitor's fields per row."""
    columns = monitor.columns(member_logits)
    out = {**columns, **monitor.observe(**columns)}
    fields = [(field, out[column]) for field, column in MONITOR_FIELDS.items() if column in out]
    return [
        {
            field: bool(values[row]) if values.dtype == bool else float(values[row])
            for field, values in fields
        }
        for row in range(len(member_logits))
    ]


def score_inputs(
    runner: Runner,
    paths: Sequence[str | os.PathLike],
    batch_size: int | None = None,
    top_k: int = 1,
    texts: Sequence[str] | None = None,
    allow_nonfinite: bool = False,
    decisions: bool = True,
    skipped: list[dict[str, str]] | None = None,
    monitor: Monitor | None = None,
) -> list[dict[str, Any]]:
    """Run ``runner`` over the INPUT paths (and ``texts``, for a text model); one result dict per
    example, in input order: ``input``, ``prediction`` (the class index), ``predicted_name`` (its
    class name; None for a model without names), ``label`` (the same as ``predicted_name``, its
    old name, kept for one release) and every scalar score (and ``top_k`` when ``top_k`` > 1).
    Images in a folder of class sub-folders (``images/cat/1.jpg``) also get their true class:
    ``true_name`` (the sub-folder) and ``true_class`` (its index, by the rule hydra-eval reads
    labelled folders with; None when the sub-folders are not the model's classes); when any
    input has them, every result has both keys (None elsewhere). When the runner holds decisions
    (and ``decisions``): ``confidence`` (the calibrated max probability), ``prediction_set``
    (class names, or indices for a model without names), ``accept`` and ``ood_flag``, for the
    rules the record holds; the prediction and ``top_k`` are then those of the calibrated
    probabilities.

    ``allow_nonfinite``: run inputs holding NaN/inf and pass non-finite logits through; such an
    example gets prediction -1 and None for every score (null in JSON, empty in CSV).
    ``skipped``: a list to collect the images that cannot be decoded (a truncated file, a text
    file named ``x.png``) into, ``{"input": ..., "reason": ...}`` each, while the run goes on
    (each is logged as a warning, and their count at the end); None: such an image stops the run
    with an error naming it.

    ``monitor``: a :class:`~hydra_deploy.monitor.Monitor` made from the runner's decisions
    record (``Monitor.from_record``), fed each batch's member logits in input order; each result
    then also has the fields of :data:`MONITOR_FIELDS` (``monitor_set_mass`` where the record
    holds sets)."""
    sources = _all_sources(runner, paths, texts)
    size = batch_size or runner.max_batch or 32
    names = runner.class_names
    results: list[dict[str, Any]] = []
    skipped_before = len(skipped) if skipped is not None else 0
    labelled = any(source.classes is not None for source in sources)
    for source in sources:
        truth: list[int | None] | None = None
        for rows, batch in _batches(runner, source, size, skipped):
            scores = score_batch(
                runner,
                batch,
                batch_size=batch_size,
                allow_nonfinite=allow_nonfinite,
                decisions=decisions,
            )
            probs = scores.get("calibrated_probs", scores["probs"])
            k = max(1, min(top_k, probs.shape[1]))
            top = np.argsort(-probs, axis=1, kind="stable")[:, :k] if top_k > 1 else None
            if source.classes is not None and truth is None:
                truth = _true_classes(source, runner, probs.shape[1])
            watched = None if monitor is None else _watched(monitor, scores["member_logits"])
            for position, row in enumerate(rows):
                result = _result(source.names[row], scores, position, names, top, probs)
                if watched is not None:
                    result.update(watched[position])
                if labelled:
                    result["true_class"] = truth[row] if truth is not None else None
                    result["true_name"] = source.classes[row] if source.classes else None
                results.append(result)
    if skipped:
        _said_skipped(len(skipped) - skipped_before, sum(len(s) for s in sources), bool(results))
    return results


def _said_skipped(count: int, total: int, any_read: bool) -> None:
    """The count of the images skipped as unreadable, after their warnings."""
    if not count:
        return
    if not any_read:
        raise RunnerError(
            f"none of the {counted(total, 'image')} could be read (see the warnings above)"
        )
    log.warning(
        "skipped %s of %d; see the warnings above", counted(count, "unreadable file"), total
    )
