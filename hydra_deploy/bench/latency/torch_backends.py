"""The backends that run the PyTorch modules themselves.

Eager on the CPU in FP32 (``torch``) and under BF16 autocast (``torch-cpu-bf16``), and BF16/FP16
on CUDA captured in CUDA graphs (``torch-cuda-bf16``, ``torch-cuda-fp16``).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from hydra_deploy.bench import BenchError
from hydra_deploy.bench.config import LOW_PRECISIONS
from hydra_deploy.bench.latency.machine import cpu_features
from hydra_deploy.bench.latency.timing import Backend, Timer
from hydra_deploy.bench.latency.variants import Variant, VariantSet

log = logging.getLogger("hydra_deploy.bench")

#: How ``torch-cpu-bf16`` runs every forward.
CPU_AUTOCAST = 'torch.autocast("cpu", dtype=torch.bfloat16)'


class TorchTimer(Timer):
    """One forward under ``torch.inference_mode()``; ``autocast``: under BF16 autocast too."""

    def __init__(
        self, variant: Variant, inputs: tuple[torch.Tensor, ...], autocast: bool = False
    ) -> None:
        self.variant, self.inputs, self.autocast = variant, inputs, autocast

    def _context(self) -> contextlib.AbstractContextManager:
        if self.autocast:
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def __call__(self) -> float:
        with torch.inference_mode(), self._context():
            start = time.perf_counter()
            self.variant(*self.inputs)
            return time.perf_counter() - start

    def output(self) -> np.ndarray:
        with torch.inference_mode(), self._context():
            return self.variant(*self.inputs).float().numpy()


class TorchBackend(Backend):
    """PyTorch eager on the CPU, under ``torch.inference_mode()``: ``precision`` ``fp32``
    (``torch``) or ``bf16`` (``torch-cpu-bf16``: every forward under
    ``torch.autocast("cpu", dtype=torch.bfloat16)``, the FP32 weights cast on each call, AMX or
    AVX-512 BF16 where the CPU has them)."""

    def __init__(self, threads: int, precision: str = "fp32") -> None:
        if precision not in ("fp32", "bf16"):
            raise BenchError(f"PyTorch on the CPU measures fp32 and bf16, not {precision!r}")
        self.threads, self.precision = threads, precision
        self.name = "torch" if precision == "fp32" else LOW_PRECISIONS[precision].backend

    def timer(self, variant: Variant, inputs: tuple[torch.Tensor, ...]) -> Timer:
        return TorchTimer(variant, inputs, autocast=self.precision == "bf16")

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "device": "cpu",
            "precision": self.precision,
            "threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads(),
            "timing": "time.perf_counter around one forward",
        }
        if self.precision == "bf16":
            features = cpu_features() or {}
            info["autocast"] = CPU_AUTOCAST
            info["cpu_bf16_instructions"] = [
                name for name in ("amx_bf16", "avx512_bf16", "bf16") if features.get(name)
            ]
            info["reference"] = "torch (FP32, timed in the same rounds)"
        return info


class CudaGraphTimer(Timer):
    """A variant captured in a CUDA graph on static inputs; each timed run replays it
    ``replays`` times between two CUDA events and returns the mean."""

    def __init__(
        self, fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], replays: int
    ) -> None:
        self.replays = replays
        self.graph, self.static_out = capture_cuda_graph(fn, inputs)
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def __call__(self) -> float:
        self.start.record()
        for _ in range(self.replays):
            self.graph.replay()
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1000.0 / self.replays

    def output(self) -> np.ndarray:
        self.graph.replay()
        torch.cuda.synchronize()
        return self.static_out.float().cpu().numpy()


class CudaEagerTimer(Timer):
    """The fallback of :class:`CudaGraphTimer` for a forward that cannot be captured: eager
    launches, ``replays`` runs between two CUDA events, the mean returned."""

    def __init__(
        self, fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], replays: int
    ) -> None:
        self.fn, self.inputs, self.replays = fn, inputs, replays
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def __call__(self) -> float:
        with torch.inference_mode():
            self.start.record()
            for _ in range(self.replays):
                self.fn(*self.inputs)
            self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1000.0 / self.replays

    def output(self) -> np.ndarray:
        with torch.inference_mode():
            return self.fn(*self.inputs).float().cpu().numpy()


def capture_cuda_graph(
    fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], warmup: int = 3
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Warm ``fn`` up on a side stream (allocations, autotuning), then capture one call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        for _ in range(warmup):
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph):
        out = fn(*inputs)
    torch.cuda.synchronize()
    return graph, out


class CudaGraphBackend(Backend):
    """PyTorch on CUDA in BF16 or FP16 (weights and activations), captured in CUDA graphs."""

    def __init__(self, precision: str, replays: int) -> None:
        self.precision, self.replays = precision, replays
        self.name = f"torch-cuda-{precision}"
        self.dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        self.device = torch.device("cuda")
        self.timers: list[Timer] = []
        self.eager_fallback: dict[str, str] = {}

    def load(self, variants: VariantSet, batches: Sequence[int]) -> None:
        super().load(variants, batches)
        self.on_device = {}
        for variant in variants.variants:
            modules = [copy.deepcopy(m).to(self.device, self.dtype).eval() for m in variant.modules]
            self.on_device[variant.name] = Variant(
                variant.name,
                modules,
                variant.macs_per_example,
                variant.flops_ratio,
                variant.parameters,
                variant.fused,
            )

    def timer(self, variant: Variant, inputs: tuple[torch.Tensor, ...]) -> Timer:
        static = tuple(
            t.to(self.device, self.dtype) if t.is_floating_point() else t.to(self.device)
            for t in inputs
        )
        module = self.on_device[variant.name]
        try:
            timer: Timer = CudaGraphTimer(module, static, self.replays)
        except RuntimeError as err:  # a host sync in the forward (data-dependent Python branch)
            torch.cuda.synchronize()
            reason = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            self.eager_fallback[variant.name] = reason
            log.warning(
                "%s: %s cannot be captured in a CUDA graph (%s); timing it eagerly",
                self.name,
                variant.name,
                reason,
            )
            timer = CudaEagerTimer(module, static, self.replays)
        self.timers.append(timer)
        return timer

    def release(self, batch: int) -> None:
        self.timers.clear()
        gc.collect()
        torch.cuda.empty_cache()

    def info(self) -> dict[str, Any]:
        return {
            "device": torch.cuda.get_device_name(0),
            "precision": self.precision,
            "cuda_graphs": True,
            "eager_fallback": self.eager_fallback,
            "replays_per_timed_run": self.replays,
            "timing": "torch.cuda.Event around CUDA graph replays (mean per replay)",
        }

    def close(self) -> None:
        self.timers.clear()
        self.on_device = {}
        gc.collect()
        torch.cuda.empty_cache()
