"""TensorRT engines from export folders, through Polygraphy's loaders over the TensorRT API.

Two steps, so that everything but the build itself is testable without a GPU:

1. :func:`plan_build` (pure Python): reads the export, applies the precision rules of
   :func:`hydra_deploy.engines.precision_rules.choose_precision` for the TensorRT version and GPU at hand,
   and returns a :class:`BuildPlan`: typing, builder flags, FP32 layers, optimization profile,
   file names and the sidecar's contents.
2. :func:`execute_plan`: ``NetworkFromOnnxPath(strongly_typed=...)`` (parsed here, so that the
   network's I/O dtypes go into the sidecar) -> FP32 pins on the parsed network (weak typing only:
   every normalization layer by layer type, the ensemble head by name) -> ``CreateConfig(fp16/bf16/
   int8, profiles, precision_constraints, load_timing_cache)`` -> ``EngineBytesFromNetwork(
   save_timing_cache=...)``; the engine (a ``tensorrt.IHostMemory``: a buffer, without ``len()``)
   and its JSON sidecar are written atomically, the timing cache is kept beside them.

An INT8 export (QuantizeLinear/DequantizeLinear pairs) is explicit quantization: strongly typed
from TensorRT 10.0 on (no precision flag: ``kINT8`` is deprecated in 10.12 and gone in 11), and on
8.6 weakly typed with ``int8=True`` alone (``BuilderFlag::kINT8``; Polygraphy sets no calibrator
for a network with Q/DQ layers: ``backend/trt/config.py`` v8.6.1 lines 302-316, v10.3.0 lines
336-364), so the layers outside the pairs stay FP32 and nothing is pinned. The rules and their
sources: :mod:`hydra_deploy.engines.precision_rules`.

:func:`build_engine` does both. Importing this module needs neither TensorRT nor Polygraphy; they
are imported when a build runs (``pip install 'hydra-deploy[trt]'``).
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra_deploy.atomic import atomic_write_bytes
from hydra_deploy.engines.build_options import EngineBuildOptions, options_with
from hydra_deploy.engines.build_source import (
    ExportSource,
    engine_stem,
    load_source,
    timing_cache_name,
)
from hydra_deploy.engines.gpu import GpuInfo, detect_gpu
from hydra_deploy.engines.onnx_summary import fp32_layer_names
from hydra_deploy.engines.precision_rules import choose_precision, generation_of, parse_version
from hydra_deploy.engines.trtexec import trtexec_command
from hydra_deploy.errors import EngineError, spelled
from hydra_deploy.export_folder import ENGINE_FORMAT, engine_info_path, write_engine_info
from hydra_deploy.optional import install_command, lazy_module, missing_message, require

log = logging.getLogger("hydra_deploy.engines")
#: Polygraphy's CUDA wrapper (libcudart), for the CUDA runtime version in the sidecar
cuda = lazy_module("polygraphy.cuda", purpose="reading the CUDA runtime version", error=EngineError)

SIDECAR_FORMAT = ENGINE_FORMAT  # the sidecar's format (its owner: hydra_deploy.export_folder)
_PURPOSE = "building TensorRT engines"


# --- the TensorRT at hand ------------------------------------------------------------------------------
def tensorrt_version() -> str:
    """The installed TensorRT's version; EngineError (install hint) when it is missing."""
    tensorrt = require("tensorrt", purpose=_PURPOSE, error=EngineError)
    return str(tensorrt.__version__)


