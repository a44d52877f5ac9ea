"""The runner interface: :class:`Runner` (what every consumer may ask of a runner) and
:class:`BaseRunner` (the template the ONNX Runtime and TensorRT runners fill in).

A backend fills in three things, as Polygraphy's runners do (``activate_impl`` / ``infer_impl``
/ ``deactivate_impl``): its constructor opens the model and hands :class:`BaseRunner` the input
and output :class:`TensorSpec` tuples and the batch range; ``_run`` runs one checked feed; and
``close`` frees what the constructor opened. Everything else is here:

Before every call the inputs are checked against the model (names, rank, fixed dimensions, dtype,
finite values) and a :class:`~hydra_deploy.errors.RunnerError` names the input, what was expected
and what came. Casts are made only within a kind: float16/float64 arrays go to a float32 input
(float64 is numpy's default, so ``np.random.rand`` arrays work), any integer array goes to an
int64/int32 input (text models' token ids) when its values fit; an integer array for a float input
(raw uint8 pixels, most likely) or a float array for an integer input is refused. Batches above
the model's maximum are split and the outputs concatenated; batches below an engine's minimum are
padded by repeating the last example, and the padding is dropped from the outputs.

The backends: :mod:`hydra_deploy.engines.onnxruntime_runner`,
:mod:`hydra_deploy.engines.tensorrt_runner`, and, outside the edge runtime because it needs torch,
:mod:`hydra_deploy.evaluation.torch_runner`. :func:`hydra_deploy.engines.runner.load_runner`
picks one for a path.

Edge runtime: numpy only. Never torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from hydra_deploy.engines.text import TextEncoder
from hydra_deploy.errors import RunnerError, counted, spelled
from hydra_deploy.export_folder import INFO_FILE, DecisionRecord, EngineInfo, ExportInfo

__all__ = ["BaseRunner", "Runner", "TensorSpec", "is_one_example"]


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


@runtime_checkable
class Runner(Protocol):
    """What scoring, evaluation, serving and Ray ask of a runner: ``runner(inputs)`` -> a dict of
    named numpy arrays holding ``member_logits`` [batch, M, C], what the model takes and gives,
    what it is (from its export's records) and ``close()`` (also as a context manager).

    :class:`BaseRunner` fills it in for model files (ONNX Runtime, TensorRT);
    :class:`~hydra_deploy.evaluation.torch_runner.TorchRunner` for a fused PyTorch model.
    """

    backend: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch: int | None
    decisions: DecisionRecord | None

    @property
    def input_names(self) -> tuple[str, ...]: ...

    @property
    def output_names(self) -> tuple[str, ...]: ...

    @property
    def family(self) -> str | None: ...

    @property
    def class_names(self) -> list[str] | None: ...

    @property
    def preprocessing(self) -> dict[str, Any] | None: ...

    @property
    def precision(self) -> str | None: ...

    def __call__(
        self,
        inputs: np.ndarray | Mapping[str, np.ndarray],
        *,
        batch_size: int | None = None,
        allow_nonfinite: bool = False,
    ) -> dict[str, np.ndarray]: ...

    def text_encoder(self) -> TextEncoder: ...

    def close(self) -> None: ...

    def __enter__(self) -> Runner: ...

    def __exit__(self, *exc: object) -> None: ...


class BaseRunner(Runner):
    """The template every runner fills in: a backend gives its path, its input and output
    :class:`TensorSpec` tuples and its batch range to ``__init__`` and implements ``_run`` (one
    checked feed that fits the batch range -> the outputs by name) and ``close``; checking the
    inputs, splitting and padding batches and reading the metadata are done here.

    Attributes: ``backend`` (its row's name in the backend registry: "onnxruntime", "tensorrt"
    or one registered), ``path`` (the file run), ``inputs`` and
    ``outputs`` (``input_names``, ``output_names``), ``providers`` (ONNX Runtime's providers in
    use; ``("TensorRT",)`` for engines), ``min_batch`` / ``max_batch`` (the batch range a call is
    split and padded to; ``max_batch`` None: no limit), ``export_info`` (the export's checked
    ``hydra.json``, when one is beside the file, else None; ``info`` is its record) and
    ``engine_info`` (an engine's checked JSON sidecar). ``spec``, ``class_names``,
    ``preprocessing`` and ``precision`` read from those. Close it (or use it in a ``with`` block)
    to free an engine's GPU memory.
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
        export: ExportInfo | None = None,
        engine_info: EngineInfo | None = None,
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
        #: the export's checked hydra.json and the folder holding it (and, for text models,
        #: ``tokenizer/``), if known
        self.export_info = export
        self.export_dir: Path | None = None if export is None else export.folder
        self.engine_info = engine_info
        #: the decisions (hydra-calibrate) of the export, checked against the model file, if any
        self.decisions: DecisionRecord | None = None
        self.check_metadata(self._embedded_metadata())

    @property
    def info(self) -> Mapping[str, Any] | None:
        """The export's ``hydra.json`` record as written (:attr:`export_info` checked it)."""
        return None if self.export_info is None else self.export_info.record

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
        sources: list[tuple[str, Any, Any]] = []
        if self.export_info is not None:
            names = self.export_info.class_names
            sources.append(
                (INFO_FILE, self.export_info.spec, None if names is None else list(names))
            )
        if self.engine_info is not None:
            sources.append(
                ("the engine's JSON sidecar", self.engine_info.spec, self.engine_info.class_names)
            )
        if embedded and embedded.get("hydra_spec"):
            try:
                sources.append(
                    ("the file's hydra_spec metadata", json.loads(embedded["hydra_spec"]), None)
                )
            except ValueError as err:
                raise RunnerError(
                    f"{self.path}: its hydra_spec metadata is not JSON ({err}); re-export the model "
                    "with hydra-export"
                ) from err
        for source, spec, names in sources:
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
                        f"stale {INFO_FILE})"
                    )

    # --- what the model is -------------------------------------------------------------------
    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.outputs)

    def _meta(self, key: str) -> Any:
        """``key`` (an attribute of both records) from hydra.json, else the engine's sidecar."""
        for source in (self.export_info, self.engine_info):
            value = None if source is None else getattr(source, key)
            if value is not None:
                return value
        return None

    @property
    def spec(self) -> dict[str, Any] | None:
        """The HydraSpec as a dict (from hydra.json or the engine sidecar), or None."""
        return self._meta("spec")

    @property
    def class_names(self) -> list[str] | None:
        names = self._meta("class_names")
        return None if names is None else list(names)

    @property
    def preprocessing(self) -> dict[str, Any] | None:
        """timm's data config of the export (input size, interpolation, mean, std, crop)."""
        return self._meta("preprocessing")

    @property
    def precision(self) -> str | None:
        """The engine's build precision (sidecar) or the ONNX file's (hydra.json), if known."""
        if self.engine_info is not None and self.engine_info.precision:
            return self.engine_info.precision
        return None if self.export_info is None else self.export_info.precision

    @property
    def family(self) -> str | None:
        return self._meta("family")

    def text_encoder(self) -> TextEncoder:
        """The export's tokenizer as a :class:`~hydra_deploy.engines.text.TextEncoder` (text models)."""
        if self.export_info is None:
            raise RunnerError(
                f"{self.path} comes without its export folder ({INFO_FILE} and tokenizer/), so "
                "text cannot be tokenized for it: run the export folder, or pass token ids in a "
                ".npz"
            )
        return TextEncoder.from_export(self.export_info)

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

    @property
    def batch_source(self) -> str:
        """Where ``max_batch`` comes from, for messages (``hydra.json batch_profile``)."""
        return self._batch_source()

    def _batch_source(self) -> str:
        return f"{INFO_FILE} batch_profile"

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

    def __enter__(self) -> BaseRunner:
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
    check_shape(spec, array.shape)
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
            f"input {name!r} holds NaN or infinite values in {bad} of "
            f"{counted(len(array), 'example')}; fix the data, or "
            + spelled(
                "pass allow_nonfinite=True to run it anyway",
                "run it anyway with hydra-run --allow-nonfinite",
            )
        )
    return np.ascontiguousarray(array)


