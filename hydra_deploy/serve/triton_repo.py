"""Triton model repositories for an export folder: the ONNX model and, when built, its TensorRT plan.

``write_triton_repository(export_dir, repo)`` adds to ``repo`` (a folder Triton's
``--model-repository`` points at; made when absent, other models in it are left alone)::

    REPO/
      README.md                  how to start Triton on it, and what each model answers
      <name>/                    platform onnxruntime_onnx
        config.pbtxt
        labels.txt               class names: Triton's classification extension on ``probs``
        hydra.json               the export's record (Triton ignores files it does not know)
        1/model.onnx
      <name>-trt/                platform tensorrt_plan (with ``engine=``)
        config.pbtxt, labels.txt, hydra.json, engine.json (the engine's sidecar)
        1/model.plan

Each ``config.pbtxt`` declares every input and output of the graph (names, Triton types, shapes
without the batch axis; per-example scores of shape [batch] as ``dims: [1]`` reshaped to ``[]``),
``max_batch_size`` (the export's or the engine's profile maximum), a dynamic batcher with preferred
sizes (the profile's opt and max) and an instance group. A TensorRT plan's tensors take the
engine's dtypes from its sidecar (``engine_io``): TensorRT 8.6 makes int64 tensors int32, and
Triton's TensorRT backend refuses a config whose types differ from the engine's. The uncertainty scores must be computed in
the graph (``hydra-export --uq-outputs``): Triton then answers them with no Python backend.

Decisions (``hydra-calibrate``) are served the same way: when ``model.onnx`` computes them
(``hydra-calibrate --in-graph``: ``calibrated_probs`` [C] float32, ``prediction_set`` [C],
``accept`` and ``ood_flag`` (bool, ``TYPE_BOOL``) for the rules the record holds), the config
declares them like every other output (``calibrated_probs`` carries ``labels.txt`` too), after
checking that hydra.json lists them and that the record was fitted on this ``model.onnx``. The
repository has no Python backend to post-process scores, so decisions held in hydra.json only
are not served: the model's ``config.pbtxt`` and the README say so, and
``hydra-calibrate EXPORT --data LABELLED --in-graph --overwrite`` puts them in the graph.

The text is written here (no protobuf needed at export time) and, when ``tritonclient`` is
installed, parsed with Triton's own ``ModelConfig`` protobuf before anything is written. Each model
folder is assembled under a temporary name beside it and renamed into place, so a model folder with
a ``config.pbtxt`` is always complete. Imports the standard library, the export folder's reader
(``hydra_deploy.export_folder``) and the options' helper only; never torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra_deploy.atomic import atomic_write_text, staging_dir
from hydra_deploy.engines.build_options import options_with
from hydra_deploy.errors import HydraError, ServeError
from hydra_deploy.export_folder import (
    DECISION_OUTPUTS,
    ENGINE_INFO_FILE,
    INFO_FILE,
    MODEL_FILE,
    EngineInfo,
    ExportInfo,
    engine_info_path,
    file_sha256,
    read_engine_info,
    read_info,
)
from hydra_deploy.optional import lazy_module, missing, require

text_format = lazy_module("google.protobuf.text_format")  # tritonclient's: there when it is

logger = logging.getLogger("hydra_deploy")

#: numpy dtype name -> Triton's data type: Triton spells the numpy names with FP/BF for float/bfloat
#: (``float32`` -> ``TYPE_FP32``, ``bfloat16`` -> ``TYPE_BF16``, ``int64`` -> ``TYPE_INT64``)
TRITON_TYPES = {
    dtype: "TYPE_" + dtype.upper().replace("BFLOAT", "BF").replace("FLOAT", "FP")
    for dtype in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8")
} | {"bool": "TYPE_BOOL"}
KINDS = {"auto": "KIND_AUTO", "cpu": "KIND_CPU", "gpu": "KIND_GPU"}
PLATFORMS = {"onnx": "onnxruntime_onnx", "tensorrt": "tensorrt_plan"}
DEFAULT_FILES = {"onnxruntime_onnx": "model.onnx", "tensorrt_plan": "model.plan"}
DEFAULT_QUEUE_DELAY_US = 100
README_MARK = "<!-- written by hydra-deploy: hydra-export --triton / hydra-build --triton -->"
#: The outputs ``hydra-calibrate --in-graph`` adds to model.onnx
#: (:mod:`hydra_deploy.export.decision_graph`), the rules' in the order written.
#: Outputs over the classes that Triton's classification extension labels (``labels.txt``).
LABELLED_OUTPUTS = ("probs", "calibrated_probs")
#: What a model whose hydra.json holds decisions its graph does not compute says (config, README).
NOT_IN_GRAPH = (
    "the decisions in hydra.json (hydra-calibrate) are not computed by this model: Triton serves "
    "what the graph computes, so put them in it with hydra-calibrate EXPORT --data LABELLED "
    "--in-graph --overwrite (or serve the export with hydra-serve, which applies them)"
)
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


class Enum(str):
    """A protobuf enum value in text format (written bare, not quoted)."""


@dataclass
class TritonModel:
    """One model of a repository: what its ``config.pbtxt`` declares."""

    name: str
    platform: str
    max_batch_size: int
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    preferred_batch_size: list[int]
    queue_delay_us: int = DEFAULT_QUEUE_DELAY_US
    instances: int = 1
    kind: str = "auto"
    labels: list[str] | None = None
    notes: list[str] = field(default_factory=list)
    comments: list[str] = field(default_factory=list)  # ``#`` lines atop config.pbtxt

    def fields(self) -> list[tuple[str, Any]]:
        """The config as ordered (field, value) pairs of Triton's ``ModelConfig`` message."""

        def tensor(spec: dict[str, Any], is_output: bool) -> list[tuple[str, Any]]:
            dims = [-1 if not isinstance(d, int) or d < 0 else d for d in spec["shape"][1:]]
            entry: list[tuple[str, Any]] = [
                ("name", spec["name"]),
                ("data_type", Enum(TRITON_TYPES[spec["dtype"]])),
            ]
            if dims:
                entry.append(("dims", dims))
            else:  # one value per example: Triton wants a non-empty shape, the model gives [batch]
                entry += [("dims", [1]), ("reshape", [("shape", [])])]
            if is_output and self.labels and spec["name"] in LABELLED_OUTPUTS:
                entry.append(("label_filename", "labels.txt"))
            return entry

        return [
            ("name", self.name),
            ("platform", self.platform),
            ("max_batch_size", self.max_batch_size),
            ("input", [tensor(s, False) for s in self.inputs]),
            ("output", [tensor(s, True) for s in self.outputs]),
            (
                "dynamic_batching",
                [
                    ("preferred_batch_size", list(self.preferred_batch_size)),
                    ("max_queue_delay_microseconds", self.queue_delay_us),
                ],
            ),
            ("instance_group", [[("count", self.instances), ("kind", Enum(KINDS[self.kind]))]]),
            ("default_model_filename", DEFAULT_FILES[self.platform]),
        ]

    def pbtxt(self) -> str:
        """``config.pbtxt``: protobuf text format of the ``ModelConfig`` (``comments`` first)."""
        header = "".join(
            f"# {line}\n"
            for text in self.comments
            for line in textwrap.wrap(text, 96, break_on_hyphens=False)
        )
        return header + _text_format(self.fields()) + "\n"


