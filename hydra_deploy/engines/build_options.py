"""A TensorRT build's settings as one typed group: :class:`EngineBuildOptions`.

One declaration (in :mod:`hydra_deploy.options`' style: one field per setting, its flag and help
in the field) serves every place that builds or describes an engine: the Python build
(:func:`~hydra_deploy.engines.tensorrt.plan_build`, :func:`~hydra_deploy.engines.tensorrt.build_engine`),
the trtexec recipes (:func:`~hydra_deploy.engines.trtexec.trtexec_command`) and hydra-build's
flags (``add_options(parser, EngineBuildOptions)``, ``from_args(EngineBuildOptions, args)``)::

    from hydra_deploy.engines.build_options import EngineBuildOptions
    from hydra_deploy.engines.tensorrt import build_engine

    build_engine("export/vit_b16-m3", EngineBuildOptions(precision="best", max_batch=64))
    build_engine("export/vit_b16-m3", precision="best", max_batch=64)   # the same, as keywords

A new build setting is one field here and its use where the build reads it. Standard library and
the small helpers only.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from hydra_deploy.errors import ParameterError
from hydra_deploy.options import option

__all__ = ["BUILD_PRECISIONS", "EngineBuildOptions", "options_with"]

_Group = TypeVar("_Group")

#: The precisions ``hydra-build --precision`` offers (the library takes ``int8`` too: an INT8
#: export builds in INT8 by default).
BUILD_PRECISIONS = ("fp16", "bf16", "fp32", "best")


class _Typing(argparse.Action):
    """``--strongly-typed`` (True) or ``--weakly-typed`` (False), never both."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        value = option_string == self.option_strings[0]
        if getattr(namespace, self.dest) not in (None, value):
            parser.error(
                f"argument {option_string}: not allowed with argument {self._other(value)}"
            )
        setattr(namespace, self.dest, value)

    def _other(self, value: bool) -> str:
        return self.option_strings[1 if value else 0]


@dataclasses.dataclass(frozen=True)
class EngineBuildOptions:
    """How a TensorRT engine is built: its precision, the batch profile, typing, where it goes.

    Every field None keeps the export's own choice (see :func:`~hydra_deploy.engines.tensorrt.
    build_engine` for the rules); the batch sizes, the precision and the typing are checked
    against the export and the TensorRT version by the build itself.
    """

    SECTION: ClassVar[str] = "engine build"

    precision: str | None = option(
        None,
        "--precision",
        "engine precision (default: the export's own precision, else fp16); best = bf16 "
        "where the GPU (SM >= 80) and TensorRT (>= 10) support it, else fp16. An INT8 export "
        "(hydra-export --precision int8 --int8-method static: QuantizeLinear/DequantizeLinear "
        "pairs) builds in INT8 by default",
        choices=BUILD_PRECISIONS,
    )
    out: object = option(None, "--out", "folder for the engine (default: EXPORT_DIR)", type=Path)
    min_batch: int | None = option(
        None, "--min-batch", "profile minimum batch (default: the export's)", type=int
    )
    opt_batch: int | None = option(
        None, "--opt-batch", "batch TensorRT tunes for (default: the export's)", type=int
    )
    max_batch: int | None = option(
        None, "--max-batch", "profile maximum batch (default: the export's)", type=int
    )
    timing_cache: object = option(
        None,
        "--timing-cache",
        "timing cache to reuse and update (default: timing.<gpu>.trt<version>.cache beside "
        "the engine)",
        type=Path,
    )
    strongly_typed: bool | None = option(
        None,
        "--strongly-typed",
        "force the network's typing: --strongly-typed (precision from the graph) or "
        "--weakly-typed (--fp16/--bf16 flags; deprecated since TensorRT 10.12); default: the "
        "precision rules decide",
        aliases=("--weakly-typed",),
        action=_Typing,  # type: ignore[arg-type]  (argparse takes an Action class)
    )

    def __post_init__(self) -> None:
        for name in ("min_batch", "opt_batch", "max_batch"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ParameterError(f"`{name}` must be an int or None, got {value!r}")
        if self.strongly_typed not in (None, True, False):
            raise ParameterError(
                f"`strongly_typed` must be True, False or None, got {self.strongly_typed!r}"
            )
        if self.precision is not None and not isinstance(self.precision, str):
            raise ParameterError(f"`precision` must be a str or None, got {self.precision!r}")

    def given(self) -> dict[str, Any]:
        """The settings given (not None), by field name."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }

    def given_flags(self) -> list[str]:
        """The hydra-build flags of the settings given (``--strongly-typed/--weakly-typed`` for
        the typing)."""
        flags = []
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None:
                flags.append("/".join((f.metadata["flag"], *f.metadata["aliases"])))
        return flags

    @property
    def batch(self) -> tuple[int | None, int | None, int | None]:
        """(min, opt, max) batch as given (None: the export's)."""
        return self.min_batch, self.opt_batch, self.max_batch


def options_with(
    group: type[_Group], options: _Group | None, settings: Mapping[str, Any], function: str
) -> _Group:
    """``options`` (an instance of the dataclass ``group``; None: ``group()``) with ``settings``
    (the keyword form of a function that takes it, e.g. ``build_engine(path, precision="fp16")``)
    put in; an unknown keyword raises the TypeError Python raises for it, naming the fields."""
    if options is not None and not isinstance(options, group):
        raise TypeError(
            f"{function}() takes a {group.__name__} as its options, got {type(options).__name__}"
        )
    names = [f.name for f in dataclasses.fields(group)]
    unknown = [key for key in settings if key not in names]
    if unknown:
        raise TypeError(
            f"{function}() got an unexpected keyword argument {unknown[0]!r}; {group.__name__} "
            f"has {', '.join(names)}"
        )
    base = options if options is not None else group()
    return dataclasses.replace(base, **settings) if settings else base
