"""The backends that run ONNX exports of the variants, and the export they share.

ONNX Runtime on the CPU (``ort``) and FP16 TensorRT engines (``tensorrt``).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hydra_deploy.bench.latency.config import OPSET
from hydra_deploy.bench.latency.timing import Backend, Timer
from hydra_deploy.bench.latency.variants import Variant, VariantSet, _quiet_logs, dynamic_axes

log = logging.getLogger("hydra_deploy.bench")


def export_variant(
    variant: Variant,
    variants: VariantSet,
    folder: Path,
    *,
    exporter: str,
    max_batch: int,
    precision: str = "fp32",
) -> tuple[list[Path], dict[str, Any]]:
    """Export a variant to ONNX under ``folder``; returns (one file per network, what was done).

    Fused variants go through :func:`hydra_deploy.export.export_onnx` (the deployed graph);
    plain models through the same torch -> ONNX step and graph passes, one file per network.
    """
    from hydra_deploy.export import export_onnx
    from hydra_deploy.export.torch_onnx import export_module

    max_batch = max(2, max_batch)
    if variant.fused:
        info = export_onnx(
            variant.modules[0],
            folder,
            batch=(1, min(8, max_batch), max_batch),
            exporter=exporter,
            validate=False,
            precision=precision,
        )
        done = {"exporter": info.get("exporter", exporter), "passes": info.get("graph_passes")}
        return [folder / "model.onnx"], done
    folder.mkdir(parents=True, exist_ok=True)
    paths, done = [], {}
    example = variants.example_inputs(2)
    for index, module in enumerate(variant.modules):
        path = folder / f"network{index}.onnx"
        used = export_module(
            module,
            example,
            path,
            input_names=variants.input_names,
            output_names=["logits"],
            opset=OPSET,
            max_batch=max_batch,
            exporter=exporter,
            dynamic_axes=dynamic_axes(variants.adapter),
        )
        done = {"exporter": used, "passes": graph_passes(path, precision)}
        if precision != "fp32":
            mark_precision(path, precision)
        paths.append(path)
    return paths, done


def graph_passes(path: Path, precision: str) -> dict[str, Any]:
    """The export's graph passes on a plain model's file. A pass that fails on this graph is
    left out (and named in the report) rather than failing the benchmark."""
    from hydra_deploy.export.surgery import DEFAULT_PASSES, run_passes

    try:
        return run_passes(path, DEFAULT_PASSES, precision=precision)
    except Exception as err:  # onnx-graphsurgeon raises its own exception types
        reason = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
        log.warning("graph passes failed on %s (%s); running cleanup only", path.name, reason)
        report = run_passes(path, ("cleanup",), precision=precision)
        return {
            **report,
            "failed": f"passes {', '.join(DEFAULT_PASSES)} failed ({reason}); ran cleanup only",
        }


def mark_precision(path: Path, precision: str) -> None:
    """Record a low-precision graph's precision in its metadata (as hydra-export does)."""
    import onnx

    model = onnx.load(str(path))
    prop = next((p for p in model.metadata_props if p.key == "hydra_precision"), None)
    prop = prop or model.metadata_props.add()
    prop.key, prop.value = "hydra_precision", precision
    onnx.save(model, str(path))


class ExportingBackend(Backend):
    """A backend that runs ONNX exports of the variants (exported once, in a work folder)."""

    precision = "fp32"

    def __init__(self, workdir: Path, exporter: str) -> None:
        self.workdir, self.exporter = workdir, exporter
        self.exports: dict[str, dict[str, Any]] = {}

    def export_all(self, variants: VariantSet, batches: Sequence[int]) -> dict[str, list[Path]]:
        files: dict[str, list[Path]] = {}
        for variant in variants.variants:
            started = time.perf_counter()
            # onnx-graphsurgeon prints on stdout: keep stdout for the tables (and --json)
            with _quiet_logs(), contextlib.redirect_stdout(sys.stderr):
                paths, done = export_variant(
                    variant,
                    variants,
                    self.workdir / f"{self.name}-{variant.name}",
                    exporter=self.exporter,
                    max_batch=max(batches),
                    precision=self.precision,
                )
            seconds = time.perf_counter() - started
            self.exports[variant.name] = {**done, "seconds": round(seconds, 2), "files": len(paths)}
            log.info(
                "%s: exported %s in %.1f s (%s exporter)",
                self.name,
                variant.name,
                seconds,
                done["exporter"],
            )
            files[variant.name] = paths
        return files


