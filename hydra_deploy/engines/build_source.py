"""What an engine is built from, and the files a build writes: an export folder (``hydra.json`` +
``model.onnx``) or a bare ``.onnx`` file as an :class:`ExportSource` (:func:`load_source`), its
optimization-profile shapes, and the engine and timing-cache file names. Shared by the Python build
(:mod:`hydra_deploy.engines.tensorrt`) and the trtexec recipes (:mod:`hydra_deploy.engines.trtexec`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra_deploy.engines.onnx_summary import OnnxSummary, explicit_quantization, read_onnx
from hydra_deploy.errors import EngineError
from hydra_deploy.export_folder import (
    GRAPH_PRECISIONS,
    INFO_FILE,
    MODEL_FILE,
    ExportInfo,
    file_sha256,
    read_info,
)


@dataclass(frozen=True)
class ExportSource:
    """An ONNX file and, when it sits in an export folder, that folder's ``hydra.json``."""

    onnx_path: Path
    folder: Path
    export: ExportInfo | None
    onnx: OnnxSummary

    @property
    def info(self) -> Mapping[str, Any] | None:
        """The export's ``hydra.json`` record as written (:attr:`export` checked it), or None."""
        return None if self.export is None else self.export.record

    @property
    def sha256(self) -> str:
        """The ONNX file's SHA-256 (from hydra.json when present, else computed)."""
        if self.export is not None and self.export.onnx_sha256:
            return self.export.onnx_sha256
        return file_sha256(self.onnx_path)

    @property
    def graph_precision(self) -> str:
        """fp32; fp16/bf16 for a strongly typed graph that carries its own precision; int8 for an
        explicitly quantized graph (QuantizeLinear/DequantizeLinear pairs).

        INT8 is read from the graph's operators (:func:`explicit_quantization`, which refuses what
        TensorRT cannot build: ONNX Runtime's dynamic quantization, uint8 or asymmetric zero
        points); the rest from hydra.json, else the ONNX metadata (``hydra_precision``), else fp32.
        """
        if self.export is not None:
            precision = self.export.precision
        else:
            precision = self.onnx.metadata.get("hydra_precision", "fp32")
        if precision not in GRAPH_PRECISIONS:
            raise EngineError(
                f"hydra.json gives precision {precision!r}; expected one of {GRAPH_PRECISIONS}. "
                "Re-export the folder with hydra-export"
            )
        quantized = explicit_quantization(self.onnx, self.onnx_path)
        if quantized and precision not in ("int8", "fp32"):
            raise EngineError(
                f"{str(self.onnx_path)!r} holds QuantizeLinear/DequantizeLinear pairs (INT8) but "
                f"its record gives precision {precision}; re-export the folder with hydra-export"
            )
        if precision == "int8" and not quantized:
            raise EngineError(
                f"hydra.json gives precision int8 but {str(self.onnx_path)!r} holds no "
                "QuantizeLinear/DequantizeLinear pairs; re-export the folder with hydra-export "
                "--precision int8 --int8-method static"
            )
        return "int8" if quantized else precision

    @property
    def spec(self) -> dict[str, Any] | None:
        """The HydraSpec as a dict (hydra.json, else the ONNX metadata), or None."""
        if self.export is not None and self.export.spec is not None:
            return self.export.spec
        text = self.onnx.metadata.get("hydra_spec")
        return json.loads(text) if text else None

    def batch_profile(
        self, min_batch: int | None, opt_batch: int | None, max_batch: int | None
    ) -> tuple[int, int, int]:
        """(min, opt, max): the arguments given, else hydra.json's profile, else (1, 8, 32)."""
        saved = (None if self.export is None else self.export.batch_profile) or (1, 8, 32)
        saved = dict(zip(("min", "opt", "max"), saved, strict=True))
        lo = saved["min"] if min_batch is None else min_batch
        hi = saved["max"] if max_batch is None else max_batch
        opt = opt_batch if opt_batch is not None else min(max(saved["opt"], lo), hi)
        return check_batch_profile(lo, opt, hi)

    def input_shapes(self) -> list[tuple[str, list[int | str]]]:
        """(name, shape) of each model input; hydra.json's, else the ONNX file's."""
        recorded = () if self.export is None else self.export.inputs  # checked there
        if recorded:
            return [(i["name"], list(i["shape"])) for i in recorded]
        return [(i["name"], list(i["shape"])) for i in self.onnx.inputs]

    def sequence_profile(self) -> tuple[int, int, int]:
        """(min, opt, max) sequence length of a text model: 1, min(128, max), the tokenizer's
        maximum length (else the model's position embeddings)."""
        export = self.export
        tokenizer = None if export is None else export.tokenizer
        config = None if export is None else export.backbone_config
        longest = (tokenizer.get("max_length") if isinstance(tokenizer, dict) else None) or (
            config.get("max_position_embeddings") if isinstance(config, dict) else None
        )
        if isinstance(longest, bool) or not isinstance(longest, int) or longest < 1:
            raise EngineError(
                f"{str(self.onnx_path)!r} has a dynamic sequence axis but its hydra.json records "
                "no maximum length (tokenizer.max_length); re-export it with hydra-export"
            )
        return 1, min(128, int(longest)), int(longest)

    def profile_shapes(self, batch: tuple[int, int, int]) -> dict[str, dict[str, list[int]]]:
        """{input: {"min": shape, "opt": shape, "max": shape}} with the batch axis filled in."""
        shapes: dict[str, dict[str, list[int]]] = {}
        for name, shape in self.input_shapes():
            if not shape or isinstance(shape[0], int):
                raise EngineError(
                    f"input {name!r} has shape {shape} without a dynamic batch axis first; "
                    "export with a dynamic batch (hydra-export does)"
                )
            rest = shape[1:]
            fixed = [d for d in rest if not (type(d) is int and d > 0)]  # not True, not 3.0
            if any(d != "sequence" for d in fixed):
                raise EngineError(
                    f"input {name!r} has shape {shape}: only the batch and a text model's sequence "
                    "axis may be dynamic for an engine profile; re-export with fixed sizes for the "
                    "other axes"
                )
            sequence = self.sequence_profile() if fixed else (0, 0, 0)
            shapes[name] = {
                k: [b, *(n if d == "sequence" else d for d in rest)]
                for k, b, n in zip(("min", "opt", "max"), batch, sequence, strict=True)
            }
        if not shapes:
            raise EngineError(f"{str(self.onnx_path)!r} has no inputs to build a profile for")
        return shapes