# --- the plan --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BuildPlan:
    """Everything a build does, decided before TensorRT is touched."""

    onnx_path: Path
    export_dir: Path
    out_dir: Path
    requested_precision: str | None
    graph_precision: str
    precision: str  # what the engine computes in
    strongly_typed: bool
    builder_flags: tuple[str, ...]  # weak typing: "fp16" / "bf16" / "int8"
    fp32_layers: tuple[str, ...]  # pinned to FP32 with precision constraints "obey"
    batch: tuple[int, int, int]
    profile: dict[str, dict[str, list[int]]]  # input -> {"min", "opt", "max"} shapes
    tensorrt_version: str
    gpu: GpuInfo
    onnx_sha256: str
    engine_path: Path
    sidecar_path: Path
    timing_cache: Path
    load_timing_cache: Path | None  # an existing cache to start from (None: start empty)
    spec: dict[str, Any] | None
    inputs: list[dict[str, Any]]
    outputs: list[Any]
    uq_outputs: bool
    notes: tuple[str, ...] = field(default=())
    source: ExportSource | None = field(default=None, repr=False, compare=False)
    # weak typing: normalization layers (found by layer type) and fp32_layers are pinned to FP32
    constrain_fp32: bool = False

    @property
    def precision_constraints(self) -> str | None:
        return "obey" if self.constrain_fp32 or self.fp32_layers else None

    def sidecar(self, **extra: Any) -> dict[str, Any]:
        """The JSON written beside the engine (``extra``: build time, timings)."""
        return {
            "format": SIDECAR_FORMAT,
            "engine": self.engine_path.name,
            "precision": self.precision,
            "requested_precision": self.requested_precision,
            "graph_precision": self.graph_precision,
            "strongly_typed": self.strongly_typed,
            "builder_flags": list(self.builder_flags),
            "fp32_layers": list(self.fp32_layers),
            "gpu": {
                "name": self.gpu.name,
                "compute_capability": self.gpu.compute_capability,
                "sm": self.gpu.sm,
                "tag": self.gpu.tag,
            },
            "tensorrt_version": self.tensorrt_version,
            "cuda": {"driver": self.gpu.cuda_driver, "runtime": None},  # runtime: set by the build
            "batch_profile": dict(zip(("min", "opt", "max"), self.batch, strict=True)),
            "profile": self.profile,
            "inputs": self.inputs,
            "outputs": self.outputs,
            "uq_outputs": self.uq_outputs,
            "onnx": str(os.path.relpath(self.onnx_path, self.out_dir)),
            "onnx_sha256": self.onnx_sha256,
            "timing_cache": self.timing_cache.name,
            "spec": self.spec,
            "notes": list(self.notes),
            **extra,
        }

    @property
    def options(self) -> EngineBuildOptions:
        """The settings that make this engine again: as decided, nothing left to the rules."""
        low, opt, high = self.batch
        return EngineBuildOptions(
            precision=self.precision,
            out=self.out_dir,
            min_batch=low,
            opt_batch=opt,
            max_batch=high,
            timing_cache=self.timing_cache,
            strongly_typed=self.strongly_typed,
        )

    def trtexec_equivalent(self) -> str:
        """The trtexec line that makes the same engine (for logs and bug reports)."""
        try:
            command = trtexec_command(
                self.source if self.source is not None else load_source(self.onnx_path),
                self.options,
                trt=generation_of(self.tensorrt_version),
                engine=self.engine_path,
                sm=self.gpu.sm,
            )
        except EngineError as err:  # a log line must never stop a build
            return f"(no trtexec equivalent: {err})"
        extra = [n for n in command.notes if n not in self.notes]
        return command.shell + "".join(f"\n  # note: {n}" for n in extra)


