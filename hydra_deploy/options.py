"""The build options as typed groups: one frozen dataclass per concern, one field per option.

Each field's metadata holds its command-line flag, help, type (and choices, metavar), so one
declaration serves the library, the commands and the recorded settings::

    from hydra_deploy.options import FinetuneOptions, SelectionOptions
    from hydra_deploy.pipeline import build_hydra

    built = build_hydra("vit_b16", select=SelectionOptions(members=3, heads_per_member=4,
                        calib="train/"), finetune=FinetuneOptions(data="train/", epochs=1))

- :class:`LoadOptions` -> ``load_backbone`` (checkpoint, classes, constructor arguments),
  :class:`PreprocessingOptions` are its image preprocessing flags;
- :class:`SelectionOptions` -> ``choose_spec`` / ``select_members`` (which heads each member keeps);
- :class:`FinetuneOptions` -> ``finetune_members`` (its recorded, compared settings: the field
  names are the keys of ``member_{m}.json``'s ``settings``);
- :class:`FuseOptions` -> ``fuse``.

Beside the build's groups, :class:`Int8Options` is ``hydra-export --precision int8``'s (the
``int8=`` of ``export_onnx``); the runtime commands share :class:`RunnerOptions` (providers,
engine, batch size, threads, decisions), hydra-calibrate fits with :class:`CalibrationOptions`
(``calibrate``'s ``options``), hydra-serve and ``--triton`` batch with :class:`BatchingOptions`.
A group outside this module (``ServeConfig``, ``BenchConfig``) declares its fields with
:func:`option` too, and takes a field of one of these with :func:`shared`.

The commands build their flags with :func:`add_options` and read them back with
:func:`from_args` (under a ``prefix``: ``--triton-...``); :func:`command_line` writes a group's
flags back (a benchmark's repeat command); :data:`PARAMETER_FLAGS` and :func:`spelling` spell a
field as its flag in command-line messages.
Every check raises :class:`~hydra_deploy.errors.ParameterError` (its message names parameters;
the commands say their flags). Adding an option is one field in one group: ``option(default,
"--flag", "help")``; its flag, parsing, check of its type and (fine-tuning) its place in the
recorded settings follow. This module imports only the standard library and the small helpers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from hydra_deploy.decisions import DECISION_SCORES, SET_METHODS
from hydra_deploy.errors import FinetuneError, HydraError, ParameterError, ServeError
from hydra_deploy.export_folder import (
    CALIBRATION_METHODS,
    CROP_MODES,
    INT8_METHODS,
    INTERPOLATIONS,
)
from hydra_deploy.set_scores import SET_SCORES

__all__ = [
    "CALIBRATION_METHODS",
    "CROP_MODES",
    "DEFAULT_CALIBRATION_SIZE",
    "DEFAULT_LOWERING",
    "GROUPS",
    "IMPORTANCES",
    "INT8_METHODS",
    "LOWERINGS",
    "MIN_CALIBRATION_EXAMPLES",
    "PARAMETER_FLAGS",
    "SHARED_PARTS",
    "BatchingOptions",
    "CalibrationOptions",
    "FinetuneOptions",
    "FuseOptions",
    "Int8Options",
    "LoadOptions",
    "PreprocessingOptions",
    "RunnerOptions",
    "SelectionOptions",
    "ServeSettingError",
    "add_options",
    "check_batching",
    "command_line",
    "flag_of",
    "from_args",
    "option",
    "parse_model_args",
    "shared",
    "spelling",
]

# hydra_deploy.fusion.grouped's, repeated so that parsing arguments needs no torch (tested equal)
LOWERINGS = ("bmm", "loop", "dense", "conv1d", "einsum")
DEFAULT_LOWERING = "loop"
IMPORTANCES = ("random", "taylor", "circuit")
SHARED_PARTS = ("per-member", "frozen", "averaged")
"""How ``finetune_members`` treats the parts outside the attention blocks (embeddings, final norm,
pooler, classifier; ``BackboneAdapter.shared_parameter_prefixes``): ``"per-member"`` fine-tunes
them in every member (the fused model then stores M copies), ``"frozen"`` keeps the backbone's
(one copy), ``"averaged"`` fine-tunes them and then gives every member their mean (one copy)."""


class FinetuneSettingError(FinetuneError, ParameterError):
    """A fine-tuning setting is invalid (a FinetuneError that names its parameters)."""


# --------------------------------------------------------------------------------------------------
# declaring an option


def option(
    default: Any,
    flag: str | None,
    help: str | None = None,
    *,
    type: Callable[[str], Any] | None = None,
    choices: Sequence[Any] | None = None,
    metavar: str | None = None,
    nargs: str | None = None,
    aliases: Sequence[str] = (),
    action: str | None = None,
    parse: Callable[[Any], Any] | None = None,
    group: type | None = None,
    recorded: bool = True,
    keyword: str | None = None,
    section: str | None = None,
    prefixed: str | None = None,
    repeat: bool | Callable[[Any], bool] | None = None,
) -> Any:
    """A dataclass field declaring one option: ``flag`` (None: a library-only setting) with
    argparse's ``help``, ``type``, ``choices``, ``metavar``, ``nargs``, ``action`` and ``aliases``
    (other spellings of the flag). ``parse`` turns the parsed flag value into the field's value;
    ``group`` makes the field the value of another group's flags (``PreprocessingOptions``).
    ``recorded``: part of a group's :meth:`record` (the settings a saved result is compared on).
    ``keyword``: ``build_hydra``'s keyword for it where that is not the field's name.
    ``section``: the title of the help section the flag is listed in (default: the group's
    ``SECTION``). ``prefixed``: the flag's tail under a prefix (:func:`add_options`'s
    ``prefix``), where not the flag's own (``--model-name`` under ``triton-``: ``--triton-name``).
    ``repeat``: whether :func:`command_line` writes the flag: True always, a callable of the group
    when it says so and the value is not the default, None when the value is not the default."""
    metadata = {
        "flag": flag,
        "help": help,
        "type": type,
        "choices": tuple(choices) if choices is not None else None,
        "metavar": metavar,
        "nargs": nargs,
        "aliases": tuple(aliases),
        "action": action,
        "parse": parse,
        "group": group,
        "recorded": recorded,
        "keyword": keyword,
        "section": section,
        "prefixed": prefixed,
        "repeat": repeat,
    }
    return dataclasses.field(default=default, metadata=metadata)


def shared(group: type, name: str, **changes: Any) -> Any:
    """Field ``name`` of ``group`` declared again in another group (a library entry point's
    dataclass holds it flat): the same flag, type and check, ``changes`` (``default``, ``help``,
    ``section``) where they differ. One declaration serves both groups."""
    f = {f.name: f for f in dataclasses.fields(group)}[name]
    default = changes.pop("default", f.default)
    return dataclasses.field(default=default, metadata={**f.metadata, **changes})


def _seed() -> Any:  # one option shared by the groups that draw at random
    return option(0, "--seed", "seed of everything random (random weights too)", type=int)


# --------------------------------------------------------------------------------------------------
# checks (messages name parameters between backticks: ParameterError shows names, or flags)


def _is_int(value: object) -> bool:
    """An int (numpy's too), not a bool (numpy's bool is no ``numbers.Integral``)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_choice(group: Any, name: str, allowed: Sequence[Any], error=ParameterError) -> None:
    value = getattr(group, name)
    if value is not None and value not in allowed:
        raise error(f"`{name}` must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def _check_count(group: Any, name: str, minimum: int, error=ParameterError) -> None:
    value = getattr(group, name)
    if value is not None and (not _is_int(value) or value < minimum):
        raise error(f"`{name}` must be an int >= {minimum}, got {value!r}")


# --------------------------------------------------------------------------------------------------
# the groups


def _parse_checkpoint(value: Any) -> Any:
    return list(value) if value else None


@dataclasses.dataclass(frozen=True)
class PreprocessingOptions:
    """Image preprocessing (timm ViTs): ``load_backbone``'s ``preprocessing=`` entries, one flag
    each; :meth:`as_dict` is the mapping (None when nothing is given)."""

    SECTION: ClassVar[str] = (
        "image preprocessing (timm ViTs; default: the checkpoint folder's config.json "
        "pretrained_cfg, else timm's default for the architecture)"
    )

    mean: Sequence[float] | None = option(
        None,
        "--mean",
        "normalization mean, one per channel or one for all (e.g. 0.5)",
        type=float,
        nargs="+",
        metavar="M",
    )
    std: Sequence[float] | None = option(
        None,
        "--std",
        "normalization std, one per channel or one for all (e.g. 0.5)",
        type=float,
        nargs="+",
        metavar="S",
    )
    interpolation: str | None = option(
        None, "--interpolation", "resize interpolation", choices=INTERPOLATIONS
    )
    crop_pct: float | None = option(
        None,
        "--crop-pct",
        "center-crop fraction: resize to size / crop_pct, then crop (1.0: no crop)",
        type=float,
    )
    crop_mode: str | None = option(
        None,
        "--crop-mode",
        "center (resize the shorter side), squash (both sides) or border (pad)",
        choices=CROP_MODES,
    )

    def __post_init__(self) -> None:
        _check_choice(self, "interpolation", INTERPOLATIONS)
        _check_choice(self, "crop_mode", CROP_MODES)

    def as_dict(self) -> dict[str, Any] | None:
        """The ``preprocessing=`` mapping of the entries given (None when none is)."""
        given = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }
        return given or None


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """How the backbone is loaded (``load_backbone``'s options besides the name)."""

    SECTION: ClassVar[str] = "model"

    checkpoint: str | Sequence[str] | None = option(
        None,
        "--checkpoint",
        "local .safetensors/.pth file or folder; 'hub' downloads (needs network); omitted: "
        "random weights. Several checkpoints of one architecture (a deep ensemble): one member "
        "each, heads chosen per member, fused into one network with per-member MLPs",
        nargs="+",
        metavar="FILE",
        parse=_parse_checkpoint,
    )
    num_classes: int | None = option(
        None,
        "--num-classes",
        "classifier size (default: the checkpoint's, else timm's)",
        type=int,
    )
    new_classifier: bool = option(
        False,
        "--new-head",
        "BERT: replace the checkpoint's classifier by a new random one of --num-classes "
        "classes (without it, a --num-classes other than the checkpoint's is refused)",
        action="store_true",
    )
    model_args: Mapping[str, Any] | None = option(
        None,
        "--model-arg",
        "timm ViT constructor argument, repeatable (load_backbone's keyword arguments; win "
        "over a folder's config.json model_args): --model-arg embed_dim=64 --model-arg depth=4 "
        "--model-arg img_size=16 --model-arg patch_size=4 --model-arg in_chans=1; VALUE is JSON "
        "(4, 2.0, true, [16, 16]) or else a string (avg)",
        action="append",
        metavar="KEY=VALUE",
        parse=lambda pairs: parse_model_args(pairs or []),
    )
    classes: str | Sequence[str] | None = option(
        None,
        "--classes",
        "openclip: a text file of class names, one per line (the zero-shot classifier)",
    )
    templates: str | Sequence[str] | None = option(
        None,
        "--templates",
        "openclip: a text file of prompt templates with {} for the class name "
        "(default: a small built-in set)",
    )

    preprocessing: Mapping[str, Any] | None = option(
        None, None, group=PreprocessingOptions, parse=PreprocessingOptions.as_dict
    )

    def __post_init__(self) -> None:
        if not isinstance(self.new_classifier, bool):
            raise ParameterError(
                f"`new_classifier` must be True or False, got {self.new_classifier!r}"
            )
        if self.model_args is not None and not isinstance(self.model_args, Mapping):
            raise ParameterError(
                f"`model_args` must be a mapping of constructor arguments, got {self.model_args!r}"
            )

    def load_kwargs(self) -> dict[str, Any]:
        """``load_backbone``'s keyword arguments besides ``checkpoint``."""
        zero_shot = {
            k: v for k, v in (("classes", self.classes), ("templates", self.templates)) if v
        }
        extra = {"preprocessing": dict(self.preprocessing)} if self.preprocessing else {}
        new_head = {"new_classifier": True} if self.new_classifier else {}
        model_args = dict(self.model_args or {})
        return dict(num_classes=self.num_classes, **zero_shot, **model_args, **extra, **new_head)


