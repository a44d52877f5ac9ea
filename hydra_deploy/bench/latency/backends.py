"""Which backends and precisions can run here (for the others: what to install, or what stands
in for them), and making a backend by name."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path

import torch

from hydra_deploy.bench import BenchError
from hydra_deploy.bench.config import (
    BACKENDS,
    LOW_PRECISIONS,
    BenchConfig,
    LowPrecision,
    normalize_backends,
)
from hydra_deploy.bench.latency.machine import cpu_bf16_reason
from hydra_deploy.bench.latency.onnx_backends import OrtBackend, TensorRTBackend, int8_unavailable
from hydra_deploy.bench.latency.timing import Backend
from hydra_deploy.bench.latency.torch_backends import CudaGraphBackend, TorchBackend
from hydra_deploy.optional import install_hint, missing


def _cuda_reason(precision: str) -> str | None:
    if not torch.cuda.is_available():
        return (
            f"no CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}); "
            "run on a machine with an NVIDIA GPU and a CUDA build of torch"
        )
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        return f"{torch.cuda.get_device_name(0)} has no BF16 support (needs SM >= 80); use torch-cuda-fp16"
    return None


def _ort_reason() -> str | None:
    absent = missing("onnxruntime", "onnx", "onnx_graphsurgeon")
    if absent:
        return f"{', '.join(absent)} not installed: {install_hint(*absent)}"
    return None


def _tensorrt_reason() -> str | None:
    absent = missing("tensorrt", "polygraphy")
    if absent:
        return f"{', '.join(absent)} not installed: {install_hint(*absent)}"
    try:
        importlib.import_module("tensorrt")
    except (ImportError, OSError) as err:
        return (
            f"tensorrt does not import ({type(err).__name__}: {err}); reinstall it: "
            f"{install_hint('tensorrt')}"
        )
    return _ort_reason() or _cuda_reason("fp16")


def backend_status() -> dict[str, str | None]:
    """Every backend -> None when it can run here, else the reason it cannot (what to install)."""
    return {
        "torch": None,
        "ort": _ort_reason(),
        "torch-cuda-bf16": _cuda_reason("bf16"),
        "torch-cuda-fp16": _cuda_reason("fp16"),
        "tensorrt": _tensorrt_reason(),
    }


def available_backends() -> tuple[str, ...]:
    return tuple(name for name, reason in backend_status().items() if reason is None)


def resolve_backends(requested: Sequence[str] | None) -> tuple[list[str], dict[str, str]]:
    """(backends to measure, {skipped backend: reason}).

    ``requested`` None: every backend present; the others are skipped with their reason. A
    backend asked for by name that cannot run raises BenchError with what to install.
    """
    status = backend_status()
    if requested is None:
        chosen = [name for name in BACKENDS if status[name] is None]
        return chosen, {name: reason for name, reason in status.items() if reason is not None}
    chosen = list(normalize_backends(requested))
    for name in chosen:
        if status[name] is not None:
            raise BenchError(f"backend {name} cannot run here: {status[name]}")
    return chosen, {}


def precision_reason(low: LowPrecision, backends: Sequence[str]) -> str | None:
    """None when ``low`` can be measured beside ``backends``, else one line: why not, and what
    stands in for it."""
    if low.runtime not in backends:
        return (
            f"{low.precision} runs on {low.runtime}, which this run does not measure; add "
            f"--backend {low.runtime}"
        )
    if low.precision == "bf16":
        return cpu_bf16_reason()
    if low.precision.startswith("int8-"):
        reason = int8_unavailable()
        return None if reason is None else f"{reason}; only the FP32 ort rows are measured"
    return None


def resolve_precisions(
    config: BenchConfig, backends: Sequence[str]
) -> tuple[list[LowPrecision], dict[str, str]]:
    """(precisions below FP32 to measure, {their backend name: why not measured}).

    Never raises: a precision that cannot run here (no BF16 instructions, its runtime not
    measured) is reported with the reason and what stands in for it.
    """
    chosen: list[LowPrecision] = []
    skipped: dict[str, str] = {}
    for low in config.low_precisions:
        reason = precision_reason(low, backends)
        if reason is None:
            chosen.append(low)
        else:
            skipped[low.backend] = reason
    return chosen, skipped


def make_backend(
    name: str,
    config: BenchConfig,
    threads: int,
    workdir: Path,
    *,
    fp32: Backend | None = None,
) -> Backend:
    """The backend ``name`` (one of BACKENDS, or a low-precision backend of LOW_PRECISIONS).

    ``fp32``: for an INT8 ONNX Runtime backend, the ``ort`` backend whose FP32 exports it
    quantizes (loaded first).
    """
    if name == "torch":
        return TorchBackend(threads)
    if name == "ort":
        return OrtBackend(workdir, config.exporter, threads, config.ort_spinning)
    low = next((p for p in LOW_PRECISIONS.values() if p.backend == name), None)
    if low is not None and low.runtime == "torch":
        return TorchBackend(threads, low.precision)
    if low is not None and low.runtime == "ort":
        return OrtBackend(
            workdir,
            config.exporter,
            threads,
            config.ort_spinning,
            low.precision,
            fp32=fp32 if isinstance(fp32, OrtBackend) else None,
            calibration_examples=config.int8_calibration_examples,
        )
    if name in ("torch-cuda-bf16", "torch-cuda-fp16"):
        return CudaGraphBackend(name.rsplit("-", 1)[1], config.cuda_replays)
    if name == "tensorrt":
        return TensorRTBackend(workdir, config.exporter)
    raise BenchError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