def check_batch_profile(min_batch: int, opt_batch: int, max_batch: int) -> tuple[int, int, int]:
    """Validate a (min, opt, max) batch profile; returns it as ints."""
    try:
        batch = tuple(int(b) for b in (min_batch, opt_batch, max_batch))
    except (TypeError, ValueError) as err:
        raise EngineError(f"batch sizes must be integers, got {err}") from err
    if not 1 <= batch[0] <= batch[1] <= batch[2]:
        raise EngineError(
            f"the batch profile must satisfy 1 <= min <= opt <= max, got min={batch[0]} "
            f"opt={batch[1]} max={batch[2]}; fix --min-batch/--opt-batch/--max-batch"
        )
    return batch  # type: ignore[return-value]


def load_source(path: str | Path) -> ExportSource:
    """An export folder, a ``hydra.json`` or a ``.onnx`` file -> :class:`ExportSource`.

    A ``.onnx`` file with a ``hydra.json`` beside it is read as that export; for a bare ``.onnx``
    file the spec and precision come from its metadata (hydra-export writes both), else FP32.
    """
    path = Path(path)
    if not path.exists():
        raise EngineError(
            f"{str(path)!r} does not exist; give an export folder made by hydra-export "
            "(model.onnx + hydra.json) or an .onnx file"
        )
    if path.is_dir():
        folder, onnx_path = path, path / MODEL_FILE
        read_info(folder)  # refuses a folder without hydra.json, as every consumer does
        if not onnx_path.is_file():
            raise EngineError(
                f"{str(path)!r} is not an export folder: {MODEL_FILE} is missing; make one with "
                "hydra-export --backbone NAME --out DIR"
            )
    elif path.name == INFO_FILE:
        folder, onnx_path = path.parent, path.parent / MODEL_FILE
    elif path.suffix == ".onnx":
        folder, onnx_path = path.parent, path
    else:
        raise EngineError(
            f"{str(path)!r} is neither an export folder nor an .onnx file; give the folder "
            "hydra-export wrote"
        )
    export = None
    if onnx_path.name == MODEL_FILE:  # an export folder's model: its hydra.json, checked
        export = read_info(folder / INFO_FILE, required=False)
    if not onnx_path.is_file():
        raise EngineError(f"{str(onnx_path)!r} is missing; re-export the folder with hydra-export")
    onnx = read_onnx(onnx_path)
    if export is None and "member_logits" not in onnx.outputs:
        raise EngineError(
            f"{str(onnx_path)!r} is not a Hydra export: it has no member_logits output (outputs: "
            f"{list(onnx.outputs)}) and no hydra.json; build from a folder hydra-export wrote "
            "(other models: run trtexec on them directly)"
        )
    return ExportSource(onnx_path=onnx_path, folder=folder, export=export, onnx=onnx)


def engine_stem(sha256: str, precision: str, trt_tag: str, gpu_tag: str | None = None) -> str:
    """``model.<sha12>.<precision>[.<gpu>].trt<version>``: an engine fits one model, GPU and TRT."""
    parts = ["model", sha256[:12], precision]
    if gpu_tag:
        parts.append(gpu_tag)
    parts.append(f"trt{trt_tag}")
    return ".".join(parts)


def timing_cache_name(trt_tag: str, gpu_tag: str | None = None) -> str:
    """``timing[.<gpu>].trt<version>.cache``: timing caches are shared by models, not by GPUs."""
    return ".".join(["timing", *([gpu_tag] if gpu_tag else []), f"trt{trt_tag}", "cache"])
