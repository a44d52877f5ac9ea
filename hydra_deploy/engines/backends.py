"""The runtime backends :func:`~hydra_deploy.engines.runner.load_runner` runs models with: one row
each (:class:`Backend`), registered where its runner is defined.

A row holds everything that differs between backends: the name and aliases (``load_runner(...,
backend=)``, ``hydra-run --backend``), the optional package it needs, its runner class (a
:class:`~hydra_deploy.engines.runner_base.BaseRunner`), the kinds of path it opens
(:data:`PATH_KINDS`: an export folder, a ``.onnx`` file, an engine file), each with the function
that opens one, and how its runner proves which ``model.onnx`` its numbers come from
(:class:`ModelProof`), which binds an export's decisions (``hydra-calibrate``) to the numbers they
were fitted on. A new backend is its runner module plus one row, registered from anywhere, as
timm registers a model where it is defined::

    from hydra_deploy.engines.backends import RUNS_ONNX_FILE, Backend, register_backend

    register_backend(Backend(
        "openvino", runner=OpenVinoRunner, dependency="openvino", proof=RUNS_ONNX_FILE,
        opens={"export folder": open_folder, ".onnx file": open_onnx},
    ))

The built-in rows (``onnxruntime``, ``tensorrt``) are in
:mod:`~hydra_deploy.engines.onnxruntime_runner` and :mod:`~hydra_deploy.engines.tensorrt_runner`;
importing :mod:`hydra_deploy.engines.runner` registers them. A decisions record names the backend
of its numbers by the row's ``record_name`` (default: its name): a backend computing ONNX
Runtime's numbers (a wrapper of it) may share ``"onnxruntime"``; the record's reader
(:mod:`hydra_deploy.export_folder`, which imports no runtime) checks the name's form only.

Edge runtime: numpy only. Never torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from hydra_deploy.engines.runner_base import BaseRunner
from hydra_deploy.errors import RunnerError
from hydra_deploy.export_folder import (
    ENGINE_SUFFIXES,
    INFO_FILE,
    MODEL_FILE,
    ExportInfo,
    file_sha256,
    is_backend_name,
    read_info,
)
from hydra_deploy.optional import missing

__all__ = [
    "BACKENDS",
    "PATH_KINDS",
    "RUNS_BUILT_ENGINE",
    "RUNS_ONNX_FILE",
    "Backend",
    "ModelProof",
    "PathKind",
    "RunRequest",
    "backend_of",
    "export_beside_onnx",
    "folder_model",
    "get_backend",
    "path_kinds",
    "register_backend",
    "unregister_backend",
]

_log = logging.getLogger("hydra_deploy")


@dataclass(frozen=True)
class RunRequest:
    """What :func:`~hydra_deploy.engines.runner.load_runner` was asked, handed to the function
    that opens a path: the backend's name and the runtime's options."""

    backend: str
    providers: Sequence[Any] | str | None = None  # ONNX Runtime's execution providers
    threads: int | None = None  # intra-op threads
    decisions: bool = True  # apply the export's decisions (False: raw scores only)
    allow_decisions_mismatch: bool = False  # ... even on numbers they were not fitted on


#: A function that opens one kind of path for a backend: (the path, the request) -> its runner.
Opener = Callable[[Path, RunRequest], BaseRunner]


# --- the kinds of path ---------------------------------------------------------------------------
@dataclass(frozen=True)
class PathKind:
    """A kind of path :func:`~hydra_deploy.engines.runner.load_runner` takes: what it is called,
    whether a path is one, and the backend that runs it when none is asked for."""

    name: str
    matches: Callable[[Path], bool]
    default_backend: str


def _is_onnx(path: Path) -> bool:
    return path.suffix.lower() == ".onnx"


def _is_engine(path: Path) -> bool:
    return path.suffix.lower() in ENGINE_SUFFIXES


#: The kinds of path the built-in backends open, tried in order after those a registered row
#: adds (:attr:`Backend.kinds`).
PATH_KINDS: tuple[PathKind, ...] = (
    PathKind("export folder", Path.is_dir, "onnxruntime"),
    PathKind(".onnx file", _is_onnx, "onnxruntime"),
    PathKind("engine file", _is_engine, "tensorrt"),
)


# --- how a runner proves which model it runs -----------------------------------------------------
class ModelProof:
    """How a backend's runner proves which ``model.onnx`` its numbers come from
    (:meth:`model_sha256`: a decisions record fitted on another one is refused) and which numbers
    they are (:meth:`precision`, :meth:`file_sha256`: a record fitted on other numbers is refused
    unless asked). :data:`RUNS_ONNX_FILE` and :data:`RUNS_BUILT_ENGINE` are the two ways; a
    backend with another one subclasses this."""

    #: whether the numbers belong to the file run itself (a record names its hash: an engine)
    binds_file: bool = False

    def model_sha256(self, runner: BaseRunner) -> str | None:
        """The SHA-256 of the ``model.onnx`` the runner's numbers come from (None: unknown)."""
        raise NotImplementedError

    def precision(self, runner: BaseRunner) -> str | None:
        """The precision the runner computes in (None: unknown)."""
        raise NotImplementedError

    def file_sha256(self, runner: BaseRunner) -> str | None:
        """The SHA-256 of the file run where the numbers are its own (:attr:`binds_file`)."""
        return file_sha256(runner.path) if self.binds_file else None

    def unknown_model(self, runner: BaseRunner, export: ExportInfo) -> str:
        """Why :meth:`model_sha256` is unknown and how to keep the decisions (a warning)."""
        return (
            f"{runner.path}: cannot tell which model.onnx it runs, so the decisions in "
            f"{export.path} are not applied"
        )


