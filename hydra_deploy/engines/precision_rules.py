"""How an engine gets its precision on each TensorRT generation (:func:`choose_precision`): weak typing
with ``--fp16``/``--bf16`` and FP32 constraints (8.6, 10.0-10.11), or a strongly typed graph that
carries its precision (10.12 and 11, and FP16/BF16/INT8 exports from 10.0 on). Shared by the Python
build, the trtexec recipes and the hints the commands print.

INT8 is explicit quantization only: the graph's QuantizeLinear/DequantizeLinear pairs carry the
scales (``hydra-export --precision int8 --int8-method static``); TensorRT's own calibration of an
FP32 graph is not offered. What each generation needs, read in NVIDIA's sources:

- **8.6** (JetPack 6.0's 8.6.2) has no strongly typed networks; a Q/DQ network is built with the INT8
  builder flag, ``--int8`` (NvInfer.h v8.6.1 line 8773, ``BuilderFlag::kINT8``: "Enable Int8 layer
  selection, with FP32 fallback with FP16 fallback if kFP16 also specified"; trtexec sets it for
  ``--int8``, sampleEngines.cpp v8.6.1 lines 970-973, and lines 995-1009 skip calibration ranges
  when the network has Q/DQ layers; developer guide 8.6, "Working with INT8": the INT8 flag must be
  set for any quantized operation; NVIDIA's own QDQ example, tools/tensorflow-quantization/
  examples/README.md v8.6.1 line 55: ``trtexec --onnx=model_qat.onnx --int8``). No ``--fp16``:
  every layer outside the Q/DQ pairs (LayerNorm, softmax, the ensemble head) then stays FP32 as the
  export keeps it, so no precision constraints are needed (8.6 could not pin LayerNorm by name).
- **10.0-10.11** (JetPack 6.1/6.2's 10.3): strongly typed, ``--stronglyTyped`` and no precision
  flag. A strongly typed network takes its types from the graph: a DequantizeLayer's output type is
  its scale's (NvInfer.h v10.3.0 lines 5475-5476), so the float parts stay FP32; trtexec turns
  ``--int8``/``--fp16`` off with a warning under ``--stronglyTyped`` (sampleOptions.cpp v10.3.0
  lines 1231-1248; ``--best`` with it is an error from 10.11, v10.11 lines 1249-1253). Weak
  ``--int8`` stays possible when asked for (``strongly_typed=False``).
- **10.12+**: ``BuilderFlag::kINT8`` deprecated, "Superseded by strong typing" (NvInfer.h v10.12.0
  lines 8852-8854): strongly typed, as 10.0.
- **11**: no ``kINT8`` (NvInfer.h v11.0 ``enum class BuilderFlag``, line 9974 on); trtexec's build
  options parse no ``--int8`` (sampleOptions.cpp v11.0: only ``SafeBuilderOptions::parse``, lines
  1723-1742, reads it) and ``--stronglyTyped`` is an accepted no-op (line 2396): strongly typed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hydra_deploy.errors import EngineError, said, spelled
from hydra_deploy.export_folder import (
    GRAPH_PRECISIONS,
)

PRECISIONS = ("fp16", "bf16", "fp32", "int8", "best")
# trtexec generations: the key names the oldest release each recipe is written for.
GENERATIONS = {"8.6": (8, 6), "10": (10, 0), "10.12": (10, 12), "11": (11, 0)}
GENERATION_NAMES = {
    "8.6": "TensorRT 8.6 (JetPack 6.0: 8.6.2; not JetPack 5, whose 8.5 lacks LayerNormalization)",
    "10": "TensorRT 10.0-10.11 (JetPack 6.1 and 6.2: 10.3)",
    "10.12": "TensorRT 10.12 and later 10.x",
    "11": "TensorRT 11",
}


@dataclass(frozen=True)
class PrecisionChoice:
    """How an engine gets its precision on one TensorRT version (see :func:`choose_precision`)."""

    precision: str  # what the engine computes in: fp16, bf16, fp32 or int8 (explicit quantization)
    strongly_typed: bool
    builder_flags: tuple[str, ...]  # weak typing: "fp16" / "bf16" / "int8" (trtexec --fp16 ...)
    constrain_fp32: bool  # pin LayerNormalization and the ensemble head to FP32 (obey)
    notes: tuple[str, ...] = ()  # warnings for the user (fallbacks, deprecations)


def parse_version(version: str | Sequence[int]) -> tuple[int, int]:
    """``"10.13.0.35"`` or ``(10, 13)`` -> ``(10, 13)``."""
    if isinstance(version, str):
        parts = version.split(".")
        try:
            return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
        except ValueError as err:
            raise EngineError(f"cannot read TensorRT version {version!r}") from err
    return int(version[0]), int(version[1]) if len(version) > 1 else 0


def generation_of(version: str | Sequence[int]) -> str:
    """The trtexec generation (a key of :data:`GENERATIONS`) a TensorRT version belongs to."""
    major, minor = parse_version(version)
    if (major, minor) < (8, 6):
        raise EngineError(
            f"TensorRT {major}.{minor} is too old: the LayerNormalization op needs TensorRT 8.6 or "
            "newer; upgrade TensorRT (JetPack 6.0 ships 8.6.2, 6.1 and 6.2 ship 10.3)"
        )
    if major < 10:
        return "8.6" if major == 8 else "10"
    if major == 10:
        return "10.12" if minor >= 12 else "10"
    return "11"


def _bf16_problem(trt: tuple[int, int], sm: int | None) -> str | None:
    if trt < (10, 0):
        return f"BF16 needs TensorRT 10 or newer (this is TensorRT {trt[0]}.{trt[1]})"
    if sm is not None and sm < 80:
        return f"BF16 needs a GPU with compute capability 8.0 or newer (this one is {sm // 10}.{sm % 10})"
    return None


def choose_precision(
    requested: str | None,
    graph_precision: str,
    trt: str | Sequence[int],
    *,
    sm: int | None = None,
    strongly_typed: bool | None = None,
) -> PrecisionChoice:
    """Decide typing, builder flags and FP32 constraints for one build.

    Args:
        requested: fp16, bf16, fp32, int8 or best (None: the graph's own precision if it carries
            one, else fp16). ``best`` is BF16 where the GPU (SM >= 80) and TensorRT (>= 10)
            support it, else FP16 with a note; for a graph that carries its precision it is that
            precision. ``int8`` needs an explicitly quantized graph.
        graph_precision: the exported graph's precision (:attr:`ExportSource.graph_precision`:
            hydra.json's, int8 when the graph holds Q/DQ pairs).
        trt: the TensorRT version (``"10.3"``, ``(10, 13)``) or a trtexec generation key.
        sm: the GPU's compute capability as ``10 * major + minor`` (None: unknown; the BF16 GPU
            check is then left to TensorRT).
        strongly_typed: force typing (None: strongly typed for graphs that carry their precision
            on TensorRT >= 10, and for every graph on TensorRT >= 10.12).

    Raises:
        EngineError: the combination cannot be built; the message says what to change.
    """
    trt = GENERATIONS[trt] if isinstance(trt, str) and trt in GENERATIONS else parse_version(trt)
    generation_of(trt)  # refuses TensorRT < 8.6
    requested = _checked_request(requested, graph_precision)
    _check_typing(strongly_typed, trt)
    if graph_precision != "fp32":  # the graph carries its precision (Casts in the ONNX file)
        return _typed_graph_choice(requested, graph_precision, trt, sm, strongly_typed)
    return _fp32_graph_choice(requested, trt, sm, strongly_typed)


def _checked_request(requested: str | None, graph_precision: str) -> str:
    """The precision asked for (None: the graph's own, else fp16), or EngineError saying why it
    cannot be built from this graph."""
    if graph_precision not in GRAPH_PRECISIONS:
        raise EngineError(
            f"unknown graph precision {graph_precision!r}; expected {GRAPH_PRECISIONS}"
        )
    if requested is None:
        requested = graph_precision if graph_precision != "fp32" else "fp16"
    if requested == "int8" and graph_precision != "int8":
        # IInt8Calibrator: "Deprecated in TensorRT 10.1. Superseded by explicit quantization."
        # (NvInfer.h v10.1.0 line 7583); NvInfer.h v11.0 has no IInt8Calibrator at all
        raise EngineError(
            f"unknown precision 'int8' for this {graph_precision} graph: TensorRT builds INT8 here "
            "only from the graph's own QuantizeLinear/DequantizeLinear pairs (explicit "
            "quantization; TensorRT's calibration is deprecated since 10.1 and gone in 11); "
            "quantize the export: hydra-export --from EXPORT_DIR --precision int8 "
            "--int8-method static --int8-calib DATA --out NEW_DIR"
        )
    if requested not in PRECISIONS:
        raise EngineError(f"unknown precision {requested!r}; choose one of {', '.join(PRECISIONS)}")
    return requested


def _check_typing(strongly_typed: bool | None, trt: tuple[int, int]) -> None:
    """EngineError for a typing this TensorRT does not have."""
    version = f"{trt[0]}.{trt[1]}"
    if strongly_typed and trt < (10, 0):
        raise EngineError(
            f"TensorRT {version} has no strongly typed networks (they came with TensorRT 10.0); "
            f"build weakly typed ({spelled('leave strongly_typed unset', 'drop --strongly-typed')})"
            " or upgrade TensorRT"
        )
    if strongly_typed is False and trt >= (11, 0):
        raise EngineError(
            f"TensorRT {version} builds every network strongly typed; drop the weakly typed "
            f"request ({spelled('strongly_typed=False', '--weakly-typed')})"
        )


def _deprecated_weak(trt: tuple[int, int]) -> str:
    return f"weak typing is deprecated since TensorRT 10.12 (this is {trt[0]}.{trt[1]})"


def _typed_graph_choice(
    requested: str,
    graph_precision: str,
    trt: tuple[int, int],
    sm: int | None,
    strongly_typed: bool | None,
) -> PrecisionChoice:
    """A graph that carries its precision: built in it, strongly typed from TensorRT 10.0 on."""
    if requested == "best":
        requested = graph_precision
    if requested != graph_precision:
        raise EngineError(
            f"model.onnx was exported in {graph_precision} (its precision is in the graph); "
            + said(f"build it with `precision` {graph_precision} (or best), or re-export with ")
            + f"hydra-export --from EXPORT_DIR --precision {requested} --out NEW_DIR"
        )
    problem = _bf16_problem(trt, sm) if graph_precision == "bf16" else None
    if problem:
        raise EngineError(
            f"{problem}; re-export in FP16: hydra-export --from EXPORT_DIR --precision fp16 "
            "--out NEW_DIR"
        )
    if trt >= (10, 0) and strongly_typed is not False:
        return PrecisionChoice(graph_precision, True, (), False, ())
    notes = (_deprecated_weak(trt),) if trt >= (10, 12) else ()
    # INT8 without FP16: the layers outside the Q/DQ pairs compute in FP32, nothing to pin
    pin = graph_precision != "int8"
    return PrecisionChoice(graph_precision, False, (graph_precision,), pin, notes)


def _fp32_graph_choice(
    requested: str, trt: tuple[int, int], sm: int | None, strongly_typed: bool | None
) -> PrecisionChoice:
    """An FP32 graph: FP32, or FP16/BF16 by weak typing with LayerNorm and the head pinned to
    FP32 (before TensorRT 10.12; deprecated there, removed in 11)."""
    version = f"{trt[0]}.{trt[1]}"
    notes: list[str] = []
    if requested == "best":
        problem = _bf16_problem(trt, sm)
        if problem:
            notes.append(f"precision best: {problem}; building FP16 instead")
            requested = "fp16"
        else:
            requested = "bf16"
    if requested == "fp32":
        typed = strongly_typed if strongly_typed is not None else trt >= (10, 12)
        return PrecisionChoice("fp32", typed, (), False, tuple(notes))
    if requested == "bf16":
        problem = _bf16_problem(trt, sm)
        if problem:
            raise EngineError(
                f"{problem}; " + said("use `precision` fp16 (or best, which falls back to FP16)")
            )
    reexport = (
        f"export a graph that carries its precision instead: hydra-export --from EXPORT_DIR "
        f"--precision {requested} --out NEW_DIR"
    )
    if strongly_typed:
        raise EngineError(
            f"a strongly typed build of an FP32 graph computes in FP32, not {requested}; {reexport}"
        )
    if trt >= (11, 0):
        raise EngineError(
            f"TensorRT {version} removed weak typing (--fp16/--bf16), so an FP32 graph cannot be "
            f"built in {requested}; {reexport}"
        )
    if trt >= (10, 12):
        if strongly_typed is None:
            raise EngineError(
                f"TensorRT {version} deprecated weak typing (--fp16/--bf16 on an FP32 graph); "
                f"{reexport} (or ask for the deprecated path with "
                f"{spelled('strongly_typed=False', '--weakly-typed')})"
            )
        notes.append(_deprecated_weak(trt))
    return PrecisionChoice(requested, False, (requested,), True, tuple(notes))