@dataclasses.dataclass(frozen=True)
class SelectionOptions:
    """Which heads each member keeps: read from ``spec``, drawn at random, or chosen on ``calib``
    data by ``importance`` (``choose_spec`` and ``select_members``)."""

    SECTION: ClassVar[str] = "members"

    spec: object = option(
        None, "--spec", "HydraSpec JSON file (instead of choosing heads)", type=Path
    )
    members: int | None = option(
        None,
        "--members",
        "M (default 3; with several --checkpoint files, one member per checkpoint)",
        type=int,
        aliases=("-m",),
    )
    heads_per_member: int | Sequence[int] | None = option(
        None,
        "--heads-per-member",
        "heads each member keeps per layer (default: num_heads // M)",
        type=int,
        aliases=("-k",),
    )
    keep_ratio: float | None = option(
        None,
        "--keep-ratio",
        "fraction of each layer's heads a member keeps (instead of -k)",
        type=float,
    )
    importance: str | None = option(
        None,
        "--importance",
        "how heads are chosen (default: taylor with --calib, else random)",
        choices=IMPORTANCES,
    )
    calib: object = option(
        None,
        "--calib",
        "labelled data to score heads on: image folder (class "
        "per sub-folder) or .npz with x (preprocessed floats) and y (labels); text models: .tsv "
        "(label<TAB>text) or .npz with input_ids, attention_mask and y",
    )
    ood: object = option(
        None,
        "--ood",
        "OOD inputs for the circuit OOD objective: folder or .npz; text models also .txt "
        "(one text per line) or .tsv",
    )
    objective: str | None = option(
        None,
        "--objective",
        "circuit objective (default: ood with --ood, else loss)",
        choices=("loss", "ood"),
    )
    conditioning: str = option(
        "member",
        "--conditioning",
        "circuit: score each layer with the heads pruned so far masked (member, default) or "
        "with the circuit heads found so far masked (headmap: HeadMap's own search)",
        choices=("member", "headmap"),
    )
    temperature: float = option(
        0.5,
        "--temperature",
        "0: each member keeps its top heads; higher: more diverse draws",
        type=float,
    )
    max_examples: int = option(
        512, "--max-examples", "examples used to score heads (default 512)", type=int
    )
    shared_layers: int = option(
        0,
        "--shared-layers",
        "random heads: leading layers all members share (a shared trunk)",
        type=int,
    )
    disjoint: bool = option(
        False,
        "--disjoint",
        "random heads: members keep disjoint heads per layer",
        action="store_true",
    )
    seed: int = _seed()

    def __post_init__(self) -> None:
        if self.members is not None and (not _is_int(self.members) or self.members < 1):
            raise ParameterError(f"`members` must be at least 1, got {self.members}")
        ratios = self.keep_ratio if isinstance(self.keep_ratio, Sequence) else [self.keep_ratio]
        for ratio in ratios:
            if ratio is not None and not (_is_number(ratio) and 0.0 < ratio <= 1.0):
                raise ParameterError(
                    f"`keep_ratio` must be within (0, 1] (the fraction of each layer's heads a "
                    f"member keeps; 1 keeps all), got {self.keep_ratio}"
                )
        _check_choice(self, "importance", IMPORTANCES)
        _check_choice(self, "objective", ("loss", "ood"))
        _check_choice(self, "conditioning", ("member", "headmap"))
        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ParameterError(
                f"`temperature` must be a finite number >= 0, got {self.temperature!r}"
            )
        _check_count(self, "max_examples", 1)
        _check_count(self, "shared_layers", 0)
        if not _is_int(self.seed):
            raise ParameterError(f"`seed` must be an int, got {self.seed!r}")

    @property
    def method(self) -> str:
        """The importance used: ``importance``, else taylor with ``calib`` data, else random."""
        return self.importance or ("taylor" if self.calib else "random")