def plan_build(
    onnx_path: str | Path,
    options: EngineBuildOptions | None = None,
    *,
    trt_version: str | None = None,
    gpu: GpuInfo | None = None,
    **settings: Any,
) -> BuildPlan:
    """Decide a build without running it: ``options`` (an :class:`EngineBuildOptions`, or its
    fields as keywords: ``precision=``, ``max_batch=``, ...) as for :func:`build_engine`.

    ``trt_version`` and ``gpu`` default to the installed TensorRT and CUDA device 0; pass them to
    plan for another machine (tests do).
    """
    asked = options_with(EngineBuildOptions, options, settings, "plan_build")
    source = load_source(onnx_path)
    trt_version = trt_version if trt_version is not None else tensorrt_version()
    gpu = gpu if gpu is not None else detect_gpu()
    choice = choose_precision(
        asked.precision,
        source.graph_precision,
        parse_version(trt_version),
        sm=gpu.sm,
        strongly_typed=asked.strongly_typed,
    )
    batch = source.batch_profile(*asked.batch)
    out_dir = Path(asked.out) if asked.out is not None else source.folder
    major, minor = parse_version(trt_version)
    stem = engine_stem(source.sha256, choice.precision, f"{major}.{minor}", gpu.tag)
    cache = (
        Path(asked.timing_cache)
        if asked.timing_cache is not None
        else out_dir / timing_cache_name(f"{major}.{minor}", gpu.tag)
    )
    export = source.export
    return BuildPlan(
        onnx_path=source.onnx_path,
        export_dir=source.folder,
        out_dir=out_dir,
        requested_precision=asked.precision,
        graph_precision=source.graph_precision,
        precision=choice.precision,
        strongly_typed=choice.strongly_typed,
        builder_flags=choice.builder_flags,
        fp32_layers=tuple(fp32_layer_names(source.onnx)) if choice.constrain_fp32 else (),
        batch=batch,
        profile=source.profile_shapes(batch),
        tensorrt_version=trt_version,
        gpu=gpu,
        onnx_sha256=source.sha256,
        engine_path=out_dir / f"{stem}.engine",
        sidecar_path=engine_info_path(out_dir / f"{stem}.engine"),
        timing_cache=cache,
        load_timing_cache=cache if cache.is_file() else None,
        spec=source.spec,
        inputs=list((export.inputs if export else None) or source.onnx.inputs),
        outputs=list((export.outputs if export else None) or source.onnx.outputs),
        uq_outputs=export.uq_outputs if export else len(source.onnx.outputs) > 1,
        notes=choice.notes,
        source=source,
        constrain_fp32=choice.constrain_fp32,
    )


# --- running it ---------------------------------------------------------------------------------------------
def _import_polygraphy_trt():
    """tensorrt and Polygraphy's TensorRT backend, or EngineError with the install hint."""
    trt = require("tensorrt", purpose=_PURPOSE, error=EngineError)
    poly_trt = require("polygraphy.backend.trt", purpose=_PURPOSE, error=EngineError)
    return trt, poly_trt


def _cuda_runtime_version() -> str | None:
    """The CUDA runtime TensorRT loaded, via Polygraphy's libcudart wrapper (None if unknown)."""
    try:
        value = ctypes.c_int(0)
        if cuda.wrapper().handle.cudaRuntimeGetVersion(ctypes.byref(value)) != 0:
            return None
    except Exception:  # no libcudart, no polygraphy: the sidecar just says unknown
        return None
    return f"{value.value // 1000}.{value.value % 1000 // 10}"


# numpy dtype names of TensorRT's DataType members (``DataType.name``); BF16/FP8/INT4 have no numpy
# type, so tensorrt.nptype refuses them: they are named here directly.
TRT_DTYPE_NAMES = {
    "FLOAT": "float32",
    "HALF": "float16",
    "BF16": "bfloat16",
    "INT8": "int8",
    "INT32": "int32",
    "INT64": "int64",
    "UINT8": "uint8",
    "BOOL": "bool",
    "FP8": "float8",
    "INT4": "int4",
    "FP4": "float4",
}


def trt_dtype_name(dtype: Any) -> str:
    """A TensorRT ``DataType`` as a numpy dtype name (``DataType.INT32`` -> ``"int32"``)."""
    name = getattr(dtype, "name", None) or str(dtype).rsplit(".", 1)[-1]
    return TRT_DTYPE_NAMES.get(str(name).upper(), str(name).lower())


def network_io(network: Any) -> dict[str, list[dict[str, Any]]]:
    """The network's inputs and outputs (name, dtype) as the ONNX parser made them.

    These are the engine's I/O tensors: TensorRT 8.6's parser turns INT64 inputs into INT32
    (onnx-tensorrt 8.6-GA ``convertDtype``), so a text model's token ids are int32 there.
    """

    def tensors(count: int, get: Any) -> list[dict[str, Any]]:
        return [{"name": get(i).name, "dtype": trt_dtype_name(get(i).dtype)} for i in range(count)]

    return {
        "inputs": tensors(network.num_inputs, network.get_input),
        "outputs": tensors(network.num_outputs, network.get_output),
    }