def _scalar(value: Any) -> str:
    if isinstance(value, Enum):
        return str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a C-style escaped, double-quoted string, as text format reads
    raise TypeError(f"no text-format form for {value!r}")


def _is_message(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, tuple) for v in value) and bool(value)


def _text_format(fields: list[tuple[str, Any]], depth: int = 0) -> str:
    """Protobuf text format of (field, value) pairs: scalars, lists of scalars, messages (lists of
    pairs) and repeated messages (lists of messages)."""
    pad = "  " * depth
    lines = []
    for key, value in fields:
        if _is_message(value):
            lines.append(f"{pad}{key} {{\n{_text_format(value, depth + 1)}\n{pad}}}")
        elif isinstance(value, list) and value and all(_is_message(v) for v in value):
            items = [f"{pad}  {{\n{_text_format(v, depth + 2)}\n{pad}  }}" for v in value]
            lines.append(f"{pad}{key} [\n" + ",\n".join(items) + f"\n{pad}]")
        elif isinstance(value, list) and key == "shape" and not value:
            lines.append(f"{pad}{key}: []")
        elif isinstance(value, list):
            lines.append(f"{pad}{key}: [ {', '.join(_scalar(v) for v in value)} ]")
        else:
            lines.append(f"{pad}{key}: {_scalar(value)}")
    return "\n".join(lines)