@dataclasses.dataclass(frozen=True)
class FinetuneOptions:
    """Fine-tuning every member (``finetune_members``): on ``data``, AdamW, linear warm-up then
    cosine decay. The recorded fields (all but ``data`` and ``save_dir``) are the ``settings``
    of ``member_{m}.json`` that a saved member is reused on; a field a record lacks counts as its
    default, so a new option with a default that keeps today's training keeps saved members."""

    SECTION: ClassVar[str] = "fine-tuning"

    data: object = option(
        None,
        "--finetune",
        "fine-tune every member on this labelled data (folder or .npz; text: .tsv or .npz)",
        metavar="DATA",
        recorded=False,
        keyword="finetune",
    )
    epochs: float | None = option(1.0, "--epochs", "fine-tuning epochs (default 1)", type=float)
    max_steps: int | None = option(
        None,
        "--finetune-steps",
        "stop each member after this many steps",
        type=int,
        keyword="finetune_steps",
    )
    lr: float = option(1e-4, "--lr", "fine-tuning learning rate", type=float)
    warmup_steps: int = option(
        0,
        "--warmup-steps",
        "linear learning-rate warm-up steps before the cosine decay (default 0)",
        type=int,
    )
    batch_size: int = option(
        32, "--finetune-batch-size", None, type=int, keyword="finetune_batch_size"
    )
    save_dir: object = option(
        None,
        "--finetune-dir",
        "save members here and resume from them on a later run",
        type=Path,
        recorded=False,
        keyword="finetune_dir",
    )
    shared_parts: str = option(
        "per-member",
        "--shared-parts",
        "embeddings, final norm, pooler and classifier: fine-tuned in every member (default; "
        "the export stores M copies), frozen, or fine-tuned then averaged (both: one copy, near "
        "one model's size)",
        choices=SHARED_PARTS,
    )
    weight_decay: float = option(
        0.05,
        "--weight-decay",
        "fine-tuning AdamW weight decay, on weight matrices only (default 0.05)",
        type=float,
    )
    label_smoothing: float = option(
        0.0,
        "--label-smoothing",
        "fine-tuning cross-entropy label smoothing in [0, 1) (default 0: none)",
        type=float,
    )
    seed: int = _seed()
    #: library only (``--shared-layers`` draws a spec's shared trunk and leaves fine-tuning alone)
    shared_layers: int = option(0, None)

    def __post_init__(self) -> None:
        error = FinetuneSettingError
        max_steps, epochs, lr = self.max_steps, self.epochs, self.lr
        if max_steps is not None and (not _is_int(max_steps) or max_steps < 1):
            raise error(f"`max_steps` must be None or an int >= 1, got {max_steps!r}")
        if epochs is not None and not _is_number(epochs):
            raise error(f"`epochs` must be a number, got {epochs!r}")
        if max_steps is None and (epochs is None or not 0 < epochs < math.inf):
            raise error(
                f"`epochs` must be a positive finite number (fractions allowed), got {epochs!r}; "
                "or pass `max_steps` to fix the number of optimizer steps"
            )
        if not _is_number(lr) or not 0 < lr < math.inf:
            raise error(f"`lr` must be a positive finite number, got {lr!r}")
        _check_count(self, "batch_size", 1, error)
        if self.batch_size is None:
            raise error("`batch_size` must be an int >= 1, got None")
        wd = self.weight_decay
        if not _is_number(wd) or not 0 <= wd < math.inf:
            raise error(f"`weight_decay` must be a finite number >= 0, got {wd!r}")
        smoothing = self.label_smoothing
        if not _is_number(smoothing) or not 0 <= smoothing < 1:
            raise error(f"`label_smoothing` must be a number in [0, 1), got {smoothing!r}")
        if not _is_int(self.warmup_steps) or self.warmup_steps < 0:
            raise error(f"`warmup_steps` must be an int >= 0, got {self.warmup_steps!r}")
        if not _is_int(self.seed):
            raise error(f"`seed` must be an int, got {self.seed!r}")
        if self.shared_parts not in SHARED_PARTS:
            raise error(
                f"`shared_parts` must be one of {', '.join(map(repr, SHARED_PARTS))}, got "
                f"{self.shared_parts!r}"
            )
        if not _is_int(self.shared_layers) or self.shared_layers < 0:
            raise error(f"`shared_layers` must be an int >= 0, got {self.shared_layers!r}")

    def record(self) -> dict[str, Any]:
        """The recorded settings as JSON values (``member_{m}.json``'s ``settings``)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.metadata["recorded"]:
                value = getattr(self, f.name)
                if _is_int(value):
                    value = int(value)
                elif _is_number(value):
                    value = float(value)
                out[f.name] = value
        if out["epochs"] is not None:
            out["epochs"] = float(out["epochs"])
        return out

    @classmethod
    def recorded_defaults(cls) -> dict[str, Any]:
        """Each recorded setting's default (what a record written before it existed meant)."""
        return {f.name: f.default for f in dataclasses.fields(cls) if f.metadata["recorded"]}

    @property
    def given(self) -> bool:
        """Whether fine-tuning is asked for (``data`` given)."""
        return bool(self.data)