class _RunsOnnxFile(ModelProof):
    """The file run is the export's ``model.onnx`` (or a copy): its hash proves which it is; the
    numbers are the graph's, in the export's precision."""

    def model_sha256(self, runner: BaseRunner) -> str | None:
        return file_sha256(runner.path)

    def precision(self, runner: BaseRunner) -> str | None:
        export = runner.export_info
        return None if export is None else export.precision


class _RunsBuiltEngine(ModelProof):
    """The file run was built from a ``model.onnx``, which its JSON sidecar names (``onnx_sha256``,
    written by hydra-build); the numbers are the file's own: its hash and the sidecar's
    precision."""

    binds_file = True

    def model_sha256(self, runner: BaseRunner) -> str | None:
        return None if runner.engine_info is None else runner.engine_info.onnx_sha256

    def precision(self, runner: BaseRunner) -> str | None:
        return None if runner.engine_info is None else runner.engine_info.precision

    def unknown_model(self, runner: BaseRunner, export: ExportInfo) -> str:
        return (
            f"{runner.path}: cannot tell which model.onnx this engine was built from (no "
            f"onnx_sha256 in its JSON sidecar), so the decisions in {export.path} are not "
            "applied; build the engine with hydra-build to keep them"
        )


RUNS_ONNX_FILE: ModelProof = _RunsOnnxFile()
RUNS_BUILT_ENGINE: ModelProof = _RunsBuiltEngine()


# --- the row ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Backend:
    """One runtime backend (see the module docstring).

    ``name``: how it is asked for (lowercase; also ``runner.backend``); ``aliases``: other
    spellings. ``runner``: its runner class. ``opens``: path kind name -> the function that opens
    such a path (:data:`PATH_KINDS`, or a kind of ``kinds``). ``dependency``: the optional package
    it needs, by import name (what to install; its runner raises the install hint when it is
    missing). ``proof``: how its runner proves which model.onnx it runs. ``record_name``: the backend
    a decisions record names for its numbers (default ``name``). ``refuses``: path kind name -> what to do instead, for a kind it does not open. ``kinds``:
    kinds of path it adds (tried before the built-in ones).
    """

    name: str
    runner: type[BaseRunner]
    opens: Mapping[str, Opener]
    aliases: tuple[str, ...] = ()
    dependency: str | None = None
    proof: ModelProof = RUNS_ONNX_FILE
    record_name: str | None = None
    refuses: Mapping[str, str] = field(default_factory=dict)
    kinds: tuple[PathKind, ...] = ()

    def __post_init__(self) -> None:
        for name in (self.name, *self.aliases, self.records_as):
            if not is_backend_name(name):  # the form a decisions record accepts
                raise RunnerError(
                    f"backend name {name!r} is not usable: use 1 to 32 lowercase letters, digits, "
                    "'_', '.' and '-', starting with a letter or digit"
                )
        if not self.opens:
            raise RunnerError(
                f"backend {self.name!r} opens no kind of path: give `opens`, e.g. "
                "{'.onnx file': open_onnx}"
            )
        if not isinstance(self.proof, ModelProof):
            raise RunnerError(
                f"backend {self.name!r}: `proof` must be a ModelProof (RUNS_ONNX_FILE, "
                f"RUNS_BUILT_ENGINE or a subclass), got {self.proof!r}"
            )

    @property
    def installed(self) -> bool:
        """Whether its optional package is installed here (found without importing it)."""
        return self.dependency is None or not missing(self.dependency)

    @property
    def records_as(self) -> str:
        """The backend a decisions record names for this backend's numbers."""
        return self.record_name or self.name

    def open(self, kind: PathKind, target: Path, asked: RunRequest) -> BaseRunner:
        """A runner of ``target`` (a path of ``kind``), or RunnerError saying what to do."""
        opener = self.opens.get(kind.name)
        if opener is None:
            others = [b.name for b in _REGISTRY.values() if kind.name in b.opens]
            fix = self.refuses.get(kind.name) or (
                f"run it with backend {' or '.join(map(repr, others))}"
                if others
                else "no backend registered opens one"
            )
            raise RunnerError(
                f"{target} is an {kind.name}, which backend {self.name!r} does not open (it opens "
                f"{', '.join(self.opens)}): {fix}"
            )
        return opener(target, asked)


