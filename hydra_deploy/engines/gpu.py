"""The GPU at hand: its name and compute capability, from the CUDA driver API (libcuda).

What a TensorRT build is planned for (:func:`hydra_deploy.engines.tensorrt.plan_build`) and what a
TensorRT runner checks an engine's sidecar against; ctypes only (no torch, no nvidia-smi).
"""

from __future__ import annotations

import contextlib
import ctypes
import re
from dataclasses import dataclass

from hydra_deploy.errors import EngineError

__all__ = ["GpuInfo", "compute_capability_here", "detect_gpu"]


@dataclass(frozen=True)
class GpuInfo:
    """A CUDA device: its name and compute capability (``sm`` = 10 * major + minor)."""

    name: str
    major: int
    minor: int
    cuda_driver: str | None = None  # CUDA version the driver supports, e.g. "12.8"

    @property
    def sm(self) -> int:
        return 10 * self.major + self.minor

    @property
    def compute_capability(self) -> str:
        return f"{self.major}.{self.minor}"

    @property
    def tag(self) -> str:
        """File-name tag: slugged name and SM, e.g. ``NVIDIA H200`` -> ``h200-sm90``."""
        slug = re.sub(r"^nvidia[\s-]+", "", self.name.strip().lower())
        slug = re.sub(r"[^a-z0-9]+", "-", slug).strip("-") or "gpu"
        return f"{slug}-sm{self.sm}"


def detect_gpu(device: int = 0) -> GpuInfo:
    """Name and compute capability of CUDA device ``device``, from the driver API (libcuda).

    libcuda ships with every NVIDIA driver (Jetson included), so this needs neither torch nor
    nvidia-smi. Raises EngineError when there is no driver or no such device.
    """
    names = ("libcuda.so.1", "libcuda.so", "nvcuda.dll")
    lib = None
    for candidate in names:
        with contextlib.suppress(OSError):
            lib = ctypes.CDLL(candidate)
            break
    if lib is None:
        raise EngineError(
            "no NVIDIA driver found (libcuda cannot be loaded); build engines on the machine with "
            "the target GPU, or print the trtexec commands with hydra-build EXPORT_DIR --trtexec"
        )

    def check(status: int, what: str) -> None:
        if status != 0:
            raise EngineError(
                f"CUDA driver call {what} failed with error {status}; check that a GPU is visible "
                "(CUDA_VISIBLE_DEVICES, nvidia-smi / tegrastats)"
            )

    check(lib.cuInit(0), "cuInit")
    count = ctypes.c_int(0)
    check(lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
    if not 0 <= device < count.value:
        raise EngineError(f"CUDA device {device} does not exist ({count.value} visible)")
    handle = ctypes.c_int(0)
    check(lib.cuDeviceGet(ctypes.byref(handle), device), "cuDeviceGet")
    name = ctypes.create_string_buffer(256)
    check(lib.cuDeviceGetName(name, 256, handle), "cuDeviceGetName")
    major, minor = ctypes.c_int(0), ctypes.c_int(0)
    # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75, _MINOR = 76
    check(lib.cuDeviceGetAttribute(ctypes.byref(major), 75, handle), "cuDeviceGetAttribute")
    check(lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, handle), "cuDeviceGetAttribute")
    driver = ctypes.c_int(0)
    cuda_driver = None
    if lib.cuDriverGetVersion(ctypes.byref(driver)) == 0:
        cuda_driver = f"{driver.value // 1000}.{driver.value % 1000 // 10}"
    return GpuInfo(name.value.decode(errors="replace"), major.value, minor.value, cuda_driver)


def compute_capability_here() -> str | None:
    """The compute capability of CUDA device 0 (``"8.7"``), or None without a driver or GPU."""
    try:
        return detect_gpu().compute_capability
    except EngineError:
        return None