def parse_config(text: str) -> Any:
    """Parse ``config.pbtxt`` text with Triton's ``ModelConfig`` protobuf (needs ``tritonclient``).

    Raises :class:`ServeError` naming the parser's complaint.
    """
    # required at each call (not a lazy module, which would keep it once imported): a missing
    # tritonclient is found as it is now
    model_config_pb2 = require(
        "tritonclient.grpc.model_config_pb2", purpose="parsing a Triton config", error=ServeError
    )
    try:
        return text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as err:
        raise ServeError(
            f"Triton's ModelConfig does not parse the generated config: {err}"
        ) from err


def _check_parses(model: TritonModel, text: str) -> None:
    if missing("tritonclient.grpc.model_config_pb2"):
        logger.debug("tritonclient is not installed: config.pbtxt of %s not parsed", model.name)
        return
    parsed = parse_config(text)
    if parsed.name != model.name or len(parsed.output) != len(model.outputs):
        raise ServeError(f"the generated config of {model.name} parses to another model: {parsed}")


# --- reading what the export and the engine declare ------------------------------------------------------
def _read_export(export_dir: Path) -> ExportInfo:
    if not export_dir.is_dir() or not (export_dir / MODEL_FILE).is_file():
        raise ServeError(
            f"{str(export_dir)!r} is not an export folder (model.onnx and hydra.json); make one "
            "with hydra-export --out DIR"
        )
    export = read_info(export_dir)  # Triton's config is written from its inputs and outputs
    for key in ("inputs", "outputs"):
        specs = export.inputs if key == "inputs" else export.outputs  # checked by their owner
        if not specs or not all(_is_tensor(s) for s in specs):  # and what Triton needs
            raise export.malformed_tensors(key)
    if not export.uq_outputs:
        raise ServeError(
            f"{export_dir} has no uncertainty outputs in its graph; Triton serves what the graph "
            f"computes, so re-export with them: hydra-export --from {export_dir} --uq-outputs "
            "--out NEW_DIR (or pass --triton to hydra-export, which adds them)"
        )
    return export


def served_decisions(export_dir: Path, info: ExportInfo) -> tuple[list[str], bool]:
    """(the decision outputs the graph computes, whether hydra.json holds decisions it does not).

    A record ``in_graph`` must be matched by hydra.json's outputs (one per rule it holds) and
    fitted on this ``model.onnx``; a ServeError (an ExportFolderError for a stale record) says to
    calibrate again otherwise."""
    outputs = [s["name"] for s in info.outputs if s["name"] in DECISION_OUTPUTS]
    record = info.decisions  # checked by read_info
    if record is None:
        return outputs, False
    if not record.in_graph:
        return outputs, True
    wanted = [n for n in record.fields if n in DECISION_OUTPUTS]
    missing = [n for n in wanted if n not in outputs]
    if missing:
        raise ServeError(
            f"{export_dir / INFO_FILE} says its decisions are in model.onnx, but its outputs "
            f"lack {', '.join(missing)}; put them in again with hydra-calibrate {export_dir} "
            "--data LABELLED --in-graph --overwrite"
        )
    record.check_fitted_on(file_sha256(export_dir / MODEL_FILE), str(export_dir))
    return outputs, False