def check_shape(spec: TensorSpec, shape: tuple[int, ...], where: str = "") -> None:
    """Refuse an input whose shape ``spec`` cannot take, saying how to fix it; ``where``
    (``"ID data (x.npz, 797 examples): "``) names a whole file checked before it is batched."""
    name = spec.name
    if len(shape) != spec.rank:
        raise RunnerError(
            f"{where}input {name!r} must have {counted(spec.rank, 'dimension')} "
            f"{list(spec.shape)}, got "
            f"shape {shape}{_rank_hint(spec, shape)}"
        )
    if shape[0] == 0:
        raise RunnerError(
            f"{where}input {name!r} is an empty batch (shape {shape}); give 1 or more examples"
        )
    differ = [
        f"{want} on axis {axis}"
        for axis, (want, got) in enumerate(zip(spec.shape, shape, strict=True))
        if axis > 0 and _is_fixed(want) and want != got
    ]
    if differ:
        raise RunnerError(
            f"{where}input {name!r} must have size {_listed(differ)} (shape {list(spec.shape)}), "
            f"got shape {shape}{_image_hint(spec, shape)}"
        )


def _listed(items: Sequence[str]) -> str:
    """The items joined as a sentence says them: a; a and b; a, b and c."""
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else items[0]


def is_one_example(spec: TensorSpec, shape: tuple[int, ...]) -> bool:
    """Whether ``shape`` is one example of ``spec`` without its batch axis (its fixed sizes fit)."""
    if len(shape) != spec.rank - 1:
        return False
    return all(
        not _is_fixed(want) or want == got for want, got in zip(spec.shape[1:], shape, strict=True)
    )


