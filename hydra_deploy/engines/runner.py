"""One runner interface over ONNX Runtime sessions and TensorRT engines: :func:`load_runner`.

``load_runner(path)`` takes an export folder (``model.onnx`` + ``hydra.json``), a ``.onnx`` file or
a TensorRT engine file (``.engine``/``.plan``/``.trt``) and returns a
:class:`~hydra_deploy.engines.runner_base.Runner`::

    runner = load_runner("export/vit_b16-m3")
    outputs = runner(pixel_values)            # numpy in, dict of numpy arrays out
    scores = ensemble_scores(outputs["member_logits"])

What a path is decides how it runs: :data:`PATH_KINDS` is the table (an export folder, a
``.onnx`` file, an engine file), each kind with the function that opens it. The records beside the
model are read once, through their owner (:mod:`hydra_deploy.export_folder`): the export's
``hydra.json`` as an :class:`~hydra_deploy.export_folder.ExportInfo`, an engine's sidecar as an
:class:`~hydra_deploy.export_folder.EngineInfo`.

The runners themselves: :mod:`~hydra_deploy.engines.runner_base` (the interface, the template and
the input checks), :mod:`~hydra_deploy.engines.onnxruntime_runner` and
:mod:`~hydra_deploy.engines.tensorrt_runner`; their public names are importable from here too.

Edge runtime: this module imports numpy only; onnxruntime, tensorrt and polygraphy are imported
when a runner of that backend is made. Never torch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra_deploy.engines.onnxruntime_runner import (
    DEFAULT_PROVIDERS,
    PROVIDER_ALIASES,
    OrtRunner,
    _import_ort,  # noqa: F401  (importable from here, as before the split)
    _session_error,  # noqa: F401  (importable from here, as before the split)
    ort_tensorrt_cache_dir,
    resolve_providers,
)
from hydra_deploy.engines.runner_base import (
    BaseRunner,
    Runner,
    TensorSpec,
    _check_one,  # noqa: F401  (importable from here, as before the split)
    is_one_example,
)
from hydra_deploy.engines.tensorrt_runner import (
    TensorRTRunner,
    _compute_capability_here,  # noqa: F401  (importable from here, as before the split)
    _import_tensorrt,  # noqa: F401  (importable from here, as before the split)
    _trt_dtype,  # noqa: F401  (importable from here, as before the split)
    _trt_runner_class,  # noqa: F401  (importable from here, as before the split)
    engine_target_mismatch,
)
from hydra_deploy.errors import RunnerError
from hydra_deploy.export_folder import (
    ENGINE_SUFFIXES,
    INFO_FILE,
    MODEL_FILE,
    DecisionRecord,
    EngineInfo,
    ExportInfo,
    file_sha256,
    read_engine_info,
    read_info,
)

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

BACKENDS = {
    "onnxruntime": "onnxruntime",
    "ort": "onnxruntime",
    "tensorrt": "tensorrt",
    "trt": "tensorrt",
}


@dataclass(frozen=True)
class _Request:
    """What :func:`load_runner` was asked: the backend chosen (None: the path's own) and the
    ONNX Runtime options."""

    backend: str | None
    providers: Sequence[Any] | str | None
    threads: int | None
    decisions: bool = True  # apply the export's decisions (False: raw scores only)
    allow_decisions_mismatch: bool = False  # ... even on numbers they were not fitted on


def _attach(
    runner: BaseRunner, decisions: bool = True, allow_decisions_mismatch: bool = False
) -> BaseRunner:
    """``runner`` with the decisions its export holds (when ``decisions``), refused when fitted
    on another model file, and when fitted on other numbers (another backend, precision or
    engine file) unless ``allow_decisions_mismatch``, which applies them with a warning."""
    export = runner.export_info
    record = None if export is None or not decisions else export.decisions
    if record is not None:
        if runner.backend == "tensorrt":
            built_from = None if runner.engine_info is None else runner.engine_info.onnx_sha256
            if built_from is None:
                logger.warning(
                    "%s: cannot tell which model.onnx this engine was built from (no onnx_sha256 "
                    "in its JSON sidecar), so the decisions in %s are not applied; build the "
                    "engine with hydra-build to keep them",
                    runner.path,
                    export.path,
                )
                record = None
        else:
            built_from = file_sha256(runner.path)
        if record is not None:
            try:
                record.check_fitted_on(built_from, str(export.folder))
                warning = _check_numbers(runner, record, export, allow_decisions_mismatch)
            except RunnerError:
                runner.close()
                raise
            if warning:
                logger.warning("%s", warning)
    runner.decisions = record
    return runner


def _check_numbers(
    runner: BaseRunner, record: DecisionRecord, export: ExportInfo, allow: bool
) -> str | None:
    """Refuse ``record`` when ``runner`` gives other numbers than those it was fitted on (the
    warning to log when ``allow``; None when they are the same)."""
    if runner.backend == "tensorrt":
        precision = None if runner.engine_info is None else runner.engine_info.precision
        # the engine file is hashed only when the record names one (a TensorRT record)
        engine_sha = file_sha256(runner.path) if record.engine_sha256 is not None else None
    else:
        precision, engine_sha = export.precision, None
    return record.check_numbers(
        runner.backend,
        precision,
        engine_sha,
        folder=str(export.folder),
        engine=str(runner.path) if runner.backend == "tensorrt" else None,
        folder_precision=export.precision,
        allow_mismatch=allow,
    )


def _info_beside_onnx(onnx_path: Path, decisions: bool = True) -> ExportInfo | None:
    """hydra.json beside a .onnx file, if it describes that file (its hash is checked). When it
    does not, and the file is the folder's model.onnx while hydra.json holds decisions (and
    ``decisions``), they are refused as loading the folder refuses them."""
    info = read_info(onnx_path.parent / INFO_FILE, required=False)
    if info is None or info.onnx_sha256 is None:
        return info
    sha = file_sha256(onnx_path)
    if sha != info.onnx_sha256:
        if decisions and info.decisions is not None and onnx_path.name == MODEL_FILE:
            info.decisions.check_fitted_on(sha, str(info.folder))
        logger.warning(
            "%s describes another ONNX file than %s (hash differs); running without it",
            info.path,
            onnx_path.name,
        )
        return None
    return info


def _info_for_engine(engine_path: Path, sidecar: EngineInfo | None) -> ExportInfo | None:
    """The export's hydra.json for an engine: beside it, or where its sidecar says."""
    candidates = [engine_path.parent / INFO_FILE]
    for value in () if sidecar is None else sidecar.export_hints:
        where = Path(value)
        if not where.is_absolute():
            where = engine_path.parent / where
        candidates.append((where if where.suffix != ".onnx" else where.parent) / INFO_FILE)
    for candidate in candidates:
        info = read_info(candidate, required=False)
        if info is not None:
            return info
    return None


