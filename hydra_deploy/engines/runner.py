"""One runner interface over ONNX Runtime sessions and TensorRT engines: :func:`load_runner`.

``load_runner(path)`` takes an export folder (``model.onnx`` + ``hydra.json``), a ``.onnx`` file or
a TensorRT engine file (``.engine``/``.plan``/``.trt``) and returns a
:class:`~hydra_deploy.engines.runner_base.Runner`::

    runner = load_runner("export/vit_b16-m3")
    outputs = runner(pixel_values)            # numpy in, dict of numpy arrays out
    scores = ensemble_scores(outputs["member_logits"])

What a path is (:data:`PATH_KINDS`: an export folder, a ``.onnx`` file, an engine file) picks the
backend that runs it, unless one is asked for; each backend is one row of :data:`BACKENDS`
(:mod:`~hydra_deploy.engines.backends`: its name and aliases, runner class, the kinds of path it
opens and how it proves which model.onnx it runs), and a new one is registered with
:func:`~hydra_deploy.engines.backends.register_backend`. The records beside the model are read
once, through their owner (:mod:`hydra_deploy.export_folder`): the export's ``hydra.json`` as an
:class:`~hydra_deploy.export_folder.ExportInfo`, an engine's sidecar as an
:class:`~hydra_deploy.export_folder.EngineInfo`.

The runners themselves: :mod:`~hydra_deploy.engines.runner_base` (the interface, the template and
the input checks), :mod:`~hydra_deploy.engines.onnxruntime_runner` and
:mod:`~hydra_deploy.engines.tensorrt_runner`; their public names are importable from here too.

Edge runtime: this module imports numpy only; onnxruntime, tensorrt and polygraphy are imported
when a runner of that backend is made. Never torch.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra_deploy.engines.backends import (
    BACKENDS,
    PATH_KINDS,
    Backend,
    PathKind,
    RunRequest,
    get_backend,
    path_kinds,
)
from hydra_deploy.engines.onnxruntime_runner import (
    DEFAULT_PROVIDERS,
    PROVIDER_ALIASES,
    OrtRunner,
    ort_tensorrt_cache_dir,
    resolve_providers,
)
from hydra_deploy.engines.runner_base import BaseRunner, Runner, TensorSpec, is_one_example
from hydra_deploy.engines.tensorrt_runner import TensorRTRunner, engine_target_mismatch
from hydra_deploy.errors import RunnerError
from hydra_deploy.export_folder import ENGINE_SUFFIXES, DecisionRecord, ExportInfo

__all__ = [
    "BACKENDS",
    "DEFAULT_PROVIDERS",
    "ENGINE_SUFFIXES",
    "PATH_KINDS",
    "PROVIDER_ALIASES",
    "BaseRunner",
    "OrtRunner",
    "PathKind",
    "Runner",
    "TensorRTRunner",
    "TensorSpec",
    "engine_target_mismatch",
    "is_one_example",
    "load_runner",
    "ort_tensorrt_cache_dir",
    "resolve_providers",
]

logger = logging.getLogger("hydra_deploy")

#: Private names that lived here before the runners were split, and the module that has them now.
_MOVED = {
    name: module
    for module, names in (
        ("onnxruntime_runner", ("_import_ort", "_session_error")),
        ("runner_base", ("_check_one",)),
        (
            "tensorrt_runner",
            ("_compute_capability_here", "_import_tensorrt", "_trt_dtype", "_trt_runner_class"),
        ),
    )
    for name in names
}


def __getattr__(name: str) -> Any:
    """The names of :data:`_MOVED`, importable from here as before the split."""
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"hydra_deploy.engines.{_MOVED[name]}"), name)


def _attach(
    backend: Backend,
    runner: BaseRunner,
    decisions: bool = True,
    allow_decisions_mismatch: bool = False,
) -> BaseRunner:
    """``runner`` with the decisions its export holds (when ``decisions``), refused when fitted
    on another model file, and when fitted on other numbers (another backend, precision or
    engine file) unless ``allow_decisions_mismatch``, which applies them with a warning. Which
    model file and which numbers: as ``backend``'s row proves them (:attr:`Backend.proof`).
    ``runner.backend`` becomes the row's name (one runner class may serve several rows)."""
    runner.backend = backend.name
    export = runner.export_info
    record = None if export is None or not decisions else export.decisions
    if record is not None:
        built_from = backend.proof.model_sha256(runner)
        if built_from is None:
            logger.warning("%s", backend.proof.unknown_model(runner, export))
            record = None
        else:
            try:
                record.check_fitted_on(built_from, str(export.folder))
                warning = _check_numbers(backend, runner, record, export, allow_decisions_mismatch)
            except RunnerError:
                runner.close()
                raise
            if warning:
                logger.warning("%s", warning)
    runner.decisions = record
    return runner