@dataclasses.dataclass(frozen=True)
class FuseOptions:
    """How the members are fused (``fuse``)."""

    SECTION: ClassVar[str] = "fusion"

    mlp_merge: str | None = option(
        None,
        "--mlp-merge",
        "average: one MLP of the members' mean weights (paper); "
        "grouped: every member keeps its own MLP",
        choices=("average", "grouped"),
    )
    lowering: str = option(
        DEFAULT_LOWERING,
        "--lowering",
        "how grouped projections run and export (default loop: one MatMul per "
        "member on a 2-D weight, fastest on the CPU; bmm: one batched MatMul; "
        "einsum writes Einsum nodes)",
        choices=LOWERINGS,
        aliases=("--grouped-linear",),
    )

    def __post_init__(self) -> None:
        _check_choice(self, "mlp_merge", ("average", "grouped"))
        if self.lowering is None:
            object.__setattr__(self, "lowering", DEFAULT_LOWERING)
        _check_choice(self, "lowering", LOWERINGS)


#: static INT8 refuses fewer calibration examples than this
MIN_CALIBRATION_EXAMPLES = 32
#: at most this many calibration examples by default (a seeded random subset of more)
DEFAULT_CALIBRATION_SIZE = 256


def _int8_calib(value: Any) -> Any:
    return Path(value) if isinstance(value, str) else value