def _is_tensor(spec: Any) -> bool:
    return (
        isinstance(spec, dict)
        and isinstance(spec.get("name"), str)
        and isinstance(spec.get("shape"), list)
        and len(spec["shape"]) >= 1
        and spec.get("dtype") in TRITON_TYPES
    )


def _profile(where: str, parsed: tuple[int, int, int] | None) -> tuple[int, int, int]:
    """A batch profile Triton needs (parsed by its record's reader): an absent one is refused."""
    if parsed is None:
        raise ServeError(
            f"{where} has no batch_profile; re-export the model with hydra-export, or rebuild "
            "the engine with hydra-build"
        )
    return parsed


def _engine_profile(
    engine: Path, info: ExportInfo
) -> tuple[tuple[int, int, int], EngineInfo | None]:
    """The engine's batch range from its JSON sidecar (hydra-build), else the export's profile
    (what the trtexec recipes build by default)."""
    engine_info = read_engine_info(engine)  # checked there (its format included)
    if engine_info is None:
        logger.info("%s has no JSON sidecar: using the export's batch profile", engine.name)
        return _profile(INFO_FILE, info.batch_profile), None
    export_sha = info.onnx_sha256
    if engine_info.onnx_sha256 and engine_info.onnx_sha256 != export_sha:
        raise ServeError(
            f"{engine} was built from another ONNX file (sidecar onnx_sha256 "
            f"{engine_info.onnx_sha256[:12]}, export {str(export_sha)[:12]}); "
            "rebuild it from this export with hydra-build"
        )
    return _profile(str(engine_info.path), engine_info.batch_profile), engine_info


# --- planning ------------------------------------------------------------------------------------------------
def _engine_io(engine: Path, info: ExportInfo, sidecar: EngineInfo | None) -> tuple[list, list]:
    """The export's inputs and outputs with the engine's dtypes: Triton's TensorRT backend refuses
    a config whose data_type differs from the engine's, and TensorRT 8.6's ONNX parser turns INT64
    tensors (token ids, predicted classes) into INT32 (onnx-tensorrt 8.6-GA ``convertDtype``).

    From the sidecar's ``engine_io`` (hydra-build records what the parsed network has); without
    one (a trtexec build) from the engine's name: ``.trt8.*`` means INT32 for INT64.
    """
    recorded = None if sidecar is None else sidecar.engine_io
    if isinstance(recorded, dict):
        dtypes: dict[str, str] = {}
        for key in ("inputs", "outputs"):
            for tensor in recorded.get(key) or []:
                if not (isinstance(tensor, dict) and tensor.get("dtype") in TRITON_TYPES):
                    raise ServeError(
                        f"{engine_info_path(engine)} has a malformed engine_io entry "
                        f"{tensor!r:.100}; rebuild the engine with hydra-build"
                    )
                dtypes[str(tensor.get("name"))] = tensor["dtype"]

        def retype(spec: dict[str, Any]) -> dict[str, Any]:
            return {**spec, "dtype": dtypes.get(spec["name"], spec["dtype"])}
    elif re.search(r"\.trt8\.", engine.name):
        logger.info(
            "%s: no sidecar; a TensorRT 8 engine takes INT32 for INT64 tensors", engine.name
        )

        def retype(spec: dict[str, Any]) -> dict[str, Any]:
            return {**spec, "dtype": "int32" if spec["dtype"] == "int64" else spec["dtype"]}
    else:
        return list(info.inputs), list(info.outputs)
    return [retype(s) for s in info.inputs], [retype(s) for s in info.outputs]