# --- the registry ------------------------------------------------------------------------------------
_REGISTRY: dict[str, Backend] = {}
#: The registered backends by name (a read-only view: :func:`register_backend` adds to it).
BACKENDS: Mapping[str, Backend] = MappingProxyType(_REGISTRY)


def _spellings(backend: Backend) -> tuple[str, ...]:
    return (backend.name, *backend.aliases)


def register_backend(backend: Backend, *, replace: bool = False) -> Backend:
    """Add ``backend`` to :data:`BACKENDS` and return it. A name or alias another row has is
    refused unless ``replace`` (which replaces the row of the same name); so is a path kind no
    row or :data:`PATH_KINDS` defines."""
    taken = {
        spelling: other.name
        for other in _REGISTRY.values()
        if other.name != backend.name or not replace
        for spelling in _spellings(other)
    }
    clash = [s for s in _spellings(backend) if s in taken]
    if clash:
        raise RunnerError(
            f"backend {backend.name!r}: {', '.join(map(repr, clash))} is taken by backend "
            f"{taken[clash[0]]!r}; choose another name, or pass replace=True to replace a row of "
            "the same name"
        )
    known = {k.name for k in PATH_KINDS} | {
        k.name for row in (*_REGISTRY.values(), backend) for k in row.kinds
    }
    unknown = [name for name in (*backend.opens, *backend.refuses) if name not in known]
    if unknown:
        raise RunnerError(
            f"backend {backend.name!r} names unknown path kinds {unknown}; use "
            f"{', '.join(sorted(known))}, or add a PathKind to its `kinds`"
        )
    _REGISTRY[backend.name] = backend
    return backend


def unregister_backend(name: str) -> Backend:
    """Remove the row named ``name`` (a plugin's, a test's) and return it."""
    backend = get_backend(name)
    del _REGISTRY[backend.name]
    return backend


def get_backend(name: str) -> Backend:
    """The row of a backend name or alias (any case), or RunnerError naming those registered."""
    wanted = str(name).lower()
    for backend in _REGISTRY.values():
        if wanted in _spellings(backend):
            return backend
    raise RunnerError(
        f"unknown backend {name!r}; use {' or '.join(map(repr, _REGISTRY)) or 'a registered one'}"
    )


def backend_of(runner: Any) -> Backend | None:
    """The row of a runner's ``backend`` (None: no registered backend, e.g. a PyTorch runner)."""
    return _REGISTRY.get(getattr(runner, "backend", None) or "")


def path_kinds() -> tuple[PathKind, ...]:
    """Every kind of path, in the order tried: those registered rows add, then :data:`PATH_KINDS`."""
    added = tuple(kind for backend in _REGISTRY.values() for kind in backend.kinds)
    return added + PATH_KINDS


# --- helpers for backends that run an export's ONNX file ------------------------------------------
def folder_model(folder: Path) -> Path:
    """An export folder's ``model.onnx``, or RunnerError saying how to make one."""
    onnx_path = folder / MODEL_FILE
    if not onnx_path.is_file():
        raise RunnerError(
            f"{str(folder)!r} is not an export folder: {MODEL_FILE} is missing (make one "
            "with hydra-export --out DIR)"
        )
    return onnx_path


def export_beside_onnx(onnx_path: Path, decisions: bool = True) -> ExportInfo | None:
    """The ``hydra.json`` beside a ``.onnx`` file, if it describes that file (its hash is
    checked). When it does not, and the file is the folder's model.onnx while hydra.json holds
    decisions (and ``decisions``), they are refused as loading the folder refuses them."""
    info = read_info(onnx_path.parent / INFO_FILE, required=False)
    if info is None or info.onnx_sha256 is None:
        return info
    sha = file_sha256(onnx_path)
    if sha != info.onnx_sha256:
        if decisions and info.decisions is not None and onnx_path.name == MODEL_FILE:
            info.decisions.check_fitted_on(sha, str(info.folder))
        _log.warning(
            "%s describes another ONNX file than %s (hash differs); running without it",
            info.path,
            onnx_path.name,
        )
        return None
    return info
