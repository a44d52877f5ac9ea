"""One runner interface over ONNX Runtime sessions and TensorRT engines.

``load_runner(path)`` takes an export folder (``model.onnx`` + ``hydra.json``), a ``.onnx`` file or
a TensorRT engine file (``.engine``/``.plan``/``.trt``) and returns a :class:`Runner`::

    runner = load_runner("export/vit_b16-m3")
    outputs = runner(pixel_values)            # numpy in, dict of numpy arrays out
    scores = ensemble_scores(outputs["member_logits"])

Before every call the inputs are checked against the model (names, rank, fixed dimensions, dtype,
finite values) and a :class:`~hydra_deploy.errors.RunnerError` names the input, what was expected
and what came. Casts are made only within a kind: float16/float64 arrays go to a float32 input
(float64 is numpy's default, so ``np.random.rand`` arrays work), any integer array goes to an
int64/int32 input (text models' token ids) when its values fit; an integer array for a float input
(raw uint8 pixels, most likely) or a float array for an integer input is refused. Batches above
the model's maximum are split and the outputs concatenated; batches below an engine's minimum are
padded by repeating the last example, and the padding is dropped from the outputs.

Backends:

- ``onnxruntime``: an ``InferenceSession``. Providers default to CUDA (when this onnxruntime build
  has it) then CPU; the TensorRT execution provider is used only when asked for, and then CUDA and
  CPU follow it (for the nodes TensorRT does not take) and its engine and timing caches are on
  (``trt_engine_cache_enable``, ``trt_timing_cache_enable``, in :func:`ort_tensorrt_cache_dir`),
  else every new session builds its engines again. Short names (``"cpu"``, ``"cuda"``,
  ``"tensorrt"``) and ``(name, options)`` pairs are accepted; options given are kept.
- ``tensorrt``: the engine is deserialized with the TensorRT Python API (its I/O tensors and
  optimization profile give the input specs and batch range) and run through Polygraphy's
  ``TrtRunner``, which sets the input shapes, binds device buffers and calls
  ``execute_async_v3`` for us (Polygraphy 0.49.9 and later use only that call; TensorRT has it
  from 8.5), on TensorRT 8.6, JetPack 6 (8.6.2 or 10.3), 10.x and 11 alike. Needs ``tensorrt`` and
  ``polygraphy`` (the ``[trt]`` extra).

Edge runtime: this module imports numpy only; onnxruntime, tensorrt and polygraphy are imported
when a runner of that backend is made. Never torch.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hydra_deploy.errors import RunnerError
from hydra_deploy.export_folder import (
    INFO_FILE,
    MODEL_FILE,
    DecisionRecord,
    ExportInfo,
    file_sha256,
    parse_batch_profile,
    read_info,
)
from hydra_deploy.optional import require

logger = logging.getLogger("hydra_deploy")

ENGINE_SUFFIXES = (".engine", ".plan", ".trt")
BACKENDS = {
    "onnxruntime": "onnxruntime",
    "ort": "onnxruntime",
    "tensorrt": "tensorrt",
    "trt": "tensorrt",
}
PROVIDER_ALIASES = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "trt": "TensorrtExecutionProvider",
    "rocm": "ROCMExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
    "dml": "DmlExecutionProvider",
}
DEFAULT_PROVIDERS = ("CUDAExecutionProvider", "CPUExecutionProvider")
_ORT_TYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(double)": "float64",
    "tensor(bfloat16)": "bfloat16",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(int8)": "int8",
    "tensor(uint8)": "uint8",
    "tensor(bool)": "bool",
}


@dataclass(frozen=True)
class TensorSpec:
    """A model input or output: its name, shape (a str or None for a dynamic dimension) and dtype.

    ``dtype`` is a numpy dtype name (``"float32"``, ``"int64"``; ``"bfloat16"`` where numpy has
    none).
    """

    name: str
    shape: tuple[int | str | None, ...]
    dtype: str

    @property
    def rank(self) -> int:
        return len(self.shape)

    def describe(self) -> str:
        dims = ", ".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.name} [{dims}] {self.dtype}"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


def _is_fixed(dim: int | str | None) -> bool:
    return isinstance(dim, int) and dim >= 0


class Runner:
    """Runs a model file: ``runner(inputs) -> dict[str, np.ndarray]``.

    Attributes: ``backend`` ("onnxruntime" or "tensorrt"), ``path`` (the file run), ``inputs`` and
    ``outputs`` (:class:`TensorSpec` tuples; ``input_names``, ``output_names``), ``providers``
    (ONNX Runtime's providers in use; ``("TensorRT",)`` for engines), ``min_batch`` / ``max_batch``
    (the batch range a call is split and padded to; ``max_batch`` None: no limit), ``info`` (the
    export's ``hydra.json`` when one is beside the file, else None) and ``engine_info`` (an
    engine's JSON sidecar). ``spec``, ``class_names``, ``preprocessing`` and ``precision`` read
    from those. Close it (or use it in a ``with`` block) to free an engine's GPU memory.
    """

    backend: str = ""

    def __init__(
        self,
        path: Path,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        *,
        providers: Sequence[str] = (),
        min_batch: int = 1,
        max_batch: int | None = None,
        info: dict[str, Any] | None = None,
        engine_info: dict[str, Any] | None = None,
    ) -> None:
        self.path = Path(path)
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.providers = tuple(providers)
        self.min_batch = max(1, int(min_batch))
        self.max_batch = None if max_batch is None else int(max_batch)
        if self.max_batch is not None and self.max_batch < self.min_batch:
            raise RunnerError(
                f"{self.path}: batch range {self.min_batch}..{self.max_batch} is empty; rebuild "
                "the model with min batch <= max batch"
            )
        self.info = info
        self.engine_info = engine_info
        #: the export's checked hydra.json (:class:`~hydra_deploy.export_folder.ExportInfo`) and
        #: the folder holding it (and, for text models, ``tokenizer/``), if known
        self.export_info: ExportInfo | None = None
        self.export_dir: Path | None = None
        #: the decisions (hydra-calibrate) of the export, checked against the model file, if any
        self.decisions: DecisionRecord | None = None
        self.check_metadata(self._embedded_metadata())

    def _embedded_metadata(self) -> dict[str, str]:
        """The model file's own key/value metadata (ONNX ``metadata_props``); none by default."""
        return {}

    def check_metadata(self, embedded: dict[str, str] | None = None) -> None:
        """RunnerError when what the metadata says disagrees with the graph: the member count
        and class count of ``member_logits`` [batch, M, C] against the HydraSpec and class names
        of hydra.json / the engine sidecar / the model file's own metadata (``embedded``: the
        ONNX ``metadata_props``). A dynamic dimension or an absent key is not compared."""
        logits = next((t for t in self.outputs if t.name == "member_logits"), None)
        if logits is None or logits.rank != 3:
            return
        members, classes = logits.shape[1], logits.shape[2]
        sources: list[tuple[str, dict[str, Any]]] = [
            (name, data)
            for name, data in (
                ("hydra.json", self.info),
                ("the engine's JSON sidecar", self.engine_info),
            )
            if isinstance(data, dict)
        ]
        if embedded and embedded.get("hydra_spec"):
            try:
                sources.append(
                    ("the file's hydra_spec metadata", {"spec": json.loads(embedded["hydra_spec"])})
                )
            except ValueError as err:
                raise RunnerError(
                    f"{self.path}: its hydra_spec metadata is not JSON ({err}); re-export the model "
                    "with hydra-export"
                ) from err
        for source, data in sources:
            spec, names = data.get("spec"), data.get("class_names")
            declared_members = None
            if spec is not None:
                if not isinstance(spec, dict) or not isinstance(spec.get("members"), list):
                    raise RunnerError(
                        f"{self.path}: the spec in {source} is malformed (no 'members' list); "
                        "restore it or re-export the model with hydra-export"
                    )
                declared_members = len(spec["members"])
            declared_classes = None
            if names is not None:
                if not isinstance(names, list):
                    raise RunnerError(
                        f"{self.path}: class_names in {source} is not a list; restore it or "
                        "re-export the model with hydra-export"
                    )
                declared_classes = len(names)
            for what, declared, actual in (
                ("members", declared_members, members),
                ("classes", declared_classes, classes),
            ):
                if declared is not None and _is_fixed(actual) and declared != actual:
                    raise RunnerError(
                        f"{self.path}: {source} says {declared} {what}, but the graph's "
                        f"output is {logits.describe()}; the metadata belongs to another "
                        "model or the file was edited: re-export with hydra-export (or remove the "
                        "stale hydra.json)"
                    )

    # --- what the model is -------------------------------------------------------------------
    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.outputs)

    def _meta(self, key: str) -> Any:
        for source in (self.info, self.engine_info):
            if source and source.get(key) is not None:
                return source[key]
        return None

    @property
    def spec(self) -> dict[str, Any] | None:
        """The HydraSpec as a dict (from hydra.json or the engine sidecar), or None."""
        return self._meta("spec")

    @property
    def class_names(self) -> list[str] | None:
        return self._meta("class_names")

    @property
    def preprocessing(self) -> dict[str, Any] | None:
        """timm's data config of the export (input size, interpolation, mean, std, crop)."""
        return self._meta("preprocessing")

    @property
    def precision(self) -> str | None:
        """The engine's build precision (sidecar) or the ONNX file's (hydra.json), if known."""
        for source in (self.engine_info, self.info):
            if source and source.get("precision"):
                return str(source["precision"])
        return None

    @property
    def family(self) -> str | None:
        return self._meta("family")

    def text_encoder(self):
        """The export's tokenizer as a :class:`~hydra_deploy.engines.text.TextEncoder` (text models)."""
        from hydra_deploy.engines.text import TextEncoder

        if self.info is None or self.export_dir is None:
            raise RunnerError(
                f"{self.path} comes without its export folder (hydra.json and tokenizer/), so text "
                "cannot be tokenized for it: run the export folder, or pass token ids in a .npz"
            )
        return TextEncoder.from_export(self.info, self.export_dir)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({str(self.path)!r}, inputs=[{', '.join(t.describe() for t in self.inputs)}], "
            f"outputs={list(self.output_names)}, providers={list(self.providers)}, "
            f"batch={self.min_batch}..{self.max_batch or 'any'})"
        )

    # --- running -----------------------------------------------------------------------------
    def __call__(
        self,
        inputs: np.ndarray | Mapping[str, np.ndarray],
        *,
        batch_size: int | None = None,
        allow_nonfinite: bool = False,
    ) -> dict[str, np.ndarray]:
        """Run the model on a batch; returns every output by name (numpy arrays).

        ``inputs``: an array for a one-input model, or a dict of arrays by input name.
        ``batch_size`` (default: ``max_batch``) splits the batch into chunks of at most that many
        examples. NaN/inf inputs are refused unless ``allow_nonfinite``.
        """
        feed = self.check_inputs(inputs, allow_nonfinite=allow_nonfinite)
        batch = next(iter(feed.values())).shape[0]
        chunk = self._chunk_size(batch_size)
        if batch <= chunk and batch >= self.min_batch:
            return self._run_checked(feed)
        parts: list[dict[str, np.ndarray]] = []
        for start in range(0, batch, chunk):
            part = {k: v[start : start + chunk] for k, v in feed.items()}
            size = next(iter(part.values())).shape[0]
            if size < self.min_batch:  # pad with copies of the last example, then drop them
                pad = self.min_batch - size
                part = {
                    k: np.concatenate([v, np.repeat(v[-1:], pad, axis=0)]) for k, v in part.items()
                }
                parts.append({k: v[:size] for k, v in self._run_checked(part).items()})
            else:
                parts.append(self._run_checked(part))
        return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}

    def _chunk_size(self, batch_size: int | None) -> int:
        if batch_size is None:
            return self.max_batch or np.iinfo(np.int64).max
        if isinstance(batch_size, (bool, np.bool_)) or not isinstance(
            batch_size, (int, np.integer)
        ):
            raise RunnerError(f"batch_size must be an int, got {batch_size!r}")
        if int(batch_size) < 1:
            raise RunnerError(f"batch_size must be at least 1, got {batch_size}")
        if self.max_batch is not None and batch_size > self.max_batch:
            raise RunnerError(
                f"batch_size {batch_size} exceeds the model's maximum batch {self.max_batch} "
                f"({self._batch_source()}); use at most {self.max_batch} (larger batches are "
                "split automatically)"
            )
        return int(batch_size)

    def _batch_source(self) -> str:
        return "its engine profile" if self.backend == "tensorrt" else "hydra.json batch_profile"

    def _run_checked(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = self._run(feed)
        batch = next(iter(feed.values())).shape[0]
        for name, value in outputs.items():
            if value.ndim == 0 or value.shape[0] != batch:
                raise RunnerError(
                    f"output {name!r} has shape {value.shape} for a batch of {batch}; the model "
                    "does not keep the batch as its first axis and cannot be split"
                )
        return outputs

    def _run(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def close(self) -> None:
        """Free the session / engine resources (the runner cannot be called afterwards)."""

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- input checks ------------------------------------------------------------------------
    def check_inputs(
        self, inputs: np.ndarray | Mapping[str, np.ndarray], *, allow_nonfinite: bool = False
    ) -> dict[str, np.ndarray]:
        """The inputs as a feed dict of contiguous arrays of the model's dtypes, or RunnerError."""
        names = self.input_names
        if isinstance(inputs, Mapping):
            given = dict(inputs)
            if "token_type_ids" in names and "token_type_ids" not in given and "input_ids" in given:
                given["token_type_ids"] = np.zeros_like(
                    np.asarray(given["input_ids"])
                )  # one segment
            missing = [n for n in names if n not in given]
            extra = sorted(set(given) - set(names), key=repr)
            if missing or extra:
                raise RunnerError(
                    "inputs do not match the model: "
                    + "; ".join(
                        part
                        for part in (
                            f"missing {missing}" if missing else "",
                            f"unexpected {extra}" if extra else "",
                        )
                        if part
                    )
                    + f"; the model takes {list(names)}"
                )
        else:
            if len(names) != 1:
                raise RunnerError(
                    f"the model takes {len(names)} inputs {list(names)}: pass a dict of arrays "
                    "by name, not one array"
                )
            given = {names[0]: inputs}
        feed: dict[str, np.ndarray] = {}
        batch: tuple[str, int] | None = None
        for spec in self.inputs:
            array = _check_one(spec, given[spec.name], allow_nonfinite)
            if batch is not None and array.shape[0] != batch[1]:
                raise RunnerError(
                    f"input {spec.name!r} has batch {array.shape[0]} but {batch[0]!r} has "
                    f"{batch[1]}; every input needs the same batch size"
                )
            batch = batch or (spec.name, array.shape[0])
            feed[spec.name] = array
        return feed


def _check_one(spec: TensorSpec, value: Any, allow_nonfinite: bool) -> np.ndarray:
    name = spec.name
    try:
        array = np.asarray(value)
    except (ValueError, TypeError) as err:  # ragged nested lists, objects numpy cannot hold
        raise RunnerError(
            f"input {name!r} is not an array numpy can hold ({err}); pass a numpy array of shape "
            f"{list(spec.shape)}"
        ) from None
    if array.ndim != spec.rank:
        raise RunnerError(
            f"input {name!r} must have {spec.rank} dimensions {list(spec.shape)}, got shape "
            f"{array.shape}{_rank_hint(spec, array.shape)}"
        )
    if array.shape[0] == 0:
        raise RunnerError(
            f"input {name!r} is an empty batch (shape {array.shape}); give 1 or more examples"
        )
    for axis, (want, got) in enumerate(zip(spec.shape, array.shape, strict=True)):
        if axis > 0 and _is_fixed(want) and want != got:
            raise RunnerError(
                f"input {name!r} must have size {want} on axis {axis} (shape {list(spec.shape)}), "
                f"got shape {array.shape}{_image_hint(spec, array.shape)}"
            )
    given, array = array, _cast(spec, array)
    if array.dtype.kind == "f" and not allow_nonfinite and not np.isfinite(array).all():
        if given.dtype.kind == "f" and np.isfinite(given).all():
            raise RunnerError(
                f"input {name!r} holds values up to {np.abs(given).max():.3g}, beyond the range "
                f"of {spec.dtype} (+/-{np.finfo(array.dtype).max:.3g}): they would become "
                "infinite; scale the data as the model was trained (hydra-run preprocesses images)"
            )
        bad = int((~np.isfinite(array)).reshape(len(array), -1).any(axis=1).sum())
        raise RunnerError(
            f"input {name!r} holds NaN or infinite values in {bad} of {len(array)} example(s); "
            "fix the data, or pass allow_nonfinite=True (hydra-run --allow-nonfinite) to run it anyway"
        )
    return np.ascontiguousarray(array)


def is_one_example(spec: TensorSpec, shape: tuple[int, ...]) -> bool:
    """Whether ``shape`` is one example of ``spec`` without its batch axis (its fixed sizes fit)."""
    if len(shape) != spec.rank - 1:
        return False
    return all(
        not _is_fixed(want) or want == got for want, got in zip(spec.shape[1:], shape, strict=True)
    )


def _is_image(spec: TensorSpec) -> bool:
    """A [batch, C, H, W] input with fixed C (1 or 3), H and W."""
    return spec.rank == 4 and all(_is_fixed(d) for d in spec.shape[1:]) and spec.shape[1] in (1, 3)


def _resize_advice(spec: TensorSpec, height: int, width: int) -> str:
    want_h, want_w = spec.shape[2], spec.shape[3]
    if (height, width) == (want_h, want_w):
        return ""
    return (
        f"; the images are {height}x{width} and the model takes {want_h}x{want_w}: resize them "
        "(or give the image files: hydra-run and hydra-eval prepare them with the export's "
        "recorded preprocessing)"
    )


def _rank_hint(spec: TensorSpec, shape: tuple[int, ...]) -> str:
    """What is wrong with an input of the wrong rank, in words."""
    if is_one_example(spec, shape):
        return " (add the batch axis: x[None])"
    if not _is_image(spec):
        return ""
    channels, height, width = spec.shape[1:]
    expects = f": the model expects [N, C, H, W] = [N, {channels}, {height}, {width}]"
    if len(shape) == 3:
        return (
            f"{expects}; this looks like [N, H, W] images without the channel axis: add it "
            f"(x[:, None]{', then repeat it to 3 channels' if channels == 3 else ''})"
            f"{_resize_advice(spec, shape[1], shape[2])}"
        )
    if len(shape) == 2:
        return f"{expects}; this looks like a single [H, W] image: add the batch and channel axes (x[None, None])"
    return expects


def _image_hint(spec: TensorSpec, shape: tuple[int, ...]) -> str:
    """Channels-last or mis-sized images, said in words (empty for other inputs)."""
    if not _is_image(spec) or len(shape) != 4:
        return ""
    channels, height, width = spec.shape[1:]
    expects = f": the model expects [N, C, H, W] = [N, {channels}, {height}, {width}]"
    if shape[3] == channels and shape[1] != channels:
        return f"{expects}; this looks channels-last [N, H, W, C]: transpose it, x.transpose(0, 3, 1, 2)"
    if shape[1] != channels:
        return f"{expects}; the images have {shape[1]} channel(s), the model takes {channels}"
    return expects + _resize_advice(spec, shape[2], shape[3])


def _cast(spec: TensorSpec, array: np.ndarray) -> np.ndarray:
    want = spec.dtype
    if want == "bfloat16":
        raise RunnerError(
            f"input {spec.name!r} is bfloat16, which numpy cannot hold; export the model with "
            "float32 inputs (hydra-export keeps them float32 for every precision)"
        )
    try:
        target = np.dtype(want)
    except TypeError:
        raise RunnerError(
            f"input {spec.name!r} is {want}, which numpy cannot hold; export the model with "
            "float32 inputs (hydra-export keeps them float32 for every precision)"
        ) from None
    if array.dtype == target:
        return array
    if target.kind == "f" and array.dtype.kind == "f":
        with np.errstate(over="ignore"):
            return array.astype(target)
    if target.kind in "iu" and array.dtype.kind in "iu":
        info = np.iinfo(target)
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise RunnerError(
                f"input {spec.name!r} ({want}) got {array.dtype} values outside {want}'s range"
            )
        return array.astype(target)
    if target.kind == array.dtype.kind:  # bool
        return array.astype(target)
    hint = ""
    if target.kind == "f" and array.dtype == np.uint8:
        hint = " (raw pixels? preprocess images first, as hydra-run does)"
    elif target.kind in "iu" and array.dtype.kind == "f":
        hint = " (token ids must be integers)"
    raise RunnerError(f"input {spec.name!r} must be {want}, got {array.dtype}{hint}")


# --- ONNX Runtime ----------------------------------------------------------------------------------
def _import_ort():
    return require(
        "onnxruntime",
        purpose="running .onnx files",
        error=RunnerError,
        extra_hint="or run a TensorRT engine file instead",
    )


def ort_tensorrt_cache_dir() -> Path:
    """Where ONNX Runtime's TensorRT provider keeps its engines and timing cache:
    ``$HYDRA_ORT_TRT_CACHE``, else ``$XDG_CACHE_HOME/hydra-deploy/ort-tensorrt`` (~/.cache)."""
    if os.environ.get("HYDRA_ORT_TRT_CACHE"):
        return Path(os.environ["HYDRA_ORT_TRT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hydra-deploy" / "ort-tensorrt"


def _tensorrt_provider(options: dict[str, Any] | None, cache_dir: Path | None) -> tuple[str, dict]:
    """The TensorRT provider with its engine and timing caches on (options given win)."""
    folder = str(cache_dir if cache_dir is not None else ort_tensorrt_cache_dir())
    defaults = {
        "trt_engine_cache_enable": True,
        "trt_engine_cache_path": folder,
        "trt_timing_cache_enable": True,
        "trt_timing_cache_path": folder,
    }
    return "TensorrtExecutionProvider", {**defaults, **(options or {})}


def resolve_providers(
    providers: Sequence[Any] | str | None,
    available: Sequence[str],
    *,
    cache_dir: str | os.PathLike | None = None,
) -> list[Any]:
    """ONNX Runtime providers to ask for: defaults, short names, and a check they exist here.

    The TensorRT provider gets its engine and timing caches (in ``cache_dir``, default
    :func:`ort_tensorrt_cache_dir`), and when neither CUDA nor CPU is named, CUDA then CPU are
    added after it (those this build has), so that nodes TensorRT does not take still run.
    """
    if providers is None:
        return [p for p in DEFAULT_PROVIDERS if p in available]
    if isinstance(providers, str):
        providers = [providers]
    resolved: list[Any] = []
    for entry in providers:
        name, options = (entry[0], entry[1]) if isinstance(entry, (tuple, list)) else (entry, None)
        full = PROVIDER_ALIASES.get(str(name).lower(), str(name))
        if full not in available:
            raise RunnerError(
                f"ONNX Runtime provider {name!r} is not available in this onnxruntime build; "
                f"available: {', '.join(available)} (CUDA needs onnxruntime-gpu, TensorRT needs "
                "onnxruntime-gpu and TensorRT libraries)"
            )
        if full == "TensorrtExecutionProvider":
            resolved.append(_tensorrt_provider(options, Path(cache_dir) if cache_dir else None))
        else:
            resolved.append((full, dict(options)) if options is not None else full)
    if not resolved:
        raise RunnerError(f"no providers given; available: {', '.join(available)}")
    names = [p if isinstance(p, str) else p[0] for p in resolved]
    if "TensorrtExecutionProvider" in names and not set(DEFAULT_PROVIDERS) & set(names):
        resolved += [p for p in DEFAULT_PROVIDERS if p in available]
    return resolved


class OrtRunner(Runner):
    """A model run by an ONNX Runtime ``InferenceSession``."""

    backend = "onnxruntime"

    def __init__(
        self,
        onnx_path: Path,
        providers: Sequence[Any] | str | None = None,
        *,
        info: dict[str, Any] | None = None,
        threads: int | None = None,
    ) -> None:
        ort = _import_ort()
        asked = resolve_providers(providers, ort.get_available_providers())
        options = ort.SessionOptions()
        options.log_severity_level = 3  # errors only; warnings about fallbacks are ours to say
        if threads:
            options.intra_op_num_threads = int(threads)
        try:
            self.session = ort.InferenceSession(str(onnx_path), options, providers=asked)
        except Exception as err:
            raise RunnerError(_session_error(onnx_path, err, info)) from err
        inputs = [
            TensorSpec(a.name, tuple(a.shape), _ORT_TYPES.get(a.type, a.type))
            for a in self.session.get_inputs()
        ]
        outputs = [
            TensorSpec(a.name, tuple(a.shape), _ORT_TYPES.get(a.type, a.type))
            for a in self.session.get_outputs()
        ]
        min_batch, max_batch = 1, None
        first = inputs[0].shape[0] if inputs and inputs[0].shape else None
        if _is_fixed(first) and first > 0:  # a fixed-batch file: run exactly that batch
            min_batch = max_batch = int(first)
        elif info and info.get("batch_profile") is not None:
            where = f"the {INFO_FILE} beside {onnx_path}"
            max_batch = parse_batch_profile(info["batch_profile"], where)[2]
        super().__init__(
            onnx_path,
            inputs,
            outputs,
            providers=self.session.get_providers(),
            min_batch=min_batch,
            max_batch=max_batch,
            info=info,
        )
        wanted = [p if isinstance(p, str) else p[0] for p in asked]
        if wanted[0] not in self.providers:
            logger.warning("ONNX Runtime fell back from %s to %s", wanted[0], self.providers[0])

    def _embedded_metadata(self) -> dict[str, str]:
        return dict(self.session.get_modelmeta().custom_metadata_map)

    def _run(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            values = self.session.run(None, feed)
        except Exception as err:
            raise RunnerError(f"ONNX Runtime failed to run {self.path}: {err}") from err
        return dict(zip(self.output_names, values, strict=True))

    def close(self) -> None:
        self.session = None


def _session_error(path: Path, err: Exception, info: dict[str, Any] | None) -> str:
    text = str(err)
    precision = (info or {}).get("precision")
    if "NOT_IMPLEMENTED" in text or "NotImplemented" in type(err).__name__:
        if precision == "bf16" or "bfloat16" in text.lower():
            return (
                f"ONNX Runtime cannot run {path}: its CPU kernels do not implement BF16 MatMul/"
                f"Softmax ({text.strip()}); build a TensorRT engine from it (hydra-build) or run "
                "the fp32/fp16 export"
            )
        return (
            f"ONNX Runtime has no kernel for an operator of {path} with these providers "
            f"({text.strip()}); try another provider, or another precision (ONNX Runtime's CPU "
            "kernels do not run BF16 MatMul)"
        )
    lowered = text.lower()
    if any(sign in lowered for sign in ("error number 13", "errno 13", "permission denied")):
        fix = "check the file's permissions"
    else:
        fix = "is the file complete and an ONNX model? re-export it with hydra-export"
    return f"ONNX Runtime cannot load {path}: {text.strip()}; {fix}"


# --- TensorRT ------------------------------------------------------------------------------------
def _import_tensorrt():
    return require(
        "tensorrt",
        purpose="running TensorRT engines (on an NVIDIA GPU)",
        error=RunnerError,
        extra_hint="or run the .onnx file with ONNX Runtime instead: load_runner('EXPORT_DIR') / "
        "hydra-run EXPORT_DIR",
    )


def _trt_runner_class():
    poly_trt = require(
        "polygraphy.backend.trt", purpose="running TensorRT engines", error=RunnerError
    )
    return poly_trt.TrtRunner


# TensorRT DataType members numpy has no type for (tensorrt.nptype raises TypeError on them)
_TRT_ONLY_TYPES = {"BF16": "bfloat16", "FP8": "float8", "INT4": "int4", "FP4": "float4"}


def _trt_dtype(trt: Any, dtype: Any) -> str:
    """A TensorRT DataType as a numpy dtype name; ``bfloat16`` for BF16 (which numpy lacks), so
    that the input check says so instead of numpy failing on ``bf16``."""
    try:
        return np.dtype(trt.nptype(dtype)).name
    except (TypeError, ValueError):
        name = str(getattr(dtype, "name", None) or str(dtype).rsplit(".", 1)[-1]).upper()
        return _TRT_ONLY_TYPES.get(name, name.lower())


def engine_target_mismatch(
    sidecar: Mapping[str, Any] | None, tensorrt_version: str | None, compute_capability: str | None
) -> str | None:
    """Why an engine cannot run here, from its JSON sidecar, before TensorRT is asked; None when
    the sidecar matches (or says nothing). Engines are built without version or hardware
    compatibility, so they need the TensorRT release (major.minor.patch) and the GPU compute
    capability they were built with. A value unknown here (None) is not compared."""
    if not isinstance(sidecar, Mapping):
        return None
    problems = []
    built = sidecar.get("tensorrt_version")
    if (
        isinstance(built, str)
        and tensorrt_version is not None
        and built.split(".")[:3] != str(tensorrt_version).split(".")[:3]
    ):
        problems.append(f"TensorRT {built} (this machine has {tensorrt_version})")
    gpu = sidecar.get("gpu")
    built_cc = gpu.get("compute_capability") if isinstance(gpu, Mapping) else None
    if (
        isinstance(built_cc, str)
        and compute_capability is not None
        and built_cc != compute_capability
    ):
        name = gpu.get("name") or "a GPU"
        problems.append(
            f"{name} of compute capability {built_cc} (this GPU has {compute_capability})"
        )
    if not problems:
        return None
    return (
        f"it was built for {' and '.join(problems)}: engines only run on the TensorRT version and "
        "GPU they were built with; rebuild it here with hydra-build EXPORT_DIR"
    )


def _compute_capability_here() -> str | None:
    from hydra_deploy.engines.tensorrt import detect_gpu
    from hydra_deploy.errors import EngineError

    try:
        return detect_gpu().compute_capability
    except EngineError:
        return None


class TensorRTRunner(Runner):
    """A TensorRT engine run through Polygraphy's ``TrtRunner`` (see the module docstring)."""

    backend = "tensorrt"

    def __init__(
        self,
        engine_path: Path,
        *,
        info: dict[str, Any] | None = None,
        engine_info: dict[str, Any] | None = None,
        profile: int = 0,
    ) -> None:
        trt = _import_tensorrt()
        runner_class = _trt_runner_class()
        mismatch = engine_target_mismatch(
            engine_info, getattr(trt, "__version__", None), _compute_capability_here()
        )
        if mismatch:
            raise RunnerError(f"cannot run the engine {engine_path}: {mismatch}")
        self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        try:
            engine = self._runtime.deserialize_cuda_engine(Path(engine_path).read_bytes())
        except Exception as err:  # older bindings raise, newer return None
            engine, cause = None, err
        else:
            cause = None
        if engine is None:
            raise RunnerError(
                f"TensorRT cannot load the engine {engine_path}"
                + (f" ({cause})" if cause else "")
                + ": engines only run on the TensorRT version and GPU they were built with; "
                "rebuild it here with hydra-build EXPORT_DIR"
            )
        self.engine = engine
        inputs, outputs = [], []
        for index in range(engine.num_io_tensors):
            name = engine.get_tensor_name(index)
            shape = tuple(int(d) if d >= 0 else None for d in engine.get_tensor_shape(name))
            spec = TensorSpec(name, shape, _trt_dtype(trt, engine.get_tensor_dtype(name)))
            is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
            (inputs if is_input else outputs).append(spec)
        if not inputs:
            raise RunnerError(f"the engine {engine_path} has no inputs")
        first = inputs[0]
        if first.shape and first.shape[0] is None:  # dynamic batch: the profile bounds it
            low, _, high = engine.get_tensor_profile_shape(first.name, profile)
            min_batch, max_batch = int(low[0]), int(high[0])
        else:
            min_batch = max_batch = int(first.shape[0])
        super().__init__(
            engine_path,
            inputs,
            outputs,
            providers=("TensorRT",),
            min_batch=min_batch,
            max_batch=max_batch,
            info=info,
            engine_info=engine_info,
        )
        self._trt_runner = runner_class(engine, optimization_profile=profile)
        try:
            self._trt_runner.activate()
        except Exception as err:
            raise RunnerError(
                f"TensorRT cannot create an execution context for {engine_path}: {err}"
            ) from err

    def _run(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            values = self._trt_runner.infer(feed, check_inputs=False)
        except Exception as err:
            raise RunnerError(f"TensorRT failed to run {self.path}: {err}") from err
        # TrtRunner reuses its host buffers between calls: copy
        return {name: np.array(values[name], copy=True) for name in self.output_names}

    def close(self) -> None:
        runner = getattr(self, "_trt_runner", None)
        if runner is not None and runner.is_active:
            runner.deactivate()


# --- loading -------------------------------------------------------------------------------------
def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise RunnerError(f"cannot read {path}: {err}; restore it or re-export the model") from err
    except RecursionError:
        raise RunnerError(
            f"cannot read {path}: its JSON is nested too deeply; restore it or re-export the model"
        ) from None
    return data if isinstance(data, dict) else None


def _attach(runner: Runner, export: ExportInfo | None, decisions: bool = True) -> Runner:
    """``runner`` with the export folder it was loaded from (its checked hydra.json) and, when
    ``decisions``, the decisions it holds, refused when fitted on another model file."""
    runner.export_info = export
    runner.export_dir = None if export is None else export.folder
    record = None if export is None or not decisions else export.decisions
    if record is not None:
        if runner.backend == "tensorrt":
            built_from = (runner.engine_info or {}).get("onnx_sha256")
            if built_from is None:
                logger.warning(
                    "%s: cannot tell which model.onnx this engine was built from (no onnx_sha256 "
                    "in its JSON sidecar), so the decisions in %s are not applied; build the "
                    "engine with hydra-build to keep them",
                    runner.path,
                    export.path,
                )
                record = None
        else:
            built_from = file_sha256(runner.path)
        if record is not None:
            try:
                record.check_fitted_on(built_from, str(export.folder))
            except RunnerError:
                runner.close()
                raise
    runner.decisions = record
    return runner


def _info_beside_onnx(onnx_path: Path) -> ExportInfo | None:
    """hydra.json beside a .onnx file, if it describes that file (its hash is checked)."""
    info = read_info(onnx_path.parent / INFO_FILE, required=False)
    if info is None or info.onnx_sha256 is None:
        return info
    if file_sha256(onnx_path) != info.onnx_sha256:
        logger.warning(
            "%s describes another ONNX file than %s (hash differs); running without it",
            info.path,
            onnx_path.name,
        )
        return None
    return info


def _info_for_engine(engine_path: Path, sidecar: dict[str, Any] | None) -> ExportInfo | None:
    """The export's hydra.json for an engine: beside it, or where its sidecar says."""
    candidates = [engine_path.parent / INFO_FILE]
    for key in ("export_dir", "onnx", "onnx_path", "source"):
        value = (sidecar or {}).get(key)
        if isinstance(value, str) and value:
            where = Path(value)
            if not where.is_absolute():
                where = engine_path.parent / where
            candidates.append((where if where.suffix != ".onnx" else where.parent) / INFO_FILE)
    for candidate in candidates:
        info = read_info(candidate, required=False)
        if info is not None:
            return info
    return None


def load_runner(
    path: str | os.PathLike,
    backend: str | None = None,
    providers: Sequence[Any] | str | None = None,
    *,
    threads: int | None = None,
    decisions: bool = True,
) -> Runner:
    """A :class:`Runner` for an export folder, a ``.onnx`` file or a TensorRT engine file.

    ``backend``: ``"onnxruntime"`` (``"ort"``) or ``"tensorrt"`` (``"trt"``); by default a folder
    or ``.onnx`` runs in ONNX Runtime and an ``.engine``/``.plan``/``.trt`` file in TensorRT (a
    folder with ``backend="tensorrt"`` runs the one engine file inside it). ``providers``: ONNX
    Runtime execution providers (names, short names or ``(name, options)`` pairs; default CUDA
    then CPU, whichever this build has). ``threads``: ONNX Runtime's intra-op threads. The
    export's ``hydra.json`` (and an engine's ``<stem>.json`` sidecar) become ``runner.info`` /
    ``runner.engine_info``. The decisions an export holds (``hydra-calibrate``) become
    ``runner.decisions``, refused when they were fitted on another model file (``decisions=False``
    leaves them out: raw scores only).
    """
    target = Path(path)
    if backend is not None and str(backend).lower() not in BACKENDS:
        raise RunnerError(f"unknown backend {backend!r}; use 'onnxruntime' or 'tensorrt'")
    chosen = BACKENDS.get(str(backend).lower()) if backend is not None else None
    if not target.exists():
        raise RunnerError(
            f"{str(target)!r} does not exist; give an export folder (hydra-export --out), a .onnx "
            "file or a TensorRT engine file (.engine/.plan)"
        )
    if target.is_dir():
        if chosen == "tensorrt":
            engines = sorted(p for p in target.iterdir() if p.suffix in ENGINE_SUFFIXES)
            if len(engines) != 1:
                raise RunnerError(
                    f"backend 'tensorrt' needs one engine file in {str(target)!r}, found "
                    f"{[p.name for p in engines] or 'none'}; pass the engine file itself, or "
                    "build one with hydra-build"
                )
            target = engines[0]
        else:
            onnx_path = target / MODEL_FILE
            if not onnx_path.is_file():
                raise RunnerError(
                    f"{str(target)!r} is not an export folder: model.onnx is missing (make one "
                    "with hydra-export --out DIR)"
                )
            export = read_info(target / INFO_FILE, required=False)
            info = None if export is None else dict(export.record)
            runner = OrtRunner(onnx_path, providers, info=info, threads=threads)
            return _attach(runner, export, decisions)
    suffix = target.suffix.lower()
    if suffix == ".onnx":
        if chosen == "tensorrt":
            raise RunnerError(
                f"{target} is an ONNX file: build a TensorRT engine from it first (hydra-build), "
                "or run it in ONNX Runtime with providers=['tensorrt']"
            )
        export = _info_beside_onnx(target)
        info = None if export is None else dict(export.record)
        runner = OrtRunner(target, providers, info=info, threads=threads)
        return _attach(runner, export, decisions)
    if suffix in ENGINE_SUFFIXES:
        if chosen == "onnxruntime":
            raise RunnerError(
                f"{target} is a TensorRT engine; ONNX Runtime runs the .onnx file it was built from"
            )
        if providers is not None:
            raise RunnerError("providers are ONNX Runtime's; a TensorRT engine takes none")
        sidecar = _read_json(target.with_suffix(".json"))
        export = _info_for_engine(target, sidecar)
        info = None if export is None else dict(export.record)
        runner = TensorRTRunner(target, info=info, engine_info=sidecar)
        return _attach(runner, export, decisions)
    raise RunnerError(
        f"cannot tell how to run {str(target)!r}: expected an export folder, a .onnx file or an "
        f"engine file ({', '.join(ENGINE_SUFFIXES)})"
    )