def sanitize_model_name(name: str) -> str:
    """``name`` in the characters Triton's file-system repository and URLs accept (others become
    ``_``); ``"hydra"`` if none is left."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._-")
    return cleaned or "hydra"


def default_model_name(path: str | os.PathLike) -> str:
    """A Triton model name for an export folder (a model file: its name without suffix; the folder
    need not exist yet), sanitised."""
    target = Path(os.path.abspath(path))
    model_file = (
        target.suffix.lower() in (".onnx", ".engine", ".plan", ".trt") and not target.is_dir()
    )
    return sanitize_model_name(target.stem if model_file else target.name)


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ServeError(
            f"Triton model name {name!r} is not usable: use letters, digits, '_', '.' and '-' "
            "(at most 128, not starting with '.' or '-')"
        )
    return name


def _preferred(asked: list[int] | None, opt: int, max_batch: int, what: str) -> list[int]:
    sizes = sorted({min(opt, max_batch), max_batch}) if asked is None else sorted(set(asked))
    bad = [
        s for s in sizes if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= max_batch
    ]
    if bad or not sizes:
        raise ServeError(
            f"preferred batch sizes {asked} must be between 1 and the max batch {max_batch} "
            f"({what})"
        )
    return sizes


def _check_count(name: str, value: Any, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ServeError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


@dataclass(frozen=True)
class TritonModelOptions:
    """How the export's models are served: their name, batching and instances (the settings
    :func:`plan_repository` and :func:`write_triton_repository` share; what hydra-export's and
    hydra-build's ``--triton-*`` flags set). Each is checked when the group is made.

    ``model_name``: the ONNX model's name (default: the export folder's; the engine's is
    ``NAME-trt``). ``max_batch``: Triton's ``max_batch_size`` (default: the profile maximum; at
    most that). ``preferred_batch``: the dynamic batcher's preferred sizes (default: the
    profile's opt and max). ``queue_delay_us``: its max queue delay. ``instances``: model
    instances per device. ``kind``: the ONNX model's instance kind, ``auto`` (GPU where Triton
    sees one, else CPU), ``cpu`` or ``gpu``; a TensorRT plan always runs on the GPU.
    """

    model_name: str | None = None
    max_batch: int | None = None
    preferred_batch: list[int] | None = None
    queue_delay_us: int = DEFAULT_QUEUE_DELAY_US
    instances: int = 1
    kind: str = "auto"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ServeError(f"unknown instance kind {self.kind!r}; use one of {', '.join(KINDS)}")
        _check_count("instances", self.instances)
        _check_count("queue delay (microseconds)", self.queue_delay_us, low=0)
        if self.max_batch is not None:
            _check_count("max batch", self.max_batch)


@dataclass(frozen=True)
class _Export:
    """What every model of one export shares: its record, labels and decisions' state."""

    info: ExportInfo
    labels: list[str] | None
    decisions_elsewhere: bool


def _model(
    export: _Export,
    asked: TritonModelOptions,
    name: str,
    platform: str,
    profile: tuple[int, int, int],
    what: str,
    kind: str,
    io: tuple[list, list] | None = None,
) -> TritonModel:
    """One model of the repository: ``what`` (the export or the engine) of batch ``profile``."""
    top = profile[2] if asked.max_batch is None else asked.max_batch
    if top > profile[2]:
        raise ServeError(
            f"max batch {top} is above the {what}'s profile maximum {profile[2]}; give at "
            f"most {profile[2]}, or re-export/rebuild with a larger --max-batch"
        )
    notes, comments = [], []
    if export.decisions_elsewhere:
        notes.append(NOT_IN_GRAPH)
        comments.append(NOT_IN_GRAPH)
    if profile[0] > 1:
        notes.append(
            f"the {what} takes batches of {profile[0]} or more; Triton sends "
            "smaller ones as they come, which this model refuses"
        )
    info = export.info
    inputs, outputs = io if io is not None else (list(info.inputs), list(info.outputs))
    return TritonModel(
        name=name,
        platform=platform,
        max_batch_size=top,
        inputs=inputs,
        outputs=outputs,
        preferred_batch_size=_preferred(asked.preferred_batch, profile[1], top, what),
        queue_delay_us=asked.queue_delay_us,
        instances=asked.instances,
        kind=kind,
        labels=export.labels,
        notes=notes,
        comments=comments,
    )


