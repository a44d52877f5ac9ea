"""ONNX Runtime runner: a ``.onnx`` file run by an ``InferenceSession``, filling in
:class:`~hydra_deploy.engines.runner_base.BaseRunner`.

Providers default to CUDA (when this onnxruntime build has it) then CPU; the TensorRT execution
provider is used only when asked for, and then CUDA and CPU follow it (for the nodes TensorRT does
not take) and its engine and timing caches are on (``trt_engine_cache_enable``,
``trt_timing_cache_enable``, in :func:`ort_tensorrt_cache_dir`), else every new session builds its
engines again. Short names (``"cpu"``, ``"cuda"``, ``"tensorrt"``) and ``(name, options)`` pairs
are accepted; options given are kept.

Its row in the backend registry (:data:`ONNXRUNTIME`, ``"onnxruntime"`` or ``"ort"``) opens an
export folder (its ``model.onnx``) and a ``.onnx`` file, with the ``hydra.json`` that describes
it.

Edge runtime: numpy only at import; onnxruntime is imported when a runner is made.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hydra_deploy.engines.backends import (
    RUNS_ONNX_FILE,
    Backend,
    RunRequest,
    export_beside_onnx,
    folder_model,
    register_backend,
)
from hydra_deploy.engines.runner_base import BaseRunner, TensorSpec, _is_fixed
from hydra_deploy.errors import RunnerError
from hydra_deploy.export_folder import INFO_FILE, ExportInfo, read_info
from hydra_deploy.optional import require
from hydra_deploy.threads import ort_threads

__all__ = [
    "DEFAULT_PROVIDERS",
    "ONNXRUNTIME",
    "PROVIDER_ALIASES",
    "OrtRunner",
    "ort_tensorrt_cache_dir",
    "resolve_providers",
]

logger = logging.getLogger("hydra_deploy")

PROVIDER_ALIASES = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "trt": "TensorrtExecutionProvider",
    "rocm": "ROCMExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
    "dml": "DmlExecutionProvider",
}
DEFAULT_PROVIDERS = ("CUDAExecutionProvider", "CPUExecutionProvider")
_ORT_TYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(double)": "float64",
    "tensor(bfloat16)": "bfloat16",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(int8)": "int8",
    "tensor(uint8)": "uint8",
    "tensor(bool)": "bool",
}


def _import_ort():
    return require(
        "onnxruntime",
        purpose="running .onnx files",
        error=RunnerError,
        extra_hint="or run a TensorRT engine file instead",
    )


def ort_tensorrt_cache_dir() -> Path:
    """Where ONNX Runtime's TensorRT provider keeps its engines and timing cache:
    ``$HYDRA_ORT_TRT_CACHE``, else ``$XDG_CACHE_HOME/hydra-deploy/ort-tensorrt`` (~/.cache)."""
    if os.environ.get("HYDRA_ORT_TRT_CACHE"):
        return Path(os.environ["HYDRA_ORT_TRT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hydra-deploy" / "ort-tensorrt"


def _tensorrt_provider(options: dict[str, Any] | None, cache_dir: Path | None) -> tuple[str, dict]:
    """The TensorRT provider with its engine and timing caches on (options given win)."""
    folder = str(cache_dir if cache_dir is not None else ort_tensorrt_cache_dir())
    defaults = {
        "trt_engine_cache_enable": True,
        "trt_engine_cache_path": folder,
        "trt_timing_cache_enable": True,
        "trt_timing_cache_path": folder,
    }
    return "TensorrtExecutionProvider", {**defaults, **(options or {})}


def resolve_providers(
    providers: Sequence[Any] | str | None,
    available: Sequence[str],
    *,
    cache_dir: str | os.PathLike | None = None,
) -> list[Any]:
    """ONNX Runtime providers to ask for: defaults, short names, and a check they exist here.

    The TensorRT provider gets its engine and timing caches (in ``cache_dir``, default
    :func:`ort_tensorrt_cache_dir`), and when neither CUDA nor CPU is named, CUDA then CPU are
    added after it (those this build has), so that nodes TensorRT does not take still run.
    """
    if providers is None:
        return [p for p in DEFAULT_PROVIDERS if p in available]
    if isinstance(providers, str):
        providers = [providers]
    resolved: list[Any] = []
    for entry in providers:
        name, options = (entry[0], entry[1]) if isinstance(entry, (tuple, list)) else (entry, None)
        full = PROVIDER_ALIASES.get(str(name).lower(), str(name))
        if full not in available:
            raise RunnerError(
                f"ONNX Runtime provider {name!r} is not available in this onnxruntime build; "
                f"available: {', '.join(available)} (CUDA needs onnxruntime-gpu, TensorRT needs "
                "onnxruntime-gpu and TensorRT libraries)"
            )
        if full == "TensorrtExecutionProvider":
            resolved.append(_tensorrt_provider(options, Path(cache_dir) if cache_dir else None))
        else:
            resolved.append((full, dict(options)) if options is not None else full)
    if not resolved:
        raise RunnerError(f"no providers given; available: {', '.join(available)}")
    names = [p if isinstance(p, str) else p[0] for p in resolved]
    if "TensorrtExecutionProvider" in names and not set(DEFAULT_PROVIDERS) & set(names):
        resolved += [p for p in DEFAULT_PROVIDERS if p in available]
    return resolved


class OrtRunner(BaseRunner):
    """A model run by an ONNX Runtime ``InferenceSession``."""

    backend = "onnxruntime"

    def __init__(
        self,
        onnx_path: Path,
        providers: Sequence[Any] | str | None = None,
        *,
        export: ExportInfo | None = None,
        threads: int | None = None,
    ) -> None:
        ort = _import_ort()
        asked = resolve_providers(providers, ort.get_available_providers())
        options = ort.SessionOptions()
        options.log_severity_level = 3  # errors only; warnings about fallbacks are ours to say
        threads = ort_threads(threads)  # this call's, else the command's --threads
        if threads:
            options.intra_op_num_threads = int(threads)
        try:
            self.session = ort.InferenceSession(str(onnx_path), options, providers=asked)
        except Exception as err:
            raise RunnerError(
                _session_error(onnx_path, err, None if export is None else export.precision)
            ) from err
        inputs = [
            TensorSpec(a.name, tuple(a.shape), _ORT_TYPES.get(a.type, a.type))
            for a in self.session.get_inputs()
        ]
        outputs = [
            TensorSpec(a.name, tuple(a.shape), _ORT_TYPES.get(a.type, a.type))
            for a in self.session.get_outputs()
        ]
        min_batch, max_batch = 1, None
        first = inputs[0].shape[0] if inputs and inputs[0].shape else None
        if _is_fixed(first) and first > 0:  # a fixed-batch file: run exactly that batch
            min_batch = max_batch = int(first)
        elif export is not None and export.batch_profile is not None:
            max_batch = export.batch_profile[2]
        super().__init__(
            onnx_path,
            inputs,
            outputs,
            providers=self.session.get_providers(),
            min_batch=min_batch,
            max_batch=max_batch,
            export=export,
        )
        wanted = [p if isinstance(p, str) else p[0] for p in asked]
        if wanted[0] not in self.providers:
            logger.warning("ONNX Runtime fell back from %s to %s", wanted[0], self.providers[0])

    def _embedded_metadata(self) -> dict[str, str]:
        return dict(self.session.get_modelmeta().custom_metadata_map)

    def _run(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            values = self.session.run(None, feed)
        except Exception as err:
            raise RunnerError(f"ONNX Runtime failed to run {self.path}: {err}") from err
        return dict(zip(self.output_names, values, strict=True))

    def close(self) -> None:
        self.session = None


def _session_error(path: Path, err: Exception, precision: str | None) -> str:
    text = str(err)
    if "NOT_IMPLEMENTED" in text or "NotImplemented" in type(err).__name__:
        if precision == "bf16" or "bfloat16" in text.lower():
            return (
                f"ONNX Runtime cannot run {path}: its CPU kernels do not implement BF16 MatMul/"
                f"Softmax ({text.strip()}); build a TensorRT engine from it (hydra-build) or run "
                "the fp32/fp16 export"
            )
        return (
            f"ONNX Runtime has no kernel for an operator of {path} with these providers "
            f"({text.strip()}); try another provider, or another precision (ONNX Runtime's CPU "
            "kernels do not run BF16 MatMul)"
        )
    lowered = text.lower()
    if any(sign in lowered for sign in ("error number 13", "errno 13", "permission denied")):
        fix = "check the file's permissions"
    else:
        fix = "is the file complete and an ONNX model? re-export it with hydra-export"
    return f"ONNX Runtime cannot load {path}: {text.strip()}; {fix}"


# --- the backend's row ---------------------------------------------------------------------------
def _open_folder(target: Path, asked: RunRequest) -> OrtRunner:
    onnx_path = folder_model(target)
    export = read_info(target / INFO_FILE, required=False)
    return OrtRunner(onnx_path, asked.providers, export=export, threads=asked.threads)


def _open_onnx(target: Path, asked: RunRequest) -> OrtRunner:
    export = export_beside_onnx(target, asked.decisions)
    return OrtRunner(target, asked.providers, export=export, threads=asked.threads)


#: ONNX Runtime: an export folder or a ``.onnx`` file, run by an ``InferenceSession``.
ONNXRUNTIME = register_backend(
    Backend(
        "onnxruntime",
        runner=OrtRunner,
        opens={"export folder": _open_folder, ".onnx file": _open_onnx},
        aliases=("ort",),
        dependency="onnxruntime",
        proof=RUNS_ONNX_FILE,
        refuses={
            "engine file": "ONNX Runtime runs the .onnx file it was built from (the export "
            "folder), or run the engine with backend 'tensorrt'"
        },
    )
)