def _check_numbers(
    backend: Backend, runner: BaseRunner, record: DecisionRecord, export: ExportInfo, allow: bool
) -> str | None:
    """Refuse ``record`` when ``runner`` gives other numbers than those it was fitted on (the
    warning to log when ``allow``; None when they are the same)."""
    proof = backend.proof
    # the file run is hashed only when the record names one (an engine's record)
    file_sha = proof.file_sha256(runner) if record.engine_sha256 is not None else None
    return record.check_numbers(
        backend.records_as,
        proof.precision(runner),
        file_sha,
        folder=str(export.folder),
        engine=str(runner.path) if proof.binds_file else None,
        folder_precision=export.precision,
        allow_mismatch=allow,
    )


def _kind_of(target: Path) -> PathKind:
    for kind in path_kinds():
        if kind.matches(target):
            return kind
    raise RunnerError(
        f"cannot tell how to run {str(target)!r}: expected an export folder, a .onnx file or an "
        f"engine file ({', '.join(ENGINE_SUFFIXES)})"
    )


def load_runner(
    path: str | os.PathLike,
    backend: str | None = None,
    providers: Sequence[Any] | str | None = None,
    *,
    threads: int | None = None,
    decisions: bool = True,
    allow_decisions_mismatch: bool = False,
) -> BaseRunner:
    """A :class:`Runner` for an export folder, a ``.onnx`` file or a TensorRT engine file.

    ``backend``: a name or alias of :data:`BACKENDS`: ``"onnxruntime"`` (``"ort"``) or
    ``"tensorrt"`` (``"trt"``), or one registered since; by default a folder or ``.onnx`` runs
    in ONNX Runtime and an ``.engine``/``.plan``/``.trt`` file in TensorRT (a folder with
    ``backend="tensorrt"`` runs the one engine file inside it). ``providers``: ONNX
    Runtime execution providers (names, short names or ``(name, options)`` pairs; default CUDA
    then CPU, whichever this build has). ``threads``: ONNX Runtime's intra-op threads. The
    export's ``hydra.json`` (and an engine's ``<stem>.json`` sidecar) become
    ``runner.export_info`` / ``runner.engine_info``. The decisions an export holds
    (``hydra-calibrate``) become ``runner.decisions``, refused when they were fitted on another
    model file (``decisions=False`` leaves them out: raw scores only), and when they were fitted
    on other numbers than this runner's: another backend (ONNX Runtime / TensorRT), precision or
    engine file. ``allow_decisions_mismatch=True`` applies those anyway, with a warning that
    their guarantees do not cover these numbers (another model file is refused still).
    """
    target = Path(path)
    chosen = None if backend is None else get_backend(backend)
    if not target.exists():
        raise RunnerError(
            f"{str(target)!r} does not exist; give an export folder (hydra-export --out), a .onnx "
            "file or a TensorRT engine file (.engine/.plan)"
        )
    kind = _kind_of(target)
    row = chosen if chosen is not None else get_backend(kind.default_backend)
    asked = RunRequest(row.name, providers, threads, decisions, allow_decisions_mismatch)
    return _attach(row, row.open(kind, target, asked), decisions, allow_decisions_mismatch)