@dataclasses.dataclass(frozen=True)
class Int8Options:
    """``--precision int8``: how ``export_onnx(..., precision="int8", int8=...)`` quantizes.

    ``method`` None picks ``"static"`` when ``calib`` is given, else ``"dynamic"``; ``calib_method``
    None is ``"minmax"`` (static). ``calib`` is a data path (the commands' reader:
    :func:`hydra_deploy.evaluation.int8_data.int8_calibration` reads it from the staged export),
    the model's inputs (an array, or arrays by input name), or a callable that takes the staged
    FP32 export folder and returns them. ``FLAGS`` spells the fields as the commands do."""

    SECTION: ClassVar[str] = "INT8 (with --precision int8)"
    FLAGS: ClassVar[dict[str, str]] = {
        "method": "--int8-method",
        "calib": "--int8-calib",
        "calib_method": "--int8-calib-method",
        "calib_size": "--int8-calib-size",
    }

    method: str | None = option(
        None,
        "--int8-method",
        "dynamic: int8 weights, activations quantized at run time (no data; ONNX Runtime on a "
        "CPU); static: QDQ with activations calibrated on --int8-calib (ONNX Runtime and "
        "TensorRT). Default: static with --int8-calib, else dynamic",
        choices=INT8_METHODS,
    )
    calib: object = option(
        None,
        "--int8-calib",
        "data whose activations calibrate static INT8: an image folder, a .npz of inputs, a "
        ".txt/.tsv for text models (read and preprocessed as hydra-eval reads data)",
        metavar="DATA",
        parse=_int8_calib,
    )
    calib_method: str | None = option(
        None,
        "--int8-calib-method",
        "how activations' ranges are calibrated: minmax (default), entropy or percentile (99.999)",
        choices=CALIBRATION_METHODS,
    )
    calib_size: int = option(
        DEFAULT_CALIBRATION_SIZE,
        "--int8-calib-size",
        f"calibrate on at most N examples, a seeded random subset of more (default "
        f"{DEFAULT_CALIBRATION_SIZE}; at least {MIN_CALIBRATION_EXAMPLES})",
        type=int,
        metavar="N",
    )

    def __post_init__(self) -> None:
        _check_choice(self, "method", INT8_METHODS)
        _check_choice(self, "calib_method", CALIBRATION_METHODS)
        _check_count(self, "calib_size", MIN_CALIBRATION_EXAMPLES)
        method = self.method or ("static" if self.calib is not None else "dynamic")
        if method == "static" and self.calib is None:
            raise ParameterError(
                "static INT8 calibrates the activations' ranges on data: give `calib` (a few "
                "hundred of the model's inputs), or `method` dynamic (weights only)"
            )
        if method == "dynamic" and self.calib is not None:
            raise ParameterError(
                "`calib` is static INT8's calibration data; dynamic INT8 takes none: drop "
                "`calib`, or give `method` static"
            )
        if method == "dynamic" and self.calib_method is not None:
            raise ParameterError(
                "`calib_method` calibrates static INT8; dynamic INT8 has no calibration: drop "
                "it, or give `calib` data"
            )
        object.__setattr__(self, "method", method)
        if method == "static" and self.calib_method is None:
            object.__setattr__(self, "calib_method", "minmax")


def _check_least(group: Any, name: str, minimum: int, error: type = ParameterError) -> None:
    """``name`` None, or an int >= ``minimum`` (the commands' wording: "at least")."""
    value = getattr(group, name)
    if value is None:
        return
    if not _is_int(value):
        raise error(f"`{name}` must be an int, got {value!r}")
    if value < minimum:
        raise error(f"`{name}` must be at least {minimum}, got {value}")


