"""TensorRT runner: an engine file run through Polygraphy's ``TrtRunner``, filling in
:class:`~hydra_deploy.engines.runner_base.BaseRunner`.

The engine is deserialized with the TensorRT Python API (its I/O tensors and optimization profile
give the input specs and batch range) and run through Polygraphy's ``TrtRunner``, which sets the
input shapes, binds device buffers and calls ``execute_async_v3`` for us (Polygraphy 0.49.9 and
later use only that call; TensorRT has it from 8.5), on TensorRT 8.6, JetPack 6 (8.6.2 or 10.3),
10.x and 11 alike. Before TensorRT is asked, the engine's sidecar
(:class:`~hydra_deploy.export_folder.EngineInfo`) is compared with the TensorRT release and GPU at
hand (:func:`engine_target_mismatch`). Needs ``tensorrt`` and ``polygraphy`` (the ``[trt]`` extra).

Its row in the backend registry (:data:`TENSORRT`, ``"tensorrt"`` or ``"trt"``) opens an engine
file (``.engine``/``.plan``/``.trt``) and an export folder holding one engine, with the export's
``hydra.json`` found beside it or where its sidecar says.

Edge runtime: numpy only at import; tensorrt and polygraphy are imported when a runner is made.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hydra_deploy.engines.backends import (
    RUNS_BUILT_ENGINE,
    Backend,
    RunRequest,
    register_backend,
)
from hydra_deploy.engines.gpu import compute_capability_here
from hydra_deploy.engines.runner_base import BaseRunner, TensorSpec
from hydra_deploy.errors import RunnerError
from hydra_deploy.export_folder import (
    ENGINE_SUFFIXES,
    INFO_FILE,
    EngineInfo,
    ExportInfo,
    read_engine_info,
    read_info,
)
from hydra_deploy.optional import require

__all__ = ["TENSORRT", "TensorRTRunner", "engine_target_mismatch"]


def _import_tensorrt():
    return require(
        "tensorrt",
        purpose="running TensorRT engines (on an NVIDIA GPU)",
        error=RunnerError,
        extra_hint="or run the .onnx file with ONNX Runtime instead: load_runner('EXPORT_DIR') / "
        "hydra-run EXPORT_DIR",
    )


def _trt_runner_class():
    poly_trt = require(
        "polygraphy.backend.trt", purpose="running TensorRT engines", error=RunnerError
    )
    return poly_trt.TrtRunner


# TensorRT DataType members numpy has no type for (tensorrt.nptype raises TypeError on them)
_TRT_ONLY_TYPES = {"BF16": "bfloat16", "FP8": "float8", "INT4": "int4", "FP4": "float4"}


def _trt_dtype(trt: Any, dtype: Any) -> str:
    """A TensorRT DataType as a numpy dtype name; ``bfloat16`` for BF16 (which numpy lacks), so
    that the input check says so instead of numpy failing on ``bf16``."""
    try:
        return np.dtype(trt.nptype(dtype)).name
    except (TypeError, ValueError):
        name = str(getattr(dtype, "name", None) or str(dtype).rsplit(".", 1)[-1]).upper()
        return _TRT_ONLY_TYPES.get(name, name.lower())


def engine_target_mismatch(
    sidecar: EngineInfo | Mapping[str, Any] | None,
    tensorrt_version: str | None,
    compute_capability: str | None,
) -> str | None:
    """Why an engine cannot run here, from its JSON sidecar, before TensorRT is asked; None when
    the sidecar matches (or says nothing). Engines are built without version or hardware
    compatibility, so they need the TensorRT release (major.minor.patch) and the GPU compute
    capability they were built with. A value unknown here (None) is not compared."""
    if isinstance(sidecar, Mapping):
        sidecar = EngineInfo.from_record(dict(sidecar), "the engine's JSON sidecar")
    if not isinstance(sidecar, EngineInfo):
        return None
    problems = []
    built = sidecar.tensorrt_version
    if (
        isinstance(built, str)
        and tensorrt_version is not None
        and built.split(".")[:3] != str(tensorrt_version).split(".")[:3]
    ):
        problems.append(f"TensorRT {built} (this machine has {tensorrt_version})")
    built_cc = sidecar.compute_capability
    if (
        isinstance(built_cc, str)
        and compute_capability is not None
        and built_cc != compute_capability
    ):
        name = sidecar.gpu_name or "a GPU"
        problems.append(
            f"{name} of compute capability {built_cc} (this GPU has {compute_capability})"
        )
    if not problems:
        return None
    return (
        f"it was built for {' and '.join(problems)}: engines only run on the TensorRT version and "
        "GPU they were built with; rebuild it here with hydra-build EXPORT_DIR"
    )


def _compute_capability_here() -> str | None:
    return compute_capability_here()  # (a name of this module: tests replace it)


class TensorRTRunner(BaseRunner):
    """A TensorRT engine run through Polygraphy's ``TrtRunner`` (see the module docstring)."""

    backend = "tensorrt"

    def __init__(
        self,
        engine_path: Path,
        *,
        export: ExportInfo | None = None,
        engine_info: EngineInfo | None = None,
        profile: int = 0,
    ) -> None:
        trt = _import_tensorrt()
        runner_class = _trt_runner_class()
        mismatch = engine_target_mismatch(
            engine_info, getattr(trt, "__version__", None), _compute_capability_here()
        )
        if mismatch:
            raise RunnerError(f"cannot run the engine {engine_path}: {mismatch}")
        self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        try:
            engine = self._runtime.deserialize_cuda_engine(Path(engine_path).read_bytes())
        except Exception as err:  # older bindings raise, newer return None
            engine, cause = None, err
        else:
            cause = None
        if engine is None:
            raise RunnerError(
                f"TensorRT cannot load the engine {engine_path}"
                + (f" ({cause})" if cause else "")
                + ": engines only run on the TensorRT version and GPU they were built with; "
                "rebuild it here with hydra-build EXPORT_DIR"
            )
        self.engine = engine
        inputs, outputs = [], []
        for index in range(engine.num_io_tensors):
            name = engine.get_tensor_name(index)
            shape = tuple(int(d) if d >= 0 else None for d in engine.get_tensor_shape(name))
            spec = TensorSpec(name, shape, _trt_dtype(trt, engine.get_tensor_dtype(name)))
            is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
            (inputs if is_input else outputs).append(spec)
        if not inputs:
            raise RunnerError(f"the engine {engine_path} has no inputs")
        first = inputs[0]
        if first.shape and first.shape[0] is None:  # dynamic batch: the profile bounds it
            low, _, high = engine.get_tensor_profile_shape(first.name, profile)
            min_batch, max_batch = int(low[0]), int(high[0])
        else:
            min_batch = max_batch = int(first.shape[0])
        super().__init__(
            engine_path,
            inputs,
            outputs,
            providers=("TensorRT",),
            min_batch=min_batch,
            max_batch=max_batch,
            export=export,
            engine_info=engine_info,
        )
        self._trt_runner = runner_class(engine, optimization_profile=profile)
        try:
            self._trt_runner.activate()
        except Exception as err:
            raise RunnerError(
                f"TensorRT cannot create an execution context for {engine_path}: {err}"
            ) from err

    def _batch_source(self) -> str:
        return "its engine profile"

    def _run(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            values = self._trt_runner.infer(feed, check_inputs=False)
        except Exception as err:
            raise RunnerError(f"TensorRT failed to run {self.path}: {err}") from err
        # TrtRunner reuses its host buffers between calls: copy
        return {name: np.array(values[name], copy=True) for name in self.output_names}

    def close(self) -> None:
        runner = getattr(self, "_trt_runner", None)
        if runner is not None and runner.is_active:
            runner.deactivate()


# --- the backend's row ---------------------------------------------------------------------------
def _export_for_engine(engine_path: Path, sidecar: EngineInfo | None) -> ExportInfo | None:
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


def _open_engine(target: Path, asked: RunRequest) -> TensorRTRunner:
    if asked.providers is not None:
        raise RunnerError("providers are ONNX Runtime's; a TensorRT engine takes none")
    sidecar = read_engine_info(target)
    return TensorRTRunner(target, export=_export_for_engine(target, sidecar), engine_info=sidecar)


def _open_folder(target: Path, asked: RunRequest) -> TensorRTRunner:
    engines = sorted(p for p in target.iterdir() if p.suffix in ENGINE_SUFFIXES)
    if len(engines) != 1:
        raise RunnerError(
            f"backend 'tensorrt' needs one engine file in {str(target)!r}, found "
            f"{[p.name for p in engines] or 'none'}; pass the engine file itself, or "
            "build one with hydra-build"
        )
    return _open_engine(engines[0], asked)


#: TensorRT: an engine file (or an export folder holding one), run through Polygraphy.
TENSORRT = register_backend(
    Backend(
        "tensorrt",
        runner=TensorRTRunner,
        opens={"engine file": _open_engine, "export folder": _open_folder},
        aliases=("trt",),
        dependency="tensorrt",
        proof=RUNS_BUILT_ENGINE,
        refuses={
            ".onnx file": "build a TensorRT engine from it first (hydra-build), or run it in "
            "ONNX Runtime with providers=['tensorrt']"
        },
    )
)
