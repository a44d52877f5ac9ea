"""The project's exception family.

Every error a user can cause (a wrong argument, a missing file, a corrupt checkpoint, an impossible
configuration) is raised as a :class:`HydraError` subclass whose message says what was wrong and
what to do. The command-line tools print the message alone and exit non-zero.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping


class HydraError(Exception):
    """Base class of every error hydra-deploy raises on purpose."""


_PARAMETER = re.compile(r"`([a-z_][a-z0-9_]*)`")


class ParameterError(HydraError, ValueError):
    """An argument of a library call is wrong or clashes with another.

    The message names parameters between backticks (`` `members` ``): ``str(err)`` shows their
    names (``members``), :meth:`for_command` the flags a command gives them (``--members``).
    """

    def __init__(self, message: str) -> None:
        self.template = message
        super().__init__(_PARAMETER.sub(lambda m: m.group(1), message))

    def for_command(self, flags: Mapping[str, str] | None = None) -> str:
        """The message with each parameter spelled as its flag: ``flags[name]``, else
        ``--name-with-dashes``."""
        return _as_flags(self.template, flags or {})


def _as_flags(template: str, flags: Mapping[str, str]) -> str:
    return _PARAMETER.sub(
        lambda m: flags.get(m.group(1), "--" + m.group(1).replace("_", "-")), template
    )


#: the flags of the command that is running (set by :func:`command_spelling`), else None: Python
_COMMAND_FLAGS: list[Mapping[str, str]] = []


@contextlib.contextmanager
def command_spelling(flags: Mapping[str, str]) -> Iterator[None]:
    """While a command runs: :func:`spelled` and :func:`said` give its spelling (``--calib``),
    not the library's (``calib=``). The commands enter it; Python callers never do."""
    _COMMAND_FLAGS.append(flags)
    try:
        yield
    finally:
        _COMMAND_FLAGS.pop()


def spelled(python: str, command: str) -> str:
    """How to say an advice to whoever is listening: ``python`` from the library, ``command``
    inside a command (``spelled("load_backbone('hf:<folder>')", "--backbone hf:<folder>")``)."""
    return command if _COMMAND_FLAGS else python


def said(template: str) -> str:
    """A message (a warning, advice) naming parameters between backticks, like
    :class:`ParameterError`'s: ``calib`` from the library, ``--calib`` inside a command."""
    if _COMMAND_FLAGS:
        return _as_flags(template, _COMMAND_FLAGS[-1])
    return _PARAMETER.sub(lambda m: m.group(1), template)


def plural(noun: str) -> str:
    """The English plural of a unit noun: class -> classes, batch -> batches, image -> images."""
    if noun.endswith(("s", "x", "ch", "sh")):
        return noun + "es"
    if noun.endswith("y") and noun[-2:-1] not in tuple("aeiou"):
        return noun[:-1] + "ies"
    return noun + "s"


def counted(n: int, noun: str, plural_form: str | None = None) -> str:
    """``n`` and its noun, plural right: ``counted(1, "class")`` is "1 class", 3: "3 classes"."""
    return f"{n} {noun if n == 1 else (plural_form or plural(noun))}"


class SpecError(HydraError, ValueError):
    """A HydraSpec / MemberSpec is malformed or does not fit the backbone it is used with."""


class BackboneError(HydraError, ValueError):
    """A backbone name is unknown, or a model is not a supported Transformer."""


class UnsupportedModelError(BackboneError):
    """The model is a known family but uses a feature the fused model does not implement."""


class CheckpointError(HydraError, OSError):
    """A checkpoint is missing, unreadable, corrupt, or does not match the architecture."""


class FusionError(HydraError, ValueError):
    """Members cannot be fused with the given spec (they differ in architecture, count, ...)."""


class DataError(HydraError, ValueError):
    """Data for importance, selection or fine-tuning is empty, mis-shaped or mislabelled."""


class FinetuneError(HydraError, ValueError):
    """A fine-tuning setting is invalid (epochs, lr, batch size, ...)."""


class ExportError(HydraError, RuntimeError):
    """Exporting to ONNX failed, or the exported file does not match PyTorch."""


class EngineError(HydraError, RuntimeError):
    """A TensorRT engine cannot be built or loaded (TensorRT missing, unsupported precision, ...)."""


class RunnerError(HydraError, ValueError):
    """A model file cannot be run, or the inputs given to a runner do not fit the model."""


class ServeError(HydraError, RuntimeError):
    """Serving and distributed scoring: Triton repositories, hydra-serve, hydra-score-dataset."""