def _providers(value: Any) -> list[str] | None:
    """ONNX Runtime providers: a comma-separated string (``cuda,cpu``) or a sequence of names."""
    if value is None:
        return None
    names = value.split(",") if isinstance(value, str) else list(value)
    names = [str(name).strip() for name in names]
    if not names or not all(names):
        raise ParameterError(
            f"`providers` must name ONNX Runtime providers, comma-separated (cpu,cuda,tensorrt), "
            f"got {value!r}"
        )
    return names


@dataclasses.dataclass(frozen=True)
class RunnerOptions:
    """How a command runs an export (``load_runner`` and the batches it is given): what the
    runtime commands share (hydra-run, hydra-calibrate, hydra-compare, hydra-eval, hydra-serve,
    hydra-score-dataset; each adds the fields that apply to it). ``providers`` is a list (a
    comma-separated string is split); ``engine``: a TensorRT engine built from the export, run
    instead of its model.onnx (then ``providers``, ONNX Runtime's, cannot be given); ``raw``:
    leave out the export's decisions."""

    SECTION: ClassVar[str] = "runtime"

    providers: Sequence[str] | None = option(
        None, "--providers", "ONNX Runtime providers, comma-separated (cpu,cuda,tensorrt)"
    )
    engine: object = option(
        None, "--engine", "a TensorRT engine built from the export", type=Path, metavar="FILE"
    )
    batch_size: int | None = option(
        None,
        "--batch-size",
        "examples per forward pass (default: the model's max batch, else 32)",
        type=int,
        metavar="N",
    )
    threads: int | None = option(
        None,
        "--threads",
        "threads to compute with: ONNX Runtime's intra-op threads, and torch's where the "
        "command runs PyTorch (default: each library's own, all cores; a small N keeps a job "
        "steady on a shared machine)",
        type=int,
        metavar="N",
    )
    raw: bool = option(
        False,
        "--raw",
        "scores only: leave out the decisions of hydra-calibrate (calibrated confidence, "
        "prediction set, answer/abstain, OOD flag) even when the export holds them, and do not "
        "check them against the model file",
        action="store_true",
    )
    skip_unreadable: bool = option(
        False,
        "--skip-unreadable",
        "skip an image file that cannot be decoded (truncated, or no image: a text file named "
        "x.png) with a warning naming it, count the skipped files at the end and list them in "
        "the output, instead of stopping the run",
        action="store_true",
    )
    allow_decisions_mismatch: bool = option(
        False,
        "--allow-decisions-mismatch",
        "apply the decisions of hydra-calibrate even on other numbers than they were fitted "
        "on (another backend, precision or engine file), with a warning: their guarantees do "
        "not cover these numbers (default: refused, with the command that fits them again)",
        action="store_true",
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "providers", _providers(self.providers))
        _check_least(self, "batch_size", 1)
        _check_least(self, "threads", 1)
        if self.engine is not None and self.providers is not None:
            raise ParameterError("`providers` are ONNX Runtime's; an `engine` runs in TensorRT")

    @property
    def decisions(self) -> bool:
        """Whether the export's decisions are applied (not ``raw``)."""
        return not self.raw

    def load_kwargs(self, **changes: Any) -> dict[str, Any]:
        """``load_runner``'s keyword arguments besides the path and backend (``changes`` win)."""
        return {
            "providers": self.providers,
            "threads": self.threads,
            "decisions": self.decisions,
            "allow_decisions_mismatch": self.allow_decisions_mismatch,
            **changes,
        }


@dataclasses.dataclass(frozen=True)
class CalibrationOptions:
    """How hydra-calibrate fits an export's decisions (``calibrate``; the keyword arguments of
    :func:`~hydra_deploy.decisions.fit_decisions` besides the hashes and class names, which come
    from the runner and the data). ``sets`` ``"none"`` (or ``alpha`` None): no prediction sets;
    ``risk`` None: no answer-or-abstain rule; ``ood_alpha`` None (``--ood-alpha 0``): no OOD
    flag. Adding a fitting option is one field here: its flag, parsing and its keyword in
    :meth:`fit_kwargs` follow."""

    SECTION: ClassVar[str] = "decisions"

    alpha: float | None = option(
        0.1,
        "--alpha",
        "prediction sets hold the true class with probability >= 1 - alpha (default 0.1)",
        type=float,
    )
    sets: str = option(
        "lac",
        "--sets",
        "prediction-set method (default lac: the smallest sets, may be empty; "
        f"{'/'.join(name for name, score in SET_SCORES.items() if score.top_always_in)} "
        "always hold the top class); none: no sets",
        choices=(*SET_METHODS, "none"),
    )
    class_conditional: bool = option(
        False,
        "--class-conditional",
        "one threshold per class: coverage >= 1 - alpha within every class (needs enough "
        "examples of each)",
        action="store_true",
    )
    risk: float | None = option(
        None,
        "--risk",
        "fit answer-or-abstain: the largest share answered whose error rate is <= R "
        "(with probability >= 1 - delta); default: no abstention rule",
        type=float,
        metavar="R",
    )
    delta: float = option(
        0.1,
        "--delta",
        "the probability that the --risk guarantee fails (default 0.1)",
        type=float,
    )
    accept_score: str = option(
        "msp",
        "--accept-score",
        "what answer-or-abstain thresholds (default msp, the calibrated confidence)",
        choices=DECISION_SCORES,
    )
    ood_alpha: float | None = option(
        0.05,
        "--ood-alpha",
        "the OOD flag flags at most this share of ID inputs (default 0.05; 0: no flag)",
        type=float,
        parse=lambda value: None if value == 0 else value,
    )
    ood_score: str = option(
        "msp",
        "--ood-score",
        "what the OOD flag thresholds (default msp: a low calibrated confidence)",
        choices=DECISION_SCORES,
    )
    holdout: float = option(
        0.5,
        "--holdout",
        "share of the data the thresholds are fitted on; the rest fits the temperature "
        "(default 0.5)",
        type=float,
        metavar="F",
    )
    seed: int = option(0, "--seed", "seed of the split, >= 0 (default 0)", type=int)
    temperature: float | None = option(
        None,
        "--temperature",
        "use this temperature instead of fitting one, in [0.05, 20] (1: the model's own "
        "probabilities, e.g. where a fitted T lands at a bound of its search); the temperature "
        "part still fits RAPS's parameters and the answer-or-abstain grid (default: fitted)",
        type=float,
        metavar="T",
    )

    def __post_init__(self) -> None:
        _check_least(self, "seed", 0)
        if self.class_conditional and self.sets == "none":
            raise ParameterError("`class_conditional` needs prediction sets; drop `sets` none")

    def fit_kwargs(self) -> dict[str, Any]:
        """:func:`~hydra_deploy.decisions.fit_decisions`' keyword arguments."""
        kwargs = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.sets == "none":
            kwargs.update(alpha=None, sets="lac")
        return kwargs