def _served_export(export_dir: Path) -> _Export:
    """The export's record, checked for what Triton's dynamic batcher needs."""
    info = _read_export(export_dir)
    dynamic = all(not isinstance(s["shape"][0], int) for s in info.inputs + info.outputs)
    if not dynamic:
        raise ServeError(
            f"{export_dir}'s model has a fixed batch axis; Triton's dynamic batcher needs a "
            "dynamic one: re-export it with hydra-export (batch is dynamic by default)"
        )
    labels = None if info.class_names is None else list(info.class_names)
    if labels is not None:
        labels = [" ".join(str(c).split()) for c in labels]  # one line each
    _, decisions_elsewhere = served_decisions(export_dir, info)
    return _Export(info, labels, decisions_elsewhere)


def plan_repository(
    export_dir: str | os.PathLike,
    options: TritonModelOptions | None = None,
    *,
    engine: str | os.PathLike | None = None,
    **settings: Any,
) -> list[TritonModel]:
    """The models :func:`write_triton_repository` would write (nothing is written): ``options``
    (a :class:`TritonModelOptions`, or its fields as keywords: ``instances=2``, ``kind="cpu"``,
    ...; keywords win) for the export and ``engine``, a TensorRT plan built from it."""
    asked = options_with(TritonModelOptions, options, settings, "plan_repository")
    export_dir = Path(export_dir)
    export = _served_export(export_dir)
    name = check_name(asked.model_name or default_model_name(export_dir))
    onnx_profile = _profile(INFO_FILE, export.info.batch_profile)
    models = [_model(export, asked, name, PLATFORMS["onnx"], onnx_profile, "export", asked.kind)]
    if engine is not None:
        engine = Path(engine)
        if not engine.is_file():
            raise ServeError(
                f"engine {str(engine)!r} does not exist; build it with hydra-build (or trtexec)"
            )
        profile, sidecar = _engine_profile(engine, export.info)
        io = _engine_io(engine, export.info, sidecar)
        trt_name = check_name(f"{name}-trt")
        models.append(
            _model(export, asked, trt_name, PLATFORMS["tensorrt"], profile, "engine", "gpu", io)
        )
    return models


# --- writing -------------------------------------------------------------------------------------------------
def refuse_existing_models(repo: Path, names: list[str], overwrite: bool) -> None:
    """Refuse before any work when a model folder exists and ``overwrite`` is off."""
    if repo.exists() and not repo.is_dir():
        raise ServeError(f"Triton repository {str(repo)!r} is a file; give a folder")
    taken = [n for n in names if (repo / n).exists()]
    if taken and not overwrite:
        raise ServeError(
            f"{str(repo)!r} already holds {'model' if len(taken) == 1 else 'models'} "
            f"{', '.join(taken)}; pass --overwrite to replace "
            f"{'it' if len(taken) == 1 else 'them'}, or --triton-name NAME to add under another "
            "name"
        )


def _assemble(model: TritonModel, staging: Path, export_dir: Path, engine: Path | None) -> None:
    version = staging / "1"
    version.mkdir(parents=True)
    if model.platform == PLATFORMS["onnx"]:
        shutil.copy2(export_dir / MODEL_FILE, version / "model.onnx")
    else:
        shutil.copy2(engine, version / "model.plan")
        sidecar = engine_info_path(engine)
        if sidecar.is_file():
            shutil.copy2(sidecar, staging / ENGINE_INFO_FILE)
    shutil.copy2(export_dir / INFO_FILE, staging / INFO_FILE)
    if model.labels:
        (staging / "labels.txt").write_text("\n".join(model.labels) + "\n", encoding="utf-8")
    (staging / "config.pbtxt").write_text(model.pbtxt(), encoding="utf-8")


