"""The inputs that calibrate static INT8: a user's data read as the model's own inputs.

``hydra-export --precision int8 --int8-calib DATA`` reads DATA here, as ``hydra-eval`` and
``hydra-calibrate`` read data (:func:`~hydra_deploy.evaluation.evaluate.load_eval_data`, on
:mod:`hydra_deploy.userdata`, the one reader of user files): images preprocessed and text tokenized
by the export's own ``hydra.json`` and tokenizer, from the FP32 export staged before it is
quantized, so the activations are calibrated on exactly what ``hydra-run`` will feed. Labels are
not needed (a labelled folder or ``.tsv`` is read without them).

:func:`int8_calibration` makes the reader ``export_onnx(..., int8=Int8Options(calib=...))`` calls
with the staged folder; :func:`read_model_inputs` reads a data set with any runner.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hydra_deploy.engines.runner import load_runner
from hydra_deploy.engines.sources import model_family
from hydra_deploy.errors import DataError, spelled
from hydra_deploy.evaluation.evaluate import EvalData, load_eval_data
from hydra_deploy.export.int8 import calibration_rows
from hydra_deploy.families import Family
from hydra_deploy.options import DEFAULT_CALIBRATION_SIZE

__all__ = ["int8_calibration", "read_model_inputs", "refuse_wrong_kind"]

IMAGE_BATCH = 64  # images preprocessed at a time


def refuse_wrong_kind(data: Any, family: Family, name: str) -> None:
    """Text data for an image model and an image folder for a text model (``family``: the
    model's): say what it takes. Called by ``hydra-export`` before it builds anything."""
    if not isinstance(data, (str, os.PathLike)):
        return
    path = Path(data)
    if path.is_dir() and family.text:
        raise DataError(
            f"{name}: {path} is an image folder, but the model is a {family.name} (text) model; "
            "give a .txt/.tsv text file (one example a line) or a .npz of token ids "
            "(input_ids, attention_mask)"
        )
    if path.suffix.lower() in (".txt", ".tsv") and not family.text:
        raise DataError(
            f"{name}: {path} is text, but the model is a {family.name} model, which takes "
            "images; give an image folder or a .npz of preprocessed images (x)"
        )


def _subset(data: EvalData, rows: np.ndarray) -> EvalData:
    pick = rows.tolist()
    array = data.array
    if isinstance(array, Mapping):
        array = {key: value[rows] for key, value in array.items()}
    elif array is not None:
        array = array[rows]
    return dataclasses.replace(
        data,
        count=len(pick),
        array=array,
        images=None if data.images is None else [data.images[i] for i in pick],
        texts=None if data.texts is None else [data.texts[i] for i in pick],
        pairs=None if data.pairs is None else [data.pairs[i] for i in pick],
        labels=None,
    )


def _by_name(inputs: Any, runner: Any, name: str) -> dict[str, np.ndarray]:
    names = tuple(runner.input_names)
    if not isinstance(inputs, Mapping):
        return {names[0]: np.asarray(inputs)}
    found = {key: np.asarray(value) for key, value in inputs.items() if key in names}
    if "token_type_ids" in names and "token_type_ids" not in found and "input_ids" in found:
        found["token_type_ids"] = np.zeros_like(found["input_ids"])  # one segment
    missing = [key for key in names if key not in found]
    if missing:
        raise DataError(f"{name}: the data gives no {missing} (the model takes {list(names)})")
    return found


def read_model_inputs(
    data: Any,
    runner: Any,
    *,
    name: str = "data",
    max_examples: int | None = None,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """``data`` (what ``hydra-eval`` reads: an image folder, a ``.npz``/``.npy``, a ``.txt``/
    ``.tsv`` for text models, or arrays) as the model's inputs by name, every example at once: at
    most ``max_examples``, a seeded random subset of more (:func:`calibration_rows`). Text is
    tokenized in one call, so every row is padded to the longest."""
    refuse_wrong_kind(data, model_family(runner), name)
    table = load_eval_data(data, runner, name=name, labelled=False)
    if max_examples is not None and table.count > max_examples:
        table = _subset(table, calibration_rows(table.count, max_examples, seed))
    size = table.count if table.kind == "text" else IMAGE_BATCH
    parts = [_by_name(batch, runner, name) for batch in table.batches(runner, size)]
    return {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}


def int8_calibration(
    data: Any, *, max_examples: int = DEFAULT_CALIBRATION_SIZE, seed: int = 0, name: str = ""
) -> Callable[[Path], dict[str, np.ndarray]]:
    """The reader of ``data`` that the exporter calls with the staged FP32 export folder: its
    inputs read through that folder's runner (:func:`read_model_inputs`). ``name`` starts each
    message (default: ``--int8-calib`` in a command, ``int8 calib`` from Python)."""

    def read(folder: Path) -> dict[str, np.ndarray]:
        label = name or spelled("int8 calib", "--int8-calib")
        with load_runner(folder, providers=["CPUExecutionProvider"], decisions=False) as runner:
            return read_model_inputs(data, runner, name=label, max_examples=max_examples, seed=seed)

    read.data = data  # type: ignore[attr-defined]  # what it reads, for messages and records
    return read