class ServeSettingError(ServeError, ParameterError):
    """A serving setting is invalid (a ServeError that names its parameters)."""


def _check_serve_count(group: Any, name: str, minimum: int) -> None:
    value = getattr(group, name)
    if value is not None and (not _is_int(value) or value < minimum):
        raise ServeSettingError(f"`{name}` must be an integer >= {minimum}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class BatchingOptions:
    """How Triton serves a model (hydra-serve's live server, ``--triton``'s repository entry):
    its name, the dynamic batcher's batches and queue delay, and the model instances. The
    repository's flags are these under ``--triton-``."""

    SECTION: ClassVar[str] = "model"

    model_name: str | None = option(
        None,
        "--model-name",
        "Triton model name (default: the export folder's name, in letters, digits, '.', '_', '-')",
        metavar="NAME",
        prefixed="name",
    )
    max_batch: int | None = option(
        None,
        "--max-batch",
        "largest batch Triton forms or accepts (default: the export's batch_profile max; at "
        "most that)",
        type=int,
        metavar="N",
    )
    preferred_batch: Sequence[int] | None = option(
        None,
        "--preferred-batch",
        "batch sizes the dynamic batcher aims for (default: the profile's opt and max)",
        type=int,
        nargs="+",
        metavar="N",
    )
    queue_delay_us: int = option(
        1000,
        "--queue-delay-us",
        "longest a request waits for others to batch with, in microseconds (default %(default)s)",
        type=int,
        metavar="US",
    )
    instances: int = option(
        1,
        "--instances",
        "model instances running batches in parallel (default 1)",
        type=int,
        metavar="N",
    )

    def __post_init__(self) -> None:
        check_batching(self)


def check_batching(group: Any) -> None:
    """ServeSettingError for a batching setting of ``group`` (a :class:`BatchingOptions`, or a
    group that holds its fields) that cannot work."""
    _check_serve_count(group, "instances", 1)
    _check_serve_count(group, "queue_delay_us", 0)
    _check_serve_count(group, "max_batch", 1)
    preferred = group.preferred_batch
    if preferred is not None and (not preferred or any(not _is_int(b) or b < 1 for b in preferred)):
        raise ServeSettingError(
            f"`preferred_batch` sizes must be integers >= 1, got {list(preferred)!r}"
        )


#: The build's groups, in the order the commands show them.
GROUPS = (LoadOptions, PreprocessingOptions, SelectionOptions, FinetuneOptions, FuseOptions)


# --------------------------------------------------------------------------------------------------
# the command line


def parse_model_args(pairs: list[str]) -> dict[str, Any]:
    """``--model-arg KEY=VALUE`` pairs -> constructor keyword arguments (VALUE as JSON, else text)."""
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise HydraError(
                f"--model-arg {pair!r} is not KEY=VALUE (e.g. --model-arg embed_dim=64)"
            )
        if key in ("num_classes", "pretrained", "checkpoint_path", "preprocessing"):
            flag = {"num_classes": "--num-classes", "preprocessing": "--mean/--std/..."}.get(
                key, "--checkpoint"
            )
            raise HydraError(f"--model-arg {key}=... is set with {flag}, not --model-arg")
        if key in kwargs:
            raise HydraError(f"--model-arg {key} is given twice ({kwargs[key]!r} and {text!r})")
        try:
            kwargs[key] = json.loads(text)
        except ValueError:
            kwargs[key] = text
    return kwargs


def _dest(flag: str) -> str:
    """argparse's attribute for ``flag`` (``--finetune-steps`` -> ``finetune_steps``)."""
    return flag.lstrip("-").replace("-", "_")


def flag_of(group: type, name: str) -> str | None:
    """The flag of field ``name`` of ``group``."""
    return {f.name: f.metadata["flag"] for f in dataclasses.fields(group)}[name]


def _options(group: Any) -> list[dataclasses.Field]:
    """``group``'s fields declared with :func:`option` (a plain field is a library value)."""
    return [f for f in dataclasses.fields(group) if "flag" in f.metadata]


def _flag(f: dataclasses.Field, prefix: str) -> str | None:
    """Field ``f``'s flag, under ``prefix`` (``triton-``: ``--triton-...``) when one is given."""
    flag = f.metadata["flag"]
    if flag is None or not prefix:
        return flag
    return "--" + prefix + (f.metadata["prefixed"] or flag[2:])


def spelling(group: type, prefix: str = "") -> dict[str, str]:
    """Field name -> the flag that sets it (under ``prefix``): how a command spells ``group``'s
    parameters in a :class:`~hydra_deploy.errors.ParameterError`'s message."""
    flags = {f.name: _flag(f, prefix) for f in _options(group)}
    return {name: flag for name, flag in flags.items() if flag is not None}


def add_options(
    parser: argparse.ArgumentParser,
    group: type,
    section: Any = None,
    *,
    prefix: str = "",
    only: Sequence[str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    helps: Mapping[str, str] | None = None,
) -> None:
    """Add ``group``'s flags to ``parser`` (in ``section``, an argument group; else in a new one
    titled by the field's ``section`` or ``group.SECTION``); a flag the parser already has
    (``--seed``, shared) is not added twice, a field holding another group's value adds that
    group's flags. ``prefix`` spells every flag ``--{prefix}...``; ``only`` adds those fields'
    flags alone; ``defaults`` and ``helps`` replace fields' defaults and help for this command
    (a help may say ``%(default)s``). A field without a default is a required flag unless
    ``defaults`` gives it one."""
    sections: dict[str, Any] = {}

    def section_for(title: str | None) -> Any:
        if section is not None:
            return section
        title = title or group.SECTION
        if title not in sections:
            sections[title] = parser.add_argument_group(title)
        return sections[title]

    known = {s for action in parser._actions for s in action.option_strings}
    defaults, helps = dict(defaults or {}), dict(helps or {})
    for f in _options(group):
        meta = f.metadata
        if only is not None and f.name not in only:
            continue
        if meta["group"] is not None:
            add_options(parser, meta["group"])
            continue
        flag = _flag(f, prefix)
        if flag is None or flag in known:
            continue
        default = defaults.get(f.name, f.default)
        kwargs: dict[str, Any] = {"dest": _dest(flag), "help": helps.get(f.name, meta["help"])}
        if meta["action"] is not None:
            kwargs["action"] = meta["action"]
            kwargs["default"] = [] if meta["action"] == "append" else default
        elif default is dataclasses.MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = default
        for key in ("type", "choices", "metavar", "nargs"):
            if meta[key] is not None:
                kwargs[key] = meta[key]
        aliases = () if prefix else meta["aliases"]
        section_for(meta["section"]).add_argument(flag, *aliases, **kwargs)


def from_args(group: type, args: argparse.Namespace, *, prefix: str = "", **given: Any) -> Any:
    """The ``group`` the parsed flags give (a flag the parser lacks keeps the field's default);
    ``given``: values of fields no flag of this command sets (a positional argument)."""
    values: dict[str, Any] = {}
    for f in _options(group):
        meta = f.metadata
        if meta["group"] is not None:
            values[f.name] = meta["parse"](from_args(meta["group"], args))
            continue
        flag = _flag(f, prefix)
        if flag is None or not hasattr(args, _dest(flag)):
            continue
        value = getattr(args, _dest(flag))
        values[f.name] = meta["parse"](value) if meta["parse"] is not None else value
    return group(**{**values, **given})


def command_line(options: Any, prefix: str = "") -> list[str]:
    """The flags that give ``options`` again (a group's instance), as strings: each field whose
    ``repeat`` says so (by default: whose value is not its default)."""
    argv: list[str] = []
    for f in _options(options):
        flag, repeat, value = _flag(f, prefix), f.metadata["repeat"], getattr(options, f.name)
        if flag is None or value is None or (repeat is not True and value == f.default):
            continue
        if callable(repeat) and not repeat(options):
            continue
        action = f.metadata["action"]
        if action in ("store_true", "store_false"):
            argv += [flag] if bool(value) == (action == "store_true") else []
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def _parameter_flags() -> dict[str, str]:
    """Field name -> how the commands spell it, where that is not ``--name-with-dashes``."""
    flags: dict[str, str] = {}
    for group in GROUPS:
        for f in dataclasses.fields(group):
            flag = f.metadata["flag"]
            if f.metadata["group"] is not None:
                inner = [g.metadata["flag"] for g in dataclasses.fields(f.metadata["group"])]
                flags[f.name] = f"the image preprocessing flags ({', '.join(inner)})"
            elif flag is not None and flag != "--" + f.name.replace("_", "-"):
                flags[f.name] = flag
    return flags


#: how the commands spell the library's parameters in its messages (others: ``--name-with-dashes``)
PARAMETER_FLAGS: dict[str, str] = _parameter_flags()