def _install(staging: Path, target: Path) -> None:
    """Rename the assembled folder into place; an old one is moved aside first, then removed."""
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
        os.replace(target, old / target.name)
    try:
        os.replace(staging, target)
    except BaseException:
        if old is not None:
            os.replace(old / target.name, target)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def write_triton_repository(
    export_dir: str | os.PathLike,
    repo: str | os.PathLike,
    options: TritonModelOptions | None = None,
    *,
    engine: str | os.PathLike | None = None,
    overwrite: bool = False,
    **settings: Any,
) -> dict[str, Any]:
    """Add the export (and ``engine``, a TensorRT plan built from it) to the Triton model
    repository ``repo``; see the module docstring. ``options``: a :class:`TritonModelOptions`,
    or its fields as keywords (``model_name=``, ``max_batch=``, ``preferred_batch=``,
    ``queue_delay_us=``, ``instances=``, ``kind=``). Returns ``{"repository", "models": [...]}``
    with each model's name, platform, folder and config. Existing model folders of these names are
    refused unless ``overwrite``; other models in ``repo`` are left as they are."""
    asked = options_with(TritonModelOptions, options, settings, "write_triton_repository")
    export_dir, repo = Path(export_dir), Path(repo)
    models = plan_repository(export_dir, asked, engine=engine)
    refuse_existing_models(repo, [m.name for m in models], overwrite)
    for model in models:
        _check_parses(model, model.pbtxt())
    try:
        repo.mkdir(parents=True, exist_ok=True)
        for model in models:
            staging = staging_dir(repo, model.name, suffix=".partial")
            try:
                _assemble(model, staging, export_dir, Path(engine) if engine else None)
                _install(staging, repo / model.name)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
        atomic_write_text(repo / "README.md", repository_readme(repo))
    except OSError as err:
        raise ServeError(f"cannot write the Triton repository {str(repo)!r}: {err}") from err
    for model in models:
        for note in model.notes:
            logger.warning("%s: %s", model.name, note)
    return {
        "repository": str(repo),
        "models": [
            {
                "name": m.name,
                "platform": m.platform,
                "path": str(repo / m.name),
                "max_batch_size": m.max_batch_size,
                "preferred_batch_size": m.preferred_batch_size,
                "instances": m.instances,
                "kind": KINDS[m.kind],
                "config": m.pbtxt(),
            }
            for m in models
        ],
    }


def _models_in(repo: Path) -> list[tuple[str, ExportInfo, EngineInfo | None]]:
    """(name, hydra.json, engine sidecar) of each hydra model folder in ``repo``."""
    found = []
    for folder in sorted(p for p in repo.iterdir() if p.is_dir() and not p.name.startswith(".")):
        with contextlib.suppress(OSError, ValueError, HydraError):
            info = read_info(folder)
            sidecar = read_engine_info(folder / ENGINE_INFO_FILE)
            served = info.inputs and info.outputs  # checked: a malformed model is left out
            if served and (folder / "config.pbtxt").is_file():
                found.append((folder.name, info, sidecar))
    return found


def _decisions_cell(info: ExportInfo) -> str:
    """The README's decisions column of a model: what its graph answers, or why nothing."""
    names = [s["name"] for s in info.outputs if s["name"] in DECISION_OUTPUTS]
    if info.decisions is not None and info.decisions.in_graph and names:
        return ", ".join(f"`{n}`" for n in names)
    if info.decisions is not None:
        return "in hydra.json only: not served (see Decisions)"
    return "none"


def repository_readme(repo: Path) -> str:
    """The repository's README: how to start Triton on it and query each hydra model."""
    models = _models_in(repo)
    rows = [_readme_row(repo, name, info, sidecar) for name, info, sidecar in models]
    checks = [_perf_analyzer_line(name, info) for name, info, _ in models]
    return _README.format(
        mark=README_MARK,
        rows="\n".join(rows),
        checks="\n".join(checks),
        repo=repo.name,
        first=models[0][0] if models else "MODEL",
    )