#: the channel counts of images (grey, RGB, RGBA)
_CHANNELS = (1, 3, 4)


def _is_image(spec: TensorSpec) -> bool:
    """A [batch, C, H, W] input with fixed C (1 or 3), H and W."""
    return spec.rank == 4 and all(_is_fixed(d) for d in spec.shape[1:]) and spec.shape[1] in (1, 3)


#: how an image array that does not fit can be made from the files instead
_FROM_FILES = (
    "or prepare the image files with the export's recorded preprocessing: "
    "hydra_deploy.engines.preprocess.preprocess_images(files, runner.preprocessing)",
    "or give the image files: hydra-run and hydra-eval prepare them with the export's recorded "
    "preprocessing",
)


def _channel_fix(got: int, want: int) -> str:
    """How to turn ``got`` channels into ``want`` (a numpy line where one does it)."""
    if got == 1 and want == 3:
        return "repeat the one channel, np.repeat(x, 3, axis=1)"
    if want == 1:
        return "average them to one, x.mean(axis=1, keepdims=True)"
    if got == 4 and want == 3:
        return "drop the alpha channel, x[:, :3]"
    return f"give images with {want} channels"


def image_axes_advice(want: Sequence[int], got: Sequence[int]) -> str:
    """One piece of advice per image axis that differs, [C, H, W] of the model (``want``) and of
    the data (``got``): the channels, then height and width together (a resize names both);
    empty where they fit. Every axis that differs is named, none that matches."""
    (want_c, want_h, want_w), (got_c, got_h, got_w) = want, got
    parts = []
    if got_c != want_c:
        parts.append(f"channels {got_c} vs {want_c}: {_channel_fix(got_c, want_c)}")
    sizes = [
        f"{axis} {g} vs {w}"
        for axis, g, w in (("height", got_h, want_h), ("width", got_w, want_w))
        if g != w
    ]
    if sizes:
        parts.append(f"{' and '.join(sizes)}: resize (or crop) them to {want_h} x {want_w}")
    if not parts:
        return ""
    return "; ".join(parts) + f" ({spelled(*_FROM_FILES)})"


def _rank_hint(spec: TensorSpec, shape: tuple[int, ...]) -> str:
    """What is wrong with an input of the wrong rank, in words."""
    if is_one_example(spec, shape):
        return " (add the batch axis: x[None])"
    if not _is_image(spec):
        return ""
    channels, height, width = spec.shape[1:]
    expects = f": the model expects [N, C, H, W] = [N, {channels}, {height}, {width}]"
    if len(shape) == 3:
        return expects + _three_axes_hint(spec, shape)
    if len(shape) == 2:
        return f"{expects}; this looks like a single [H, W] image: add the batch and channel axes (x[None, None])"
    return expects


def _three_axes_hint(spec: TensorSpec, shape: tuple[int, ...]) -> str:
    """A 3-axis array for a [N, C, H, W] model: one [C, H, W] image (3 or 4 channels first), one
    channels-last [H, W, C] image, else [N, H, W] images without the channel axis; the fix of
    that reading, then every image axis that still differs."""
    if shape[0] in (3, 4):
        reading, got = "one [C, H, W] image: add the batch axis (x[None])", shape
    elif shape[2] in (3, 4):
        reading = "one channels-last [H, W, C] image: x.transpose(2, 0, 1)[None]"
        got = (shape[2], shape[0], shape[1])
    else:
        reading = "[N, H, W] images without the channel axis: add it (x[:, None])"
        got = (1, shape[1], shape[2])
    advice = image_axes_advice(spec.shape[1:], got)
    return f"; this looks like {reading}" + (f"; then {advice}" if advice else "")


def _image_hint(spec: TensorSpec, shape: tuple[int, ...]) -> str:
    """Channels-last or mis-sized images, said in words, every axis that differs named with its
    fix (empty for other inputs)."""
    if not _is_image(spec) or len(shape) != 4:
        return ""
    channels, height, width = spec.shape[1:]
    hint = f": the model expects [N, C, H, W] = [N, {channels}, {height}, {width}]"
    got = shape[1:]
    if shape[1] != channels and shape[1] not in _CHANNELS and shape[3] in _CHANNELS:
        hint += "; this looks channels-last [N, H, W, C]: transpose it, x.transpose(0, 3, 1, 2)"
        got = (shape[3], shape[1], shape[2])
    advice = image_axes_advice(spec.shape[1:], got)
    if advice:
        hint += ("; then " if got != shape[1:] else "; ") + advice
    return hint


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