def feed_of(names: Sequence[str], inputs: tuple[torch.Tensor, ...]) -> dict[str, np.ndarray]:
    return {name: tensor.numpy() for name, tensor in zip(names, inputs, strict=True)}


class OrtTimer(Timer):
    def __init__(self, sessions: list[Any], feed: dict[str, np.ndarray], sequential: bool) -> None:
        self.sessions, self.sequential = sessions, sequential
        self.feeds = [{i.name: feed[i.name] for i in s.get_inputs()} for s in sessions]

    def run(self) -> np.ndarray:
        outputs = [s.run(None, f)[0] for s, f in zip(self.sessions, self.feeds, strict=True)]
        return np.stack(outputs, axis=1) if self.sequential else outputs[0]


class OrtBackend(ExportingBackend):
    """ONNX Runtime, CPU execution provider, intra-op threads set explicitly."""

    name = "ort"

    def __init__(self, workdir: Path, exporter: str, threads: int, spinning: bool) -> None:
        super().__init__(workdir, exporter)
        self.threads, self.spinning = threads, spinning
        self.sessions: dict[str, list[Any]] = {}

    def session(self, path: Path) -> Any:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.log_severity_level = 3
        options.add_session_config_entry(
            "session.intra_op.allow_spinning", "1" if self.spinning else "0"
        )
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def load(self, variants: VariantSet, batches: Sequence[int]) -> None:
        super().load(variants, batches)
        for name, paths in self.export_all(variants, batches).items():
            self.sessions[name] = [self.session(path) for path in paths]

    def timer(self, variant: Variant, inputs: tuple[torch.Tensor, ...]) -> Timer:
        feed = feed_of(self.variants.input_names, inputs)
        return OrtTimer(self.sessions[variant.name], feed, variant.sequential)

    def info(self) -> dict[str, Any]:
        return {
            "device": "cpu",
            "provider": "CPUExecutionProvider",
            "precision": "fp32",
            "intra_op_threads": self.threads,
            "inter_op_threads": 1,
            "allow_spinning": self.spinning,
            "exports": self.exports,
            "timing": "time.perf_counter around InferenceSession.run (numpy in and out)",
        }

    def close(self) -> None:
        self.sessions.clear()


class TensorRTTimer(Timer):
    def __init__(self, runners: list[Any], feed: dict[str, np.ndarray], sequential: bool) -> None:
        self.runners, self.sequential = runners, sequential
        self.inputs: Any = next(iter(feed.values())) if len(feed) == 1 else feed

    def run(self) -> np.ndarray:
        outputs = []
        for runner in self.runners:
            named = runner(self.inputs)
            outputs.append(named.get("member_logits", named.get("logits")))
        return np.stack(outputs, axis=1) if self.sequential else outputs[0]


class TensorRTBackend(ExportingBackend):
    """FP16 TensorRT engines built with :func:`build_engine`, run through the project's runner."""

    name = "tensorrt"
    precision = "fp16"

    def __init__(self, workdir: Path, exporter: str) -> None:
        super().__init__(workdir, exporter)
        self.runners: dict[str, list[Any]] = {}

    def load(self, variants: VariantSet, batches: Sequence[int]) -> None:
        from hydra_deploy.engines.runner import load_runner
        from hydra_deploy.engines.tensorrt import build_engine

        super().load(variants, batches)
        high = max(2, max(batches))
        for name, paths in self.export_all(variants, batches).items():
            engines = [
                build_engine(
                    path,
                    precision="fp16",
                    min_batch=1,
                    opt_batch=min(8, high),
                    max_batch=high,
                    out=path.parent,
                )
                for path in paths
            ]
            self.runners[name] = [load_runner(engine) for engine in engines]

    def timer(self, variant: Variant, inputs: tuple[torch.Tensor, ...]) -> Timer:
        feed = feed_of(self.variants.input_names, inputs)
        return TensorRTTimer(self.runners[variant.name], feed, variant.sequential)

    def info(self) -> dict[str, Any]:
        from hydra_deploy.engines.tensorrt import tensorrt_version

        return {
            "device": torch.cuda.get_device_name(0),
            "precision": "fp16",
            "tensorrt": tensorrt_version(),
            "exports": self.exports,
            "timing": "time.perf_counter around the runner call (host copies included)",
        }

    def close(self) -> None:
        for runners in self.runners.values():
            for runner in runners:
                runner.close()
        self.runners.clear()