def _readme_row(repo: Path, name: str, info: ExportInfo, sidecar: EngineInfo | None) -> str:
    """A model's row of the README's table: name, backend, inputs, decisions."""
    plan = sidecar is not None or (repo / name / "1" / "model.plan").exists()
    shape = ", ".join(f"`{s['name']}` {s['shape']} {s.get('dtype')}" for s in info.inputs)
    target = ""
    if sidecar is not None:
        gpu, version = sidecar.gpu_name or "?", sidecar.tensorrt_version or "?"
        target = f"; built for {gpu} with TensorRT {version}"
    kind = "TensorRT plan" if plan else "ONNX"
    return f"| `{name}` | {kind}{target} | {shape} | {_decisions_cell(info)} |"


def _perf_analyzer_line(name: str, info: ExportInfo) -> str:
    """The load-test command of a model (its first input, 16 for a dynamic dimension)."""
    first = (info.inputs or ({},))[0]
    dims = ",".join(str(d) if isinstance(d, int) else "16" for d in first.get("shape", [])[1:])
    return f"perf_analyzer -m {name} --concurrency-range 1:8 --shape {first.get('name')}:{dims}"


#: The README's text (``str.format``: mark, rows, checks, repo, first).
_README = """{mark}
# Triton model repository

| model | backend | inputs (batch first) | decisions |
|---|---|---|---|
{rows}

Every model answers `member_logits` [M, classes] per example and the uncertainty scores computed in
its graph: `probs` [classes], `msp`, `predictive_entropy`, `expected_entropy`, `mutual_information`
(one value each). `probs` carries the class names (`labels.txt`), so Triton's classification
extension (`class_count` in a request) returns the top classes by name.

## Decisions

A model whose `model.onnx` computes its decisions (`hydra-calibrate EXPORT --data LABELLED
--in-graph`) also answers `calibrated_probs` [classes] (float32, with the class names too),
`prediction_set` [classes] (bool: the classes of the conformal set) and `accept` and `ood_flag`
(bool, one value each), for the rules its calibration holds (see its `hydra.json`, entry
`decisions`). The calibrated confidence is the largest of `calibrated_probs`. This repository
has no Python backend to post-process scores: decisions kept in `hydra.json` only (calibrated
without `--in-graph`) are not served here; re-run `hydra-calibrate EXPORT --data LABELLED
--in-graph --overwrite` and write the repository again, or serve the export with `hydra-serve`,
which applies them.

## Start Triton on it

```bash
docker run --rm --gpus all -p 8000:8000 -p 8001:8001 -p 8002:8002 \\
  -v "$PWD/{repo}":/models nvcr.io/nvidia/tritonserver:<release>-py3 \\
  tritonserver --model-repository=/models
curl -s localhost:8000/v2/models/{first}/ready -o /dev/null -w "%{{http_code}}\\n"   # 200
```

On a CPU-only host drop `--gpus all`: the ONNX models' instance groups are `KIND_AUTO` unless the
repository was written with `--triton-device cpu`. On a Jetson, run the `tritonserver` of the
JetPack release's Triton tarball with the same `--model-repository`.

A TensorRT plan loads only in a Triton whose TensorRT version is the one the engine was built with
(see its `engine.json`) and on the same GPU model: pick the Triton release by NVIDIA's framework
support matrix, or rebuild the engine inside that release's container (`hydra-build` there, or
`trtexec` from `hydra-build --trtexec`).

## Query it

```python
import numpy as np, tritonclient.http as http
client = http.InferenceServerClient("localhost:8000")
x = http.InferInput("pixel_values", [1, 3, 224, 224], "FP32")   # see the inputs above
x.set_data_from_numpy(np.zeros((1, 3, 224, 224), np.float32))
result = client.infer("{first}", [x])
print(result.as_numpy("msp"), result.as_numpy("mutual_information"))
```

Load test (Triton's SDK container):

```bash
{checks}
```
"""
