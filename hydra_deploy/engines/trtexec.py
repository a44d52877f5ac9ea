"""trtexec recipes: the exact command lines that build a TensorRT engine from an export folder.

Pure Python (no TensorRT, no onnx package): a Jetson that has trtexec but not our build extras gets
the same commands. Three TensorRT generations differ in how precision is chosen:

- ``"8.6"`` (JetPack 6.0 ships 8.6.2; JetPack 5 ships 8.5, which cannot parse the opset-17
  LayerNormalization op) and ``"10"`` (10.0-10.11; JetPack 6.1 and 6.2 ship 10.3): an FP32 graph is
  built *weakly typed* with ``--fp16`` / ``--bf16``; ``--precisionConstraints=obey`` with
  ``--layerPrecisions=<layer>:fp32,...`` keeps every LayerNormalization (FP16 LayerNorm overflows)
  and the ensemble (uncertainty) head in FP32. The layer names are the ONNX node names, which
  TensorRT's ONNX parser gives the layers it creates, except 8.6's for LayerNormalization: there
  the command cannot pin them (see :func:`_unnamed_on_trt86`; the Python build pins them by layer
  type). Every FP32 command has ``--noTF32``: trtexec enables TF32 unless told not to.
- ``"10.12"`` and ``"11"``: TensorRT 10.12 deprecated weak typing and 11 removed ``--fp16``/``--bf16``;
  the graph carries its precision (``hydra-export --precision fp16|bf16``) and is built with
  ``--stronglyTyped`` (a no-op that 11 still accepts).
- A graph exported in FP16/BF16 is built ``--stronglyTyped`` from 10.0 on; TensorRT 8.6 has no strongly
  typed networks and builds it weakly typed with the same constraints.
- An INT8 graph (QuantizeLinear/DequantizeLinear pairs, ``hydra-export --precision int8
  --int8-method static``; read from the graph's operators) is built ``--stronglyTyped`` from 10.0
  on and with ``--int8`` alone on 8.6 (no ``--fp16``: what is outside the pairs stays FP32, as
  exported), both with ``--noTF32`` like FP32 builds; ONNX Runtime's dynamic quantization
  (MatMulInteger, DynamicQuantizeLinear) is refused with the way out. The sources behind each rule
  are in :mod:`~hydra_deploy.engines.precision_rules`.

:func:`trtexec_commands` gives every generation's command (or why it cannot build the export) and
:func:`command_lines` the lines ``hydra-build --trtexec`` prints; ``hydra-export``'s hint prints the
same lines, so the two never disagree about a generation.

What the Python build (:mod:`hydra_deploy.engines.tensorrt`) shares with the recipes lives beside
this module: reading an export folder (:mod:`~hydra_deploy.engines.build_source`), the precision
rules (:mod:`~hydra_deploy.engines.precision_rules`) and the FP32 layer list
(:mod:`~hydra_deploy.engines.onnx_summary`). The shell scripts in the repository's ``engines/``
folder reimplement these few rules with python3's standard library; tests check that they print
exactly :func:`trtexec_command`'s arguments.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra_deploy.engines.build_options import EngineBuildOptions, options_with
from hydra_deploy.engines.build_source import (
    ExportSource,
    engine_stem,
    load_source,
    timing_cache_name,
)
from hydra_deploy.engines.onnx_summary import OnnxSummary, fp32_layer_names
from hydra_deploy.engines.precision_rules import (
    GENERATION_NAMES,
    GENERATIONS,
    PrecisionChoice,
    choose_precision,
)
from hydra_deploy.errors import EngineError


def _unnamed_on_trt86(onnx: OnnxSummary, names: list[str]) -> tuple[list[str], tuple[str, ...]]:
    """TensorRT 8.6's ONNX parser leaves LayerNormalization layers unnamed: drop their names.

    onnx-tensorrt 8.6-GA's LayerNormalization importer returns without ``registerLayer`` (10.0
    registers it), so ``--layerPrecisions=LayerNormalization_0:fp32`` would match no layer and
    pin nothing, silently. What 8.6 does instead (NvInfer.h, ``INormalizationLayer::
    setComputePrecision``): the normalization is computed in FP32 whatever the builder flags, its
    inputs and outputs may still be FP16.
    """
    layernorms = {n.name for n in onnx.nodes if n.op_type == "LayerNormalization"}
    kept = [n for n in names if n not in layernorms]
    if len(kept) == len(names):
        return names, ()
    note = (
        f"TensorRT 8.6 cannot pin the {len(names) - len(kept)} LayerNormalization layers to FP32 "
        "from the command line (its ONNX parser leaves them unnamed, so --layerPrecisions matches "
        "none): TensorRT computes them in FP32 but may give them FP16 inputs and outputs; "
        "hydra-build pins them by layer type, or build with TensorRT 10"
    )
    return kept, (note,)


@dataclass(frozen=True)
class TrtexecCommand:
    """One trtexec invocation: ``argv`` (program first) and ``str(cmd)``, shell-quoted."""

    argv: tuple[str, ...]
    trt: str
    precision: str
    strongly_typed: bool
    engine: Path
    timing_cache: Path
    layer_info: Path | None
    notes: tuple[str, ...] = field(default=())

    @property
    def shell(self) -> str:
        """The command line as one shell-quoted string."""
        return shlex.join(self.argv)

    def __str__(self) -> str:
        return self.shell


def _shape_arg(shapes: dict[str, dict[str, list[int]]], key: str) -> str:
    return ",".join(f"{name}:{'x'.join(str(d) for d in s[key])}" for name, s in shapes.items())


def trtexec_command(
    export_dir_or_info: str | Path | ExportSource,
    options: EngineBuildOptions | None = None,
    *,
    trt: str = "10.12",
    engine: str | Path | None = None,
    layer_info: bool = True,
    gpu: str | None = None,
    sm: int | None = None,
    extra: Sequence[str] = (),
    **settings: Any,
) -> TrtexecCommand:
    """The exact trtexec command that builds an engine from an export folder.

    Args:
        export_dir_or_info: an export folder (or its model.onnx / hydra.json), or an
            :class:`ExportSource` from :func:`load_source`.
        options: the build's settings (:class:`EngineBuildOptions`, as for
            :func:`~hydra_deploy.engines.tensorrt.build_engine`), or its fields as keywords
            (``precision=``, ``min_batch=``, ``opt_batch=``, ``max_batch=``, ``timing_cache=``,
            ``out=``, ``strongly_typed=``; keywords win over ``options``). ``precision``: fp16,
            bf16, fp32, int8 or best (None: the graph's own precision, else fp16); without ``sm``
            the GPU is unknown, so ``best`` means FP16 here for an FP32 graph. The batch profile
            defaults to hydra.json's; ``out`` is the folder for the engine, timing cache and
            layer info (default: the export folder).
        trt: the TensorRT generation the command is for: ``"8.6"`` (e.g. JetPack 6.0's 8.6.2),
            ``"10"`` (10.0-10.11, e.g. JetPack 6.1/6.2's 10.3), ``"10.12"`` or ``"11"``.
        engine: the engine path to write (default: in ``out``, named by model hash, precision,
            optional ``gpu`` tag and generation; see :func:`engine_stem`); the timing cache
            likewise unless ``timing_cache`` is given.
        layer_info: add ``--profilingVerbosity=detailed --dumpLayerInfo --exportLayerInfo=FILE`` so
            the layer list shows whether attention fused into one kernel.
        gpu: a tag such as ``orin-sm87`` put into the file names (the GPU is not known here).
        sm: the target GPU's compute capability (``10 * major + minor``) for the BF16 check.
        extra: more trtexec arguments, appended as given (e.g. ``--useCudaGraph``, which only
            affects trtexec's own timing runs, and is a deprecated no-op on TensorRT 11, where
            CUDA graphs are the default).

    Raises:
        EngineError: unknown generation, a precision that generation cannot build, bad profile.
    """
    asked = options_with(EngineBuildOptions, options, settings, "trtexec_command")
    if trt not in GENERATIONS:
        raise EngineError(
            f"unknown TensorRT generation {trt!r}; choose one of {', '.join(GENERATIONS)}"
        )
    source = _source(export_dir_or_info)
    precision, best_note = _without_best(asked.precision, sm, source)
    choice = choose_precision(
        precision, source.graph_precision, trt, sm=sm, strongly_typed=asked.strongly_typed
    )
    engine_path, cache_path, layers_path = _output_paths(source, choice, asked, trt, engine, gpu)
    shapes = source.profile_shapes(source.batch_profile(*asked.batch))
    precision_args, notes = _precision_arguments(source, choice, trt)
    argv = [
        "trtexec",
        f"--onnx={source.onnx_path}",
        *(f"--{k}Shapes={_shape_arg(shapes, k)}" for k in ("min", "opt", "max")),
        *precision_args,
        f"--saveEngine={engine_path}",
        f"--timingCacheFile={cache_path}",
    ]
    if layer_info:
        argv += [
            "--profilingVerbosity=detailed",
            "--dumpLayerInfo",
            f"--exportLayerInfo={layers_path}",
        ]
    argv += list(extra)
    notes += _extra_notes(trt, extra)
    return TrtexecCommand(
        argv=tuple(argv),
        trt=trt,
        precision=choice.precision,
        strongly_typed=choice.strongly_typed,
        engine=engine_path,
        timing_cache=cache_path,
        layer_info=layers_path if layer_info else None,
        notes=best_note + choice.notes + notes,
    )


def _extra_notes(trt: str, extra: Sequence[str]) -> tuple[str, ...]:
    """What the extra arguments do on this generation, where that is not what they say."""
    if trt == "11" and "--useCudaGraph" in extra:
        return (
            "--useCudaGraph is a deprecated no-op on TensorRT 11: trtexec uses CUDA graphs "
            "by default there (--noCudaGraph turns them off)",
        )
    return ()


def _output_paths(
    source: ExportSource,
    choice: PrecisionChoice,
    asked: EngineBuildOptions,
    trt: str,
    engine: str | Path | None,
    gpu: str | None,
) -> tuple[Path, Path, Path]:
    """(engine, timing cache, layer info): as given, else in ``asked.out`` (the export folder)
    named by model hash, precision, GPU tag and generation."""
    folder = Path(asked.out) if asked.out is not None else source.folder
    stem = engine_stem(source.sha256, choice.precision, trt, gpu)
    engine_path = Path(engine) if engine is not None else folder / f"{stem}.engine"
    cache_path = (
        Path(asked.timing_cache)
        if asked.timing_cache is not None
        else folder / timing_cache_name(trt, gpu)
    )
    layers_path = engine_path.with_name(engine_path.name.removesuffix(".engine") + ".layers.json")
    return engine_path, cache_path, layers_path


def _source(export_dir_or_info: str | Path | ExportSource) -> ExportSource:
    if isinstance(export_dir_or_info, ExportSource):
        return export_dir_or_info
    return load_source(export_dir_or_info)


def _without_best(
    precision: str | None, sm: int | None, source: ExportSource
) -> tuple[str | None, tuple[str, ...]]:
    """``best`` for an FP32 graph on an unknown GPU is FP16 (with the note that says so)."""
    if precision == "best" and sm is None and source.graph_precision == "fp32":
        # BF16 needs SM >= 80, which only the target GPU can tell
        return "fp16", (
            "precision best: the target GPU is unknown here, so FP16 (ask for bf16 "
            "where the GPU has compute capability 8.0 or newer)",
        )
    return precision, ()


def _precision_arguments(
    source: ExportSource, choice: PrecisionChoice, trt: str
) -> tuple[list[str], tuple[str, ...]]:
    """The typing, builder-flag, FP32-pin and TF32 arguments of a choice, and their notes."""
    argv = ["--stronglyTyped"] if choice.strongly_typed else []
    argv += [f"--{flag}" for flag in choice.builder_flags]
    notes: tuple[str, ...] = ()
    names: list[str] = []
    if choice.constrain_fp32:
        names = fp32_layer_names(source.onnx)
        if trt == "8.6":
            names, notes = _unnamed_on_trt86(source.onnx, names)
        if names:
            argv += [
                "--precisionConstraints=obey",
                "--layerPrecisions=" + ",".join(f"{n}:fp32" for n in names),
            ]
    if choice.precision in ("fp32", "int8") or names:
        # trtexec enables TF32 unless --noTF32 (sampleOptions.cpp, strongly typed too); the Python
        # build (Polygraphy CreateConfig, tf32=False) does not: an FP32 engine means FP32, and so
        # do the float layers of an INT8 one (LayerNorm, softmax, head: FP32 in the graph) and the
        # layers an FP16/BF16 build pins to FP32 (the decisions' tail sum is a MatMul)
        argv.append("--noTF32")
    if "int8" in choice.builder_flags:
        notes += (
            "--int8 turns on TensorRT's explicit quantization of the graph's Q/DQ pairs (their "
            "scales are in model.onnx: no calibration); leave out the --fp16 or --best that "
            "trtexec suggests: they would let TensorRT run LayerNorm, softmax and the ensemble "
            "head in FP16, which this export keeps in FP32",
        )
    return argv, notes


@dataclass(frozen=True)
class GenerationCommand:
    """One TensorRT generation's way to build an export: its trtexec command, or why it has none."""

    trt: str
    command: TrtexecCommand | None
    error: str | None = None

    @property
    def name(self) -> str:
        """The generation in words (:data:`GENERATION_NAMES`), e.g. with its JetPack release."""
        return GENERATION_NAMES[self.trt]

    def record(self) -> dict[str, object]:
        """As JSON (``hydra-build --trtexec --json``): the command's parts, or the error."""
        command = self.command
        if command is None:
            return {"trt": self.trt, "error": self.error}
        return {
            "trt": self.trt,
            "precision": command.precision,
            "strongly_typed": command.strongly_typed,
            "argv": list(command.argv),
            "command": command.shell,
            "engine": str(command.engine),
            "timing_cache": str(command.timing_cache),
            "layer_info": str(command.layer_info) if command.layer_info else None,
            "notes": list(command.notes),
        }


def trtexec_commands(
    export_dir_or_info: str | Path | ExportSource,
    *,
    generations: Sequence[str] | None = None,
    **options: object,
) -> tuple[GenerationCommand, ...]:
    """The trtexec command of every TensorRT generation (or of those given) for one export.

    What ``hydra-build --trtexec`` and ``hydra-export``'s hint both print (:func:`command_lines`).
    ``options`` are :func:`trtexec_command`'s (``options=EngineBuildOptions(...)`` among them). A generation that cannot build the export gets its
    reason instead of a command; with one generation asked for, that reason is raised.

    Raises:
        EngineError: an unknown generation; the one generation asked for cannot build it; the
            export cannot be read.
    """
    source = _source(export_dir_or_info)
    wanted = tuple(generations) if generations else tuple(GENERATIONS)
    results = []
    for trt in wanted:
        try:
            command = trtexec_command(source, trt=trt, **options)  # type: ignore[arg-type]
        except EngineError as err:
            if len(wanted) == 1 or trt not in GENERATIONS:
                raise
            results.append(GenerationCommand(trt, None, str(err)))
            continue
        results.append(GenerationCommand(trt, command))
    return tuple(results)


def command_lines(results: Sequence[GenerationCommand], *, headers: bool = True) -> list[str]:
    """The lines that show ``results``: per generation a ``# <generation>`` header (``headers``),
    ``# note:`` lines, then the command or ``# not available: <why>``; a blank line between
    generations."""
    lines: list[str] = []
    for index, result in enumerate(results):
        if headers:
            lines += ([""] if index else []) + [f"# {result.name}"]
        if result.command is None:
            lines.append(f"# not available: {result.error}")
            continue
        lines += [f"# note: {note}" for note in result.command.notes]
        lines.append(result.command.shell)
    return lines