# --- the kinds of path, and how each runs ---------------------------------------------------------
def _open_folder(target: Path, asked: _Request) -> BaseRunner:
    if asked.backend == "tensorrt":
        engines = sorted(p for p in target.iterdir() if p.suffix in ENGINE_SUFFIXES)
        if len(engines) != 1:
            raise RunnerError(
                f"backend 'tensorrt' needs one engine file in {str(target)!r}, found "
                f"{[p.name for p in engines] or 'none'}; pass the engine file itself, or "
                "build one with hydra-build"
            )
        return _open_engine(engines[0], asked)
    onnx_path = target / MODEL_FILE
    if not onnx_path.is_file():
        raise RunnerError(
            f"{str(target)!r} is not an export folder: {MODEL_FILE} is missing (make one "
            "with hydra-export --out DIR)"
        )
    export = read_info(target / INFO_FILE, required=False)
    return OrtRunner(onnx_path, asked.providers, export=export, threads=asked.threads)


def _open_onnx(target: Path, asked: _Request) -> BaseRunner:
    if asked.backend == "tensorrt":
        raise RunnerError(
            f"{target} is an ONNX file: build a TensorRT engine from it first (hydra-build), "
            "or run it in ONNX Runtime with providers=['tensorrt']"
        )
    export = _info_beside_onnx(target, asked.decisions)
    return OrtRunner(target, asked.providers, export=export, threads=asked.threads)


def _open_engine(target: Path, asked: _Request) -> BaseRunner:
    if asked.backend == "onnxruntime":
        raise RunnerError(
            f"{target} is a TensorRT engine; ONNX Runtime runs the .onnx file it was built from"
        )
    if asked.providers is not None:
        raise RunnerError("providers are ONNX Runtime's; a TensorRT engine takes none")
    sidecar = read_engine_info(target)
    export = _info_for_engine(target, sidecar)
    return TensorRTRunner(target, export=export, engine_info=sidecar)


@dataclass(frozen=True)
class PathKind:
    """A kind of path :func:`load_runner` takes: what it is called, whether a path is one, and
    the function that opens it."""

    name: str
    matches: Callable[[Path], bool]
    open: Callable[[Path, _Request], BaseRunner]


#: The kinds of path :func:`load_runner` takes, tried in order; a new kind adds a row.
PATH_KINDS: tuple[PathKind, ...] = (
    PathKind("export folder", Path.is_dir, _open_folder),
    PathKind(".onnx file", lambda p: p.suffix.lower() == ".onnx", _open_onnx),
    PathKind("engine file", lambda p: p.suffix.lower() in ENGINE_SUFFIXES, _open_engine),
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

    ``backend``: ``"onnxruntime"`` (``"ort"``) or ``"tensorrt"`` (``"trt"``); by default a folder
    or ``.onnx`` runs in ONNX Runtime and an ``.engine``/``.plan``/``.trt`` file in TensorRT (a
    folder with ``backend="tensorrt"`` runs the one engine file inside it). ``providers``: ONNX
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
    if backend is not None and str(backend).lower() not in BACKENDS:
        raise RunnerError(f"unknown backend {backend!r}; use 'onnxruntime' or 'tensorrt'")
    chosen = BACKENDS.get(str(backend).lower()) if backend is not None else None
    if not target.exists():
        raise RunnerError(
            f"{str(target)!r} does not exist; give an export folder (hydra-export --out), a .onnx "
            "file or a TensorRT engine file (.engine/.plan)"
        )
    asked = _Request(chosen, providers, threads, decisions, allow_decisions_mismatch)
    for kind in PATH_KINDS:
        if kind.matches(target):
            return _attach(kind.open(target, asked), decisions, allow_decisions_mismatch)
    raise RunnerError(
        f"cannot tell how to run {str(target)!r}: expected an export folder, a .onnx file or an "
        f"engine file ({', '.join(ENGINE_SUFFIXES)})"
    )
