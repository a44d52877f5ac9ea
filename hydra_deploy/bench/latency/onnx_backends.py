"""The backends that run ONNX exports of the variants, and the export they share.

ONNX Runtime on the CPU (``ort``; INT8 as ``ort-int8-dynamic`` and ``ort-int8-static``, quantized
from the FP32 exports by :func:`hydra_deploy.export.int8.quantize_export`) and FP16 TensorRT
engines (``tensorrt``).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hydra_deploy.bench import BenchError
from hydra_deploy.bench.config import LOW_PRECISIONS, OPSET
from hydra_deploy.bench.latency.profiling import precision_breakdown, profile_session
from hydra_deploy.bench.latency.timing import Backend, Timer
from hydra_deploy.bench.latency.variants import (
    Variant,
    VariantSet,
    _quiet_logs,
    dynamic_axes,
    example_inputs,
)
from hydra_deploy.engines.runner import load_runner
from hydra_deploy.engines.tensorrt import build_engine, tensorrt_version
from hydra_deploy.export import export_onnx
from hydra_deploy.export.surgery import DEFAULT_PASSES, run_passes
from hydra_deploy.export.torch_onnx import export_module
from hydra_deploy.optional import lazy_module
from hydra_deploy.options import MIN_CALIBRATION_EXAMPLES

onnx = lazy_module("onnx", purpose="the ONNX backends of hydra-bench", error=BenchError)
ort = lazy_module("onnxruntime", purpose="the ONNX backends of hydra-bench", error=BenchError)

#: The module that quantizes an FP32 export to INT8 (``quantize_export``).
INT8_MODULE = "hydra_deploy.export.int8"
#: The INT8 graphs profiled after timing: which operators stay in float, and their share.
PROFILED_VARIANTS = ("single", "hydra", "fused_deep_ensemble")

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
        done = {"exporter": info.exporter or exporter, "passes": info.graph_passes}
        return [info.onnx_path], done
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
    model = onnx.load(str(path))
    prop = next((p for p in model.metadata_props if p.key == "hydra_precision"), None)
    prop = prop or model.metadata_props.add()
    prop.key, prop.value = "hydra_precision", precision
    onnx.save(model, str(path))


class ExportingBackend(Backend):
    """A backend that runs ONNX exports of the variants (exported once, in a work folder)."""

    precision = "fp32"
    export_precision = "fp32"  # what export_variant writes (the backend may convert it further)

    def __init__(self, workdir: Path, exporter: str) -> None:
        self.workdir, self.exporter = workdir, exporter
        self.exports: dict[str, dict[str, Any]] = {}
        self.files: dict[str, list[Path]] = {}

    def export_all(
        self, variants: VariantSet, batches: Sequence[int], prefix: str | None = None
    ) -> dict[str, list[Path]]:
        """Export every variant under ``workdir/<prefix>-<variant>`` (prefix: the backend's name)."""
        files: dict[str, list[Path]] = {}
        for variant in variants.variants:
            started = time.perf_counter()
            # onnx-graphsurgeon prints on stdout: keep stdout for the tables (and --json)
            with _quiet_logs(), contextlib.redirect_stdout(sys.stderr):
                paths, done = export_variant(
                    variant,
                    variants,
                    self.workdir / f"{prefix or self.name}-{variant.name}",
                    exporter=self.exporter,
                    max_batch=max(batches),
                    precision=self.export_precision,
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
        self.files = files
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


def calibration_feed(variants: VariantSet, examples: int) -> dict[str, np.ndarray]:
    """``examples`` random inputs of the model's shape (seed + 1: not the timed inputs), one
    array per input name, batch axis first: what the static INT8 export is calibrated on. Fine
    for latency; an accurate INT8 model needs real data (``hydra-export --int8-calib``)."""
    return feed_of(
        variants.input_names, example_inputs(variants.adapter, examples, variants.seed + 1)
    )


def int8_unavailable() -> str | None:
    """None when :data:`INT8_MODULE` imports, else the reason (one line)."""
    try:
        module = importlib.import_module(INT8_MODULE)
    except ImportError as err:
        return f"{INT8_MODULE} does not import ({err}); it quantizes the FP32 exports to INT8"
    if not hasattr(module, "quantize_export"):
        return f"{INT8_MODULE} has no quantize_export"
    return None


def graph_input_names(path: Path) -> list[str]:
    model = onnx.load(str(path), load_external_data=False)
    initializers = {t.name for t in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in initializers]


def jsonable(value: Any) -> Any:
    """``value`` with paths, sets, tuples and numpy scalars made JSON types (quantization reports)."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(jsonable(v) for v in value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


class OrtBackend(ExportingBackend):
    """ONNX Runtime, CPU execution provider, intra-op threads set explicitly.

    ``precision`` ``fp32`` (the backend ``ort``), or ``int8-dynamic`` / ``int8-static``
    (``ort-int8-dynamic`` / ``ort-int8-static``): the FP32 exports (``fp32``'s, when that backend
    is given and loaded; else its own) quantized by ``quantize_export``; static calibrated on
    ``calibration_examples`` random inputs (:func:`calibration_feed`).
    """

    def __init__(
        self,
        workdir: Path,
        exporter: str,
        threads: int,
        spinning: bool,
        precision: str = "fp32",
        *,
        fp32: OrtBackend | None = None,
        calibration_examples: int = MIN_CALIBRATION_EXAMPLES,
    ) -> None:
        super().__init__(workdir, exporter)
        if precision != "fp32" and (
            precision not in LOW_PRECISIONS or LOW_PRECISIONS[precision].runtime != "ort"
        ):
            raise BenchError(
                f"ONNX Runtime measures fp32, int8-dynamic and int8-static, not {precision!r}"
            )
        self.precision = precision
        self.name = "ort" if precision == "fp32" else LOW_PRECISIONS[precision].backend
        self.threads, self.spinning = threads, spinning
        self.fp32, self.calibration_examples = fp32, calibration_examples
        self.sessions: dict[str, list[Any]] = {}
        self.profiles: dict[str, Any] = {}

    @property
    def int8_method(self) -> str | None:
        return self.precision.split("-", 1)[1] if self.precision.startswith("int8-") else None

    def session(self, path: Path) -> Any:
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
        if self.int8_method is None:
            files = self.export_all(variants, batches)
        else:
            files = self.quantize_all(variants, batches)
        for name, paths in files.items():
            self.sessions[name] = [self.session(path) for path in paths]

    def quantize_all(self, variants: VariantSet, batches: Sequence[int]) -> dict[str, list[Path]]:
        """The FP32 exports (the ``fp32`` backend's, else its own) quantized to INT8."""
        reason = int8_unavailable()
        if reason is not None:
            raise BenchError(f"{self.name} cannot run: {reason}")
        quantize_export = importlib.import_module(INT8_MODULE).quantize_export
        if self.fp32 is not None and set(self.fp32.files) >= {v.name for v in variants.variants}:
            sources, shared = self.fp32.files, True
        else:
            sources, shared = self.export_all(variants, batches, prefix=f"{self.name}-fp32"), False
        calibration = None
        if self.int8_method == "static":
            calibration = calibration_feed(variants, self.calibration_examples)
        files: dict[str, list[Path]] = {}
        for variant in variants.variants:
            started = time.perf_counter()
            folder = self.workdir / f"{self.name}-{variant.name}"
            folder.mkdir(parents=True, exist_ok=True)
            paths, reports = [], []
            for source in sources[variant.name]:
                out = folder / source.name
                feed = None
                if calibration is not None:
                    feed = {name: calibration[name] for name in graph_input_names(source)}
                with _quiet_logs(), contextlib.redirect_stdout(sys.stderr):
                    report = quantize_export(source, out, method=self.int8_method, calibration=feed)
                reports.append(jsonable(report))
                paths.append(out)
            seconds = time.perf_counter() - started
            fp32_export = "the ort backend's" if shared else self.exports.get(variant.name)
            self.exports[variant.name] = {
                "fp32_export": fp32_export,
                "quantize_s": round(seconds, 2),
                "files": len(paths),
                "quantization": reports[0] if len(reports) == 1 else reports,
            }
            log.info("%s: quantized %s in %.1f s", self.name, variant.name, seconds)
            files[variant.name] = paths
        self.files = files
        return files

    def timer(self, variant: Variant, inputs: tuple[torch.Tensor, ...]) -> Timer:
        feed = feed_of(self.variants.input_names, inputs)
        return OrtTimer(self.sessions[variant.name], feed, variant.sequential)

    def profile(self, variants: VariantSet, batch: int, runs: int) -> dict[str, Any] | None:
        """INT8 backends: ONNX Runtime's profile of the single, Hydra and fused deep ensemble
        graphs at ``batch`` (:func:`precision_breakdown`: what stays in float); else None."""
        if self.int8_method is None or runs < 1:
            return None
        feed = feed_of(variants.input_names, variants.example_inputs(batch))
        profiled: dict[str, Any] = {}
        for name in PROFILED_VARIANTS:
            if name not in self.files:
                continue
            found = profile_session(
                self.files[name][0],
                feed,
                runs,
                self.threads,
                self.workdir,
                warmup=1,
                save_optimized=False,
            )
            profiled[name] = precision_breakdown(found)
        self.profiles = {"batch": batch, "runs": runs, "variants": profiled}
        return self.profiles

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "device": "cpu",
            "provider": "CPUExecutionProvider",
            "precision": self.precision,
            "intra_op_threads": self.threads,
            "inter_op_threads": 1,
            "allow_spinning": self.spinning,
            "exports": self.exports,
            "timing": "time.perf_counter around InferenceSession.run (numpy in and out)",
        }
        if self.int8_method is not None:
            info["int8"] = {
                "method": self.int8_method,
                "quantizer": f"{INT8_MODULE}.quantize_export",
                "calibration": (
                    f"{self.calibration_examples} random inputs of the model's shape (the "
                    "benchmark's seed + 1): enough for latency, not for accuracy"
                    if self.int8_method == "static"
                    else None
                ),
                "reference": "ort (the FP32 export, timed in the same rounds)",
            }
        if self.profiles:
            info["profile"] = self.profiles
        return info

    def keep_only(self, names: set[str]) -> None:
        for name in [n for n in self.sessions if n not in names]:
            del self.sessions[name]

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
    export_precision = "fp16"

    def __init__(self, workdir: Path, exporter: str) -> None:
        super().__init__(workdir, exporter)
        self.runners: dict[str, list[Any]] = {}

    def load(self, variants: VariantSet, batches: Sequence[int]) -> None:
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
