"""The environment of a run: versions, CPU, GPU, threads and load average."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


def cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or None


def load_average() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


VERSIONED = (
    "torch",
    "onnxruntime",
    "onnx",
    "onnxscript",
    "timm",
    "transformers",
    "tensorrt",
    "numpy",
    "hydra-deploy",
)


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def gpu_info() -> dict[str, Any] | None:
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return {
        "name": torch.cuda.get_device_name(0),
        "compute_capability": f"{major}.{minor}",
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
    }


def environment(threads: int) -> dict[str, Any]:
    """Versions, CPU, GPU and threads of this run."""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": threads,
        "torch_interop_threads": torch.get_num_interop_threads(),
        "versions": versions(),
        "torch_build": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "gpu": gpu_info(),
        "load_average_start": load_average(),
    }


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    found = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(found)