def pin_fp32_layers(
    trt: Any, network: Any, names: tuple[str, ...], layernorms: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Set FP32 precision on every normalization layer (by layer type) and on the layers named.

    LayerNormalization is found by type, not name: TensorRT 8.6's ONNX parser does not give the
    INormalizationLayer it creates the node's name (onnx-tensorrt 8.6-GA returns without
    ``registerLayer``; 10.0 registers it), so a name matches nothing there. ``layernorms``: the
    LayerNormalization node names among ``names`` (reached by type). Returns the layers pinned,
    how many normalization layers there were and the other names that matched no layer.
    """
    wanted, found, pinned, normalization = set(names), set(), [], 0
    for index in range(network.num_layers):
        layer = network.get_layer(index)
        by_type = layer.type == trt.LayerType.NORMALIZATION
        if by_type or layer.name in wanted:
            layer.precision = trt.float32
            pinned.append(layer.name)
            normalization += by_type
            found.add(layer.name)
    by_type_names = set(layernorms)
    unmatched = [n for n in names if n not in found and n not in by_type_names]
    return {"pinned": pinned, "normalization_layers": normalization, "unmatched": unmatched}


def execute_plan(plan: BuildPlan, *, overwrite: bool = False) -> dict[str, Any]:
    """Build the engine a :class:`BuildPlan` describes; returns the sidecar's contents.

    The engine, its sidecar and the timing cache are written together: the sidecar's contents are
    decided before anything is written, and an engine whose sidecar cannot be written is removed.
    """
    trt, poly = _import_polygraphy_trt()
    _prepare_folder(plan, overwrite)
    parsed = _parse_network(poly, plan)  # (builder, network, parser)
    io = network_io(parsed[1])
    pins = _pin_planned_layers(trt, plan, parsed[1])
    log.info(
        "building a %s engine (%s) for %s (SM %s) with TensorRT %s; equivalent trtexec:\n  %s",
        plan.precision,
        "strongly typed" if plan.strongly_typed else "weakly typed",
        plan.gpu.name,
        plan.gpu.compute_capability,
        plan.tensorrt_version,
        plan.trtexec_equivalent(),
    )
    started = time.perf_counter()
    data = _serialized_engine(poly, plan, parsed)
    seconds = time.perf_counter() - started
    sidecar = plan.sidecar(
        built_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        build_seconds=round(seconds, 2),
        engine_bytes=data.nbytes,
        cuda={"driver": plan.gpu.cuda_driver, "runtime": _cuda_runtime_version()},
        engine_io=io,
        fp32_pinned=pins["pinned"],
    )
    sidecar["inputs"] = _with_engine_dtypes(sidecar["inputs"], io["inputs"])
    sidecar["outputs"] = _with_engine_dtypes(sidecar["outputs"], io["outputs"])
    _write_engine(plan, data, sidecar)
    log.info(
        "wrote %s (%.1f MB, %.0f s) and %s",
        plan.engine_path,
        data.nbytes / 1e6,
        seconds,
        plan.sidecar_path.name,
    )
    return sidecar


def _prepare_folder(plan: BuildPlan, overwrite: bool) -> None:
    """Refuse an engine that exists (unless ``overwrite``), make the folder, say the notes."""
    if plan.engine_path.exists() and not overwrite:
        raise EngineError(
            f"{str(plan.engine_path)!r} exists (same model, precision, GPU and TensorRT); pass "
            f"{spelled('overwrite=True', '--overwrite')} to rebuild it"
        )
    try:
        plan.out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise EngineError(f"cannot create {str(plan.out_dir)!r}: {err.strerror or err}") from err
    for note in plan.notes:
        log.warning("%s", note)


def _parse_network(poly: Any, plan: BuildPlan) -> Any:
    """(builder, network, parser) of the ONNX file: parsed here so the network can be inspected
    and changed before the build."""
    try:
        return poly.NetworkFromOnnxPath(str(plan.onnx_path), strongly_typed=plan.strongly_typed)()
    except Exception as err:  # Polygraphy raises PolygraphyException after the parser's log
        raise EngineError(
            f"TensorRT's ONNX parser cannot read {str(plan.onnx_path)!r} ({type(err).__name__}: "
            f"{err}); its log above names the node. Check the file with: polygraphy run "
            "model.onnx --onnxrt --trt"
        ) from err


def _pin_planned_layers(trt: Any, plan: BuildPlan, network: Any) -> dict[str, Any]:
    """The plan's FP32 pins on the parsed network (weak typing only), warning about the layers
    they could not reach."""
    if not plan.precision_constraints:
        return {"pinned": [], "normalization_layers": 0, "unmatched": []}
    source = plan.source if plan.source is not None else load_source(plan.onnx_path)
    layernorms = tuple(n.name for n in source.onnx.nodes if n.op_type == "LayerNormalization")
    pins = pin_fp32_layers(trt, network, plan.fp32_layers, layernorms)
    if pins["unmatched"]:
        log.warning(
            "no layer is named %s: those nodes keep TensorRT's choice of precision",
            ", ".join(pins["unmatched"]),
        )
    if pins["normalization_layers"] < len(layernorms):
        log.warning(
            "TensorRT made %d normalization layers for %d LayerNormalization nodes: the others "
            "were decomposed and keep TensorRT's choice of precision",
            pins["normalization_layers"],
            len(layernorms),
        )
    return pins


def _serialized_engine(poly: Any, plan: BuildPlan, parsed: Any) -> memoryview:
    """Build the parsed network with the plan's profile and flags; the engine's bytes."""
    profile = poly.Profile()
    for name, shapes in plan.profile.items():
        profile.add(name, min=shapes["min"], opt=shapes["opt"], max=shapes["max"])
    config = poly.CreateConfig(
        fp16="fp16" in plan.builder_flags,
        bf16="bf16" in plan.builder_flags,
        int8="int8" in plan.builder_flags,  # never on TensorRT 11, which has no kINT8
        profiles=[profile],
        precision_constraints=plan.precision_constraints,
        load_timing_cache=str(plan.load_timing_cache) if plan.load_timing_cache else None,
    )
    try:
        serialized = poly.EngineBytesFromNetwork(
            parsed, config=config, save_timing_cache=str(plan.timing_cache)
        )()
    except Exception as err:  # Polygraphy raises PolygraphyException after TensorRT's own log
        raise EngineError(
            f"TensorRT could not build {str(plan.onnx_path)!r} ({type(err).__name__}: {err}); "
            "TensorRT's log above names the failing layer. Try another precision, or check the "
            "file with: polygraphy run model.onnx --onnxrt --trt"
        ) from err
    # TensorRT returns an IHostMemory: the buffer protocol and nbytes, but no len() (and it is
    # always truthy); build_serialized_network returns None when the build fails.
    try:
        data = memoryview(serialized) if serialized is not None else None
    except TypeError as err:
        raise EngineError(
            f"TensorRT returned {type(serialized).__name__}, not a serialized engine; check the "
            f"TensorRT and Polygraphy versions ({install_command('tensorrt')})"
        ) from err
    if data is None or data.nbytes == 0:
        raise EngineError("TensorRT returned an empty engine; see TensorRT's log above")
    return data


def _write_engine(plan: BuildPlan, data: memoryview, sidecar: dict[str, Any]) -> None:
    """The engine, atomically, then its sidecar; no engine is left without its sidecar."""
    try:
        atomic_write_bytes(plan.engine_path, data)  # never a half-written engine
    except OSError as err:
        raise EngineError(f"cannot write {str(plan.engine_path)!r}: {err.strerror or err}") from err
    try:
        write_engine_info(plan.sidecar_path, sidecar)
    except (OSError, ValueError) as err:  # no engine without its sidecar: a rerun would refuse
        plan.engine_path.unlink(missing_ok=True)
        raise EngineError(
            f"cannot write the sidecar {str(plan.sidecar_path)!r} ({err}); the engine was removed, "
            "fix the folder and build again"
        ) from err


def _with_engine_dtypes(specs: list[Any], engine: list[dict[str, Any]]) -> list[Any]:
    """The export's tensor records with each dtype replaced by the engine's (same names)."""
    dtypes = {t["name"]: t["dtype"] for t in engine}
    return [
        {**s, "dtype": dtypes[s["name"]]} if isinstance(s, dict) and s.get("name") in dtypes else s
        for s in specs
    ]


def missing_tensorrt_message(source: ExportSource, precision: str | None) -> str:
    """One line: how to install TensorRT, or the trtexec command that builds this export."""
    generation = "10.12" if source.graph_precision != "fp32" else "10"
    try:
        command = trtexec_command(source, precision=precision, trt=generation).shell
    except EngineError:
        command = None
    return missing_message(
        "tensorrt",
        purpose=_PURPOSE,
        extra_hint=(
            "or build on the target with trtexec (hydra-build EXPORT_DIR --trtexec prints the "
            f"line for each TensorRT version): {command}"
        )
        if command
        else None,
    )


def build_engine(
    onnx_path: str | Path,
    options: EngineBuildOptions | None = None,
    *,
    overwrite: bool = False,
    **settings: Any,
) -> Path:
    """Build a TensorRT engine from an export folder (or an .onnx file) and return its path.

    Args:
        onnx_path: an export folder from hydra-export, its model.onnx, or any .onnx file.
        options: the build's settings, an :class:`EngineBuildOptions`; or its fields as keywords
            (``build_engine(path, precision="fp16", max_batch=64)``; keywords win over
            ``options``):
        precision: fp16, bf16, fp32, int8 or best (None: the graph's own precision when it
            carries one, else fp16). A graph exported in FP16/BF16/INT8 carries its precision
            and builds strongly typed from TensorRT 10.0 on (ask for its precision, ``best`` or
            None); INT8 is read from the graph's Q/DQ pairs, and ONNX Runtime's dynamic
            quantization is refused (re-export with ``--int8-method static``). An FP32 graph
            builds weakly typed with FP16/BF16 builder flags on TensorRT before 10.12, with
            LayerNormalization and the ensemble head pinned to FP32; TensorRT >= 10.12 needs an
            FP16/BF16 export instead. BF16 needs SM >= 80 and TensorRT >= 10: ``best`` falls back
            to FP16 with a warning, an explicit ``bf16`` raises.
        min_batch, opt_batch, max_batch: the optimization profile for the batch axis (default:
            the export's profile from hydra.json, else 1, 8, 32).
        timing_cache: timing cache file to start from and update (default: beside the engine,
            ``timing.<gpu>.trt<version>.cache``).
        strongly_typed: force typing (None: decided by the rules above).
        out: folder for the engine, sidecar and timing cache (default: the export folder).
        overwrite: rebuild an engine that already exists.

    Returns:
        The engine's path, ``model.<sha12>.<precision>.<gpu>-sm<NN>.trt<X.Y>.engine``; the sidecar
        ``<same stem>.json`` records precision, GPU, TensorRT/CUDA versions, profile, typing,
        the ONNX hash and the HydraSpec.

    Raises:
        EngineError: TensorRT or Polygraphy missing (the message gives the install command and the
            trtexec line for this export), no GPU, an impossible precision, a failed build.
    """
    asked = options_with(EngineBuildOptions, options, settings, "build_engine")
    source = load_source(onnx_path)
    source.graph_precision  # noqa: B018 (refuses a graph no TensorRT builds before asking for one)
    try:
        version = tensorrt_version()
    except EngineError as err:
        raise EngineError(missing_tensorrt_message(source, asked.precision)) from err
    plan = plan_build(onnx_path, asked, trt_version=version)
    execute_plan(plan, overwrite=overwrite)
    return plan.engine_path


__all__ = [
    "BuildPlan",
    "EngineBuildOptions",
    "GpuInfo",
    "build_engine",
    "detect_gpu",
    "execute_plan",
    "plan_build",
    "tensorrt_version",
]
