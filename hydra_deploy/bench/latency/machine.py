"""The environment of a run: versions, CPU (and its BF16 / INT8 instructions), GPU, threads and
load average."""

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


#: /proc/cpuinfo flags that decide how fast BF16 and INT8 run on a CPU (x86; aarch64's ``bf16``
#: and ``i8mm`` features too).
CPU_FEATURES = (
    "amx_bf16",
    "amx_int8",
    "amx_tile",
    "avx512_bf16",
    "avx512_vnni",
    "avx_vnni",
    "avx512f",
    "bf16",
    "i8mm",
)
#: Any of these means the CPU computes BF16 products natively (AMX tiles, AVX-512 BF16 dot
#: products, Arm's BF16 extension).
BF16_FEATURES = ("amx_bf16", "avx512_bf16", "bf16")


def cpu_flags_of(cpuinfo: str) -> frozenset[str] | None:
    """The first ``flags`` (x86) or ``Features`` (Arm) line of /proc/cpuinfo's text; None if
    there is none."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return None


def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags from /proc/cpuinfo; None where they cannot be read (not Linux)."""
    try:
        return cpu_flags_of(Path("/proc/cpuinfo").read_text())
    except OSError:
        return None


def cpu_features() -> dict[str, bool] | None:
    """Each of :data:`CPU_FEATURES` -> present; None where the flags cannot be read."""
    flags = cpu_flags()
    return None if flags is None else {name: name in flags for name in CPU_FEATURES}


def cpu_bf16_reason() -> str | None:
    """None when the CPU has BF16 instructions, else one line: why BF16 is not measured, and
    what stands in for it."""
    flags = cpu_flags()
    fallback = "fell back to FP32: the torch rows are the FP32 times, and there are no BF16 rows"
    if flags is None:
        return f"the CPU's flags cannot be read (no /proc/cpuinfo); {fallback}"
    if not flags & set(BF16_FEATURES):
        return (
            f"this CPU ({cpu_model() or 'unknown model'}) has no BF16 instructions (none of "
            f"{', '.join(BF16_FEATURES)} among its /proc/cpuinfo flags); {fallback}"
        )
    return None


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


def machine_info() -> dict[str, Any]:
    """Python, platform and CPU of this run (what every benchmark records of its machine)."""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
    }


def environment(threads: int) -> dict[str, Any]:
    """Versions, CPU, GPU and threads of this run."""
    return {
        **machine_info(),
        "cpu_features": cpu_features(),
        "cpu_bf16": cpu_bf16_reason() is None,
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
