"""A live Triton Inference Server for one Hydra export, through PyTriton (``hydra-serve``).

    from hydra_deploy.serve.pytriton_app import HydraServer, ServeConfig

    server = HydraServer(ServeConfig("export/vit_b16-m3", http_port=8000))  # checked, nothing runs
    with server:                        # Triton started, the model loaded and ready
        print(server.describe()["endpoints"])
        server.serve_forever()          # until SIGINT / SIGTERM, then a clean stop

The export is bound as one Triton model (named after its folder) whose Python callable runs
``load_runner(export)`` and :func:`~hydra_deploy.engines.scoring.score_batch` in numpy and answers,
per example: ``member_logits`` [M, C] and ``probs`` [C] (float32), ``msp``,
``predictive_entropy``, ``expected_entropy``, ``mutual_information``, ``disagreement`` (float32)
and ``prediction`` (int64). The per-example scores are declared with shape ``[1]``: Triton refuses
an output without dims (``model output 'msp' must specify 'dims'``) when the model batches, so a
client receives ``[batch, 1]`` for them.

When the export holds decisions (``hydra-calibrate``: ``runner.decisions``), the model also
answers them (:data:`DECISION_OUTPUTS`): ``calibrated_probs`` [C] and ``confidence`` [1]
(float32), and for each rule the record holds ``prediction_set`` [C], ``accept`` [1] and
``ood_flag`` [1] (bool); ``prediction`` is then the argmax of the calibrated probabilities (the
class the set and the answer are about); the scores stay those of the raw probabilities.
``ServeConfig(decisions=False)`` (``hydra-serve --raw``) serves the scores only. Inputs are the runner's (batch axis left out, dynamic
dimensions -1): ``pixel_values`` [3, H, W] float32 for vision exports, ``input_ids``,
``attention_mask`` (and ``token_type_ids`` where the model has it) [-1] int64 for text ones.

Triton's dynamic batcher gathers concurrent requests into batches of at most ``max_batch`` (the
export's ``batch_profile`` max by default; preferred sizes: its opt and max) waiting at most
``queue_delay_us``; requests with other lengths of a dynamic axis are not batched together.
Requests are refused by Triton itself, before they reach the model, when their shape or datatype
does not fit the declared inputs or their batch is above ``max_batch`` (one cannot be split here:
the model's batch limit is part of the contract a client sizes its requests by). Values the
runner refuses (NaN/inf pixels, token ids out of range) come back to the client as a Triton error
(HTTP 500; an error status on gRPC) whose text ends with the runner's :class:`RunnerError`
message; the server keeps serving. A Triton batch succeeds or fails as a whole, so the other requests batched with a
bad one fail too: their error says which request of the batch was bad.

``instances`` > 1 binds one callable per instance, each with its own runner (its own ONNX Runtime
session or TensorRT context), so that batches run in parallel.

Runtime code: numpy, pytriton and this project's engines and uncertainty packages; never torch.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import logging
import os
import re
import signal
import socket
import sys
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from hydra_deploy.engines import scoring
from hydra_deploy.engines.runner import load_runner
from hydra_deploy.errors import HydraError, RunnerError, ServeError
from hydra_deploy.export_folder import INFO_FILE
from hydra_deploy.optional import lazy_module, require
from hydra_deploy.options import BatchingOptions, RunnerOptions, check_batching, option, shared
from hydra_deploy.serve.triton_repo import default_model_name, sanitize_model_name
from hydra_deploy.uncertainty.scores import SCALAR_SCORES

if TYPE_CHECKING:
    from hydra_deploy.engines.runner_base import Runner

logger = logging.getLogger("hydra_deploy")

# PyTriton, imported when a server starts (the checks before it need none)
pytriton = lazy_module("pytriton", purpose="hydra-serve", error=ServeError)
pytriton_triton = lazy_module("pytriton.triton", purpose="hydra-serve", error=ServeError)
pytriton_decorators = lazy_module("pytriton.decorators", purpose="hydra-serve", error=ServeError)
pytriton_model_config = lazy_module(
    "pytriton.model_config", purpose="hydra-serve", error=ServeError
)

SCALAR_OUTPUTS = SCALAR_SCORES
OUTPUT_NAMES = ("member_logits", "probs", *SCALAR_OUTPUTS, "prediction")
#: What an export with decisions also answers, for the rules its record holds:
#: name -> (per-example dims, "classes" standing for the class count; numpy dtype)
DECISION_OUTPUTS = {
    "calibrated_probs": (("classes",), "float32"),
    "confidence": ((1,), "float32"),
    "prediction_set": (("classes",), "bool"),
    "accept": ((1,), "bool"),
    "ood_flag": ((1,), "bool"),
}
#: seconds Triton waits for in-flight requests (and open client connections) when stopping;
#: Triton's own default (30 s) makes every Ctrl-C of an idle server with a connected client wait 30 s
EXIT_TIMEOUT_S = 5
_MODEL_NAME = re.compile(r"^[A-Za-z0-9._-]+$")  # what PyTriton / Triton accept as a model name


# --- configuration -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServeConfig:
    """What to serve and how (``hydra-serve``'s option group: every field with a flag is one of
    its flags); ``None`` takes the default described in each field's help. The batching fields
    are :class:`~hydra_deploy.options.BatchingOptions`' (shared with ``--triton``), ``threads``,
    ``providers`` and ``allow_decisions_mismatch`` :class:`~hydra_deploy.options.RunnerOptions`'.
    ``decisions``: answer the export's decisions, if it holds them (False: ``--raw``)."""

    SECTION: ClassVar[str] = "model"

    export_dir: str | os.PathLike  # the positional EXPORT_DIR
    host: str = option(
        "127.0.0.1",
        "--host",
        "address to listen on (default 127.0.0.1; 0.0.0.0: every interface)",
        section="network",
    )
    http_port: int = option(8000, "--port", "HTTP port (default 8000)", type=int, section="network")
    grpc_port: int | None = option(
        None, "--grpc-port", "gRPC port (default: --port + 1)", type=int, section="network"
    )
    metrics_port: int | None = option(
        None,
        "--metrics-port",
        "Prometheus metrics port (default: --port + 2)",
        type=int,
        section="network",
    )
    model_name: str | None = shared(BatchingOptions, "model_name")
    max_batch: int | None = shared(BatchingOptions, "max_batch")
    preferred_batch: Sequence[int] | None = shared(BatchingOptions, "preferred_batch")
    queue_delay_us: int = shared(BatchingOptions, "queue_delay_us")
    instances: int = shared(
        BatchingOptions,
        "instances",
        help="model instances running batches in parallel, each its own ONNX Runtime session "
        "(default 1)",
    )
    threads: int | None = shared(
        RunnerOptions,
        "threads",
        help="ONNX Runtime intra-op threads per instance (default: ONNX Runtime's; with "
        "--instances > 1: cores / instances)",
    )
    providers: Sequence[str] | None = shared(RunnerOptions, "providers")
    exit_timeout_s: int = option(EXIT_TIMEOUT_S, None)
    decisions: bool = option(True, None)
    #: ... even when fitted on other numbers (backend, precision, engine) than the runner's
    allow_decisions_mismatch: bool = shared(RunnerOptions, "allow_decisions_mismatch")

    def __post_init__(self) -> None:  # a comma-separated string of providers: a list
        object.__setattr__(self, "providers", RunnerOptions(providers=self.providers).providers)

    @property
    def ports(self) -> dict[str, int]:
        """The three ports by the command-line flag that sets them."""
        base = self.http_port
        return {
            "--port": base,
            "--grpc-port": base + 1 if self.grpc_port is None else self.grpc_port,
            "--metrics-port": base + 2 if self.metrics_port is None else self.metrics_port,
        }


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_config(config: ServeConfig) -> None:
    """ServeError for a setting that cannot work, before anything is loaded or started (the
    batching settings: :func:`~hydra_deploy.options.check_batching`'s ServeSettingError, which
    names the parameters: the command spells them as its flags)."""
    for flag, port in config.ports.items():
        if not _is_int(port) or not 1 <= port <= 65535:
            raise ServeError(f"{flag} {port} is not a TCP port; use 1..65535")
    ports = list(config.ports.values())
    if len(set(ports)) < len(ports):
        raise ServeError(
            f"HTTP, gRPC and metrics need three different ports, got {config.ports}; set "
            "--grpc-port / --metrics-port"
        )
    check_batching(config)
    if config.threads is not None and (not _is_int(config.threads) or config.threads < 1):
        raise ServeError(f"--threads must be an integer of at least 1, got {config.threads!r}")
    if config.model_name is not None and not _MODEL_NAME.match(config.model_name):
        raise ServeError(
            f"--model-name {config.model_name!r} is not a Triton model name: use letters, digits, "
            "'.', '_' and '-' only"
        )


def check_ports_free(host: str, ports: dict[str, int]) -> None:
    """ServeError naming the first port something on ``host`` already listens on, and its flag."""
    for flag, port in ports.items():
        try:
            family, kind, proto, _, address = socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM
            )[0]
        except socket.gaierror as err:
            raise ServeError(f"--host {host!r} is not an address of this machine ({err})") from None
        with socket.socket(family, kind, proto) as probe:
            # as Triton binds: SO_REUSEADDR, so a port left in TIME_WAIT by a stopped server is free
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as err:
                raise ServeError(
                    f"port {port} on {host} is not free ({err.strerror}); stop what listens there "
                    f"or choose another with {flag}"
                ) from None


# --- the Python that Triton's backend stub runs ------------------------------------------------
def _import_pytriton():
    return require("pytriton.triton", purpose="hydra-serve", error=ServeError).Triton


def _stub_versions() -> list[str]:
    stubs = Path(pytriton.__file__).parent / "tritonserver" / "python_backend_stubs"
    found = (
        [p.name for p in stubs.iterdir() if (p / "triton_python_backend_stub").is_file()]
        if stubs.is_dir()
        else []
    )
    return sorted(found, key=lambda v: tuple(int(part) for part in v.split(".") if part.isdigit()))


def check_python_supported() -> None:
    """ServeError unless PyTriton ships a Triton Python-backend stub for this Python."""
    _import_pytriton()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    shipped = _stub_versions()
    if version not in shipped:
        raise ServeError(
            f"PyTriton ships Triton Python-backend stubs for Python {', '.join(shipped) or 'none'}, "
            f"not for this Python {version}: run hydra-serve from a virtual environment of one of "
            "those versions"
        )


def prefer_own_libpython(environ: dict[str, str] | None = None) -> str | None:
    """Put this interpreter's libpython first on ``LD_LIBRARY_PATH`` (before Triton starts).

    Triton's Python-backend stub links ``libpythonX.Y.so.1.0`` and then imports the standard
    library of *this* interpreter (the model's environment). Resolved the usual way, the library
    can be another build of the same minor version (Debian's 3.11.2 beside pyenv's 3.11.7), whose
    C objects do not fit this stdlib: model load fails with ``AttributeError: '_thread.RLock' object
    has no attribute '_recursion_count'``. A shared build (``Py_ENABLE_SHARED``) has its own
    library in ``LIBDIR``; the stub then loads that one. Returns the folder put first, or None
    when this Python is not a shared build (the stub uses the system's library: warned, or a
    ServeError when there is none).
    """
    environ = os.environ if environ is None else environ
    soname = f"libpython{sys.version_info.major}.{sys.version_info.minor}.so.1.0"
    libdir = sysconfig.get_config_var("LIBDIR")
    if (
        sysconfig.get_config_var("Py_ENABLE_SHARED")
        and libdir
        and (Path(libdir) / soname).is_file()
    ):
        paths = [p for p in environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
        if not paths or paths[0] != libdir:
            environ["LD_LIBRARY_PATH"] = os.pathsep.join(
                [libdir, *(p for p in paths if p != libdir)]
            )
        return libdir
    found = ctypes.util.find_library(f"python{sys.version_info.major}.{sys.version_info.minor}")
    if not found:
        raise ServeError(
            f"Triton's Python backend needs {soname}, and this Python ({sys.executable}) is not a "
            "shared build and none is installed: install the system's shared library (Debian/"
            f"Ubuntu: apt install libpython{sys.version_info.major}.{sys.version_info.minor}) "
            "or use a Python built with --enable-shared (pyenv: "
            "PYTHON_CONFIGURE_OPTS=--enable-shared pyenv install ...)"
        )
    logger.warning(
        "this Python (%s) is not a shared build: Triton's Python backend will load the system's "
        "%s; if the model then fails to load (an AttributeError in threading), use a Python built "
        "with --enable-shared of the same version",
        sys.executable,
        found,
    )
    return None


# --- the model: tensors and the inference callable -------------------------------------------------
def _dims(shape: Sequence[Any]) -> tuple[int, ...]:
    return tuple(int(d) if isinstance(d, int) and d >= 0 else -1 for d in shape)


@dataclass(frozen=True)
class TensorInfo:
    """A served input or output: name, dims without the batch axis (-1: dynamic), numpy dtype."""

    name: str
    dims: tuple[int, ...]
    dtype: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dims": list(self.dims), "dtype": self.dtype}


def decision_outputs(record: Any) -> list[str]:
    """The :data:`DECISION_OUTPUTS` a decisions record answers (none for None)."""
    return [] if record is None else [n for n in record.fields if n in DECISION_OUTPUTS]


def model_tensors(runner: Runner) -> tuple[list[TensorInfo], list[TensorInfo]]:
    """The served inputs (the runner's) and outputs (``OUTPUT_NAMES``, and the
    :data:`DECISION_OUTPUTS` of ``runner.decisions``) of a Hydra runner."""
    logits = next((t for t in runner.outputs if t.name == "member_logits"), None)
    if logits is None or logits.rank != 3:
        raise ServeError(
            f"{runner.path} has no member_logits output [batch, M, C] (outputs: "
            f"{[t.describe() for t in runner.outputs]}); is it a Hydra export (hydra-export)?"
        )
    inputs = []
    for spec in runner.inputs:
        if spec.dtype == "bfloat16" or spec.rank < 1:
            raise ServeError(
                f"input {spec.describe()} of {runner.path} cannot be served: inputs need a batch "
                "axis and a numpy dtype (hydra-export keeps them float32 / int64)"
            )
        inputs.append(TensorInfo(spec.name, _dims(spec.shape[1:]), spec.dtype))
    members, classes = _dims(logits.shape[1:])
    outputs = [
        TensorInfo("member_logits", (members, classes), "float32"),
        TensorInfo("probs", (classes,), "float32"),
        *(TensorInfo(name, (1,), "float32") for name in SCALAR_OUTPUTS),
        TensorInfo("prediction", (1,), "int64"),
    ]
    for name in decision_outputs(getattr(runner, "decisions", None)):
        dims, dtype = DECISION_OUTPUTS[name]
        shape = tuple(classes if d == "classes" else d for d in dims)
        outputs.append(TensorInfo(name, shape, dtype))
    return inputs, outputs


def score_batch(runner: Runner, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What the server answers for a batch: member logits, probs and scores, and the decisions
    when the runner holds them, shaped as served."""
    scores = scoring.score_batch(runner, inputs)
    answer = {
        "member_logits": np.ascontiguousarray(scores["member_logits"], dtype=np.float32),
        "probs": scores["probs"].astype(np.float32),
    }
    for name in SCALAR_OUTPUTS:
        answer[name] = scores[name].astype(np.float32)[:, None]  # [batch, 1]: dims [1]
    answer["prediction"] = scores["prediction"].astype(np.int64)[:, None]
    for name in decision_outputs(getattr(runner, "decisions", None)):
        dims, dtype = DECISION_OUTPUTS[name]
        value = np.asarray(scores[name], dtype=dtype)
        answer[name] = value if dims == ("classes",) else value[:, None]  # per example: [batch, 1]
    return answer


def _bad_requests(runner: Runner, requests: Sequence[Any]) -> list[tuple[int, str]]:
    """(index, message) of the requests whose inputs the runner refuses on their own."""
    bad = []
    for index, request in enumerate(requests):
        try:
            runner.check_inputs({name: request[name] for name in request})
        except RunnerError as err:
            bad.append((index, str(err)))
    return bad


def make_infer_func(runner: Runner) -> Callable[[list], list]:
    """The inference callable of one model instance: Triton requests in, responses out."""

    @pytriton_decorators.batch
    def infer_batch(**inputs: np.ndarray) -> dict[str, np.ndarray]:
        return score_batch(runner, inputs)

    def infer(requests: list) -> list:
        try:
            return infer_batch(requests)
        except HydraError:
            # the error reaches every client of this batch (Triton fails a batch as a whole);
            # when several requests were batched, say which of them the runner refuses
            if len(requests) < 2:
                raise
            bad = _bad_requests(runner, requests)
            if not bad:
                raise
            which = ", ".join(str(i + 1) for i, _ in bad)
            raise RunnerError(
                f"request(s) {which} of the {len(requests)} requests batched together are refused "
                f"(the others fail with them: send them again): {bad[0][1]}"
            ) from None

    return infer


def _describe_decisions(record: Any) -> dict[str, Any] | None:
    """The served decisions in short (``describe()["decisions"]``): T and each rule's targets."""
    if record is None:
        return None
    found: dict[str, Any] = {"temperature": record.temperature}
    if record.sets is not None:
        found["sets"] = {"method": record.sets.method, "alpha": record.sets.alpha}
    if record.selective is not None:
        rule = record.selective
        found["selective"] = {
            "score": rule.score,
            "target_risk": rule.target_risk,
            "delta": rule.delta,
            "tau": rule.tau,
        }
    if record.ood is not None:
        found["ood"] = {"score": record.ood.score, "alpha": record.ood.alpha}
    return found


# --- the server -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Batching:
    """The dynamic batcher's settings: max batch, preferred sizes, and the export's own limit."""

    max_batch: int
    preferred: list[int]
    profile_max: int | None


def resolve_batching(config: ServeConfig, runner: Runner) -> Batching:
    """Max and preferred batch sizes: the config's, checked against the export's profile."""
    export = getattr(runner, "export_info", None)  # the checked hydra.json, if loaded from one
    profile_opt = export.batch_profile[1] if export and export.batch_profile else None
    profile_max = runner.max_batch
    source = getattr(runner, "batch_source", None) or f"{INFO_FILE} batch_profile"
    if config.max_batch is None:
        max_batch = profile_max or 32
    elif profile_max is not None and config.max_batch > profile_max:
        raise ServeError(
            f"--max-batch {config.max_batch} is above the export's maximum batch {profile_max} "
            f"({source}); use at most {profile_max}, or re-export with a larger batch profile "
            "(hydra-export --batch MIN OPT MAX)"
        )
    else:
        max_batch = config.max_batch
    if config.preferred_batch is None:
        wanted = [b for b in (profile_opt, max_batch) if _is_int(b) and 1 <= b <= max_batch]
    else:
        wanted = [int(b) for b in config.preferred_batch]
        above = [b for b in wanted if b > max_batch]
        if above:
            raise ServeError(
                f"--preferred-batch {' '.join(map(str, above))} is above the max batch {max_batch}; "
                f"use sizes of at most {max_batch} (or raise --max-batch)"
            )
    return Batching(max_batch, sorted(set(wanted)), profile_max)


def _endpoints(host: str, ports: dict[str, int]) -> dict[str, str]:
    shown = f"[{host}]" if ":" in host else host
    return {
        "http": f"http://{shown}:{ports['--port']}",
        "grpc": f"{shown}:{ports['--grpc-port']}",
        "metrics": f"http://{shown}:{ports['--metrics-port']}/metrics",
    }


#: Triton APIs PyTriton (>= 0.7) guards with an access token that only this process knows: model
#: loading, shared memory, tracing and log settings. Statistics stay open to every client: they
#: are read-only, the /metrics endpoint serves the same counts, and a load test reads the batch
#: sizes the dynamic batcher formed from them.
RESTRICTED_APIS = ("shared-memory", "model-repository", "trace", "logging")


def _security_kwargs() -> dict[str, Any]:
    try:
        from pytriton.triton import TritonSecurityConfig
    except ImportError:  # PyTriton < 0.7 restricts nothing
        return {}
    return {"security_config": TritonSecurityConfig(restricted_endpoints=list(RESTRICTED_APIS))}


#: PyTriton (0.7) instances other than the first read their configuration from a Unix socket the
#: first one opens; they look once, 1 s at most, and with instances started in parallel on a busy
#: machine they can come too early ("Connection refused" / "Timeout occurred while waiting for
#: config file"): the model load fails. Triton is then restarted, this many starts in all.
START_ATTEMPTS = 3


def _handshake_race(err: BaseException) -> bool:
    text = str(err)
    return "handshake" in text or "config.sock" in text or "waiting for config file" in text


def one_line(text: str, limit: int = 600) -> str:
    """A multi-line error (Triton passes tracebacks on) as one line: its first line and, when it
    holds a traceback, the exception that ended it (``ConnectionRefusedError: ...``)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return ""
    found = [line for line in lines[1:] if re.match(r"^[\w.]+(Error|Exception|Exit)\b.*:", line)]
    summary = lines[0] if not found or found[-1] == lines[0] else f"{lines[0]} ... {found[-1]}"
    return summary if len(summary) <= limit else summary[: limit - 3] + "..."


class HydraServer:
    """One export served by a local Triton server (see the module docstring).

    Making one checks the settings, loads one runner per instance and checks the ports are free;
    :meth:`start` starts Triton and waits until the model is ready; :meth:`serve_forever` blocks
    until SIGINT/SIGTERM (or the server's death: ServeError); :meth:`stop` stops Triton and frees
    the runners. A ``with`` block starts and stops it.
    """

    def __init__(self, config: ServeConfig) -> None:
        check_config(config)
        check_ports_free(config.host, config.ports)
        check_python_supported()
        self.config = config
        self.path = Path(config.export_dir)
        threads = config.threads
        if threads is None and config.instances > 1:  # instances share the cores, not each all
            threads = max(1, (os.cpu_count() or 1) // config.instances)
        self.threads = threads
        providers = list(config.providers) if config.providers else None
        self.runners = [
            load_runner(
                self.path,
                providers=providers,
                threads=threads,
                decisions=config.decisions,
                allow_decisions_mismatch=config.allow_decisions_mismatch,
            )
            for _ in range(config.instances)
        ]
        runner = self.runners[0]
        self.inputs, self.outputs = model_tensors(runner)
        self.batching = resolve_batching(config, runner)
        self.model_name = config.model_name or default_model_name(self.path)
        self.ports = config.ports
        self.endpoints = _endpoints(config.host, self.ports)
        self._triton: Any = None
        self._signal: int | None = None

    # --- what is served ------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """The served model, its endpoints and settings (what ``hydra-serve --json`` prints)."""
        runner = self.runners[0]
        return {
            "model": self.model_name,
            "export": str(self.path),
            "family": runner.family,
            "class_names": runner.class_names,
            "endpoints": self.endpoints,
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
            "decisions": _describe_decisions(runner.decisions),
            "max_batch": self.batching.max_batch,
            "preferred_batch": self.batching.preferred,
            "queue_delay_us": self.config.queue_delay_us,
            "instances": self.config.instances,
            "threads": self.threads,
            "backend": runner.backend,
            "providers": list(runner.providers),
            "pid": os.getpid(),
        }

    # --- running -------------------------------------------------------------------------------
    def _triton_config(self):
        host = self.config.host
        return pytriton_triton.TritonConfig(
            http_address=host,
            http_port=self.ports["--port"],
            grpc_address=host,
            grpc_port=self.ports["--grpc-port"],
            metrics_address=host,
            metrics_port=self.ports["--metrics-port"],
            exit_timeout_secs=int(self.config.exit_timeout_s),
            log_verbose=0,
        )

    def _bind(self, triton: Any) -> None:
        Tensor, ModelConfig = pytriton_model_config.Tensor, pytriton_model_config.ModelConfig
        DynamicBatcher = pytriton_model_config.DynamicBatcher

        def tensors(infos: list[TensorInfo]) -> list[Any]:
            return [Tensor(name=t.name, dtype=np.dtype(t.dtype).type, shape=t.dims) for t in infos]

        triton.bind(
            model_name=self.model_name,
            infer_func=[make_infer_func(runner) for runner in self.runners],
            inputs=tensors(self.inputs),
            outputs=tensors(self.outputs),
            config=ModelConfig(
                max_batch_size=self.batching.max_batch,
                batcher=DynamicBatcher(
                    preferred_batch_size=self.batching.preferred,
                    max_queue_delay_microseconds=self.config.queue_delay_us,
                ),
            ),
            strict=True,  # outputs checked against the declared dims and dtypes
        )

    def start(self) -> None:
        """Start Triton and load the model; returns when it is ready (ServeError if it fails)."""
        if self._triton is not None:
            return
        Triton = _import_pytriton()
        prefer_own_libpython()  # before Triton's process (and its backend stub) starts
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                self._triton = Triton(config=self._triton_config(), **_security_kwargs())
                self._bind(self._triton)
                self._triton.run()
                return
            except HydraError:
                self.stop()
                raise
            except Exception as err:  # PyTriton / tritonclient errors, TimeoutError
                self.stop()
                if attempt < START_ATTEMPTS and self.config.instances > 1 and _handshake_race(err):
                    logger.warning(
                        "a model instance missed PyTriton's configuration handshake (a race of "
                        "PyTriton's when instances start in parallel); restarting Triton "
                        "(attempt %d of %d)",
                        attempt + 1,
                        START_ATTEMPTS,
                    )
                    continue
                raise ServeError(
                    f"Triton did not start serving {self.model_name!r}: {type(err).__name__}: "
                    f"{one_line(str(err))}"
                ) from err

    def serve_forever(self) -> None:
        """Block until SIGINT or SIGTERM, then stop; ServeError when Triton dies on its own."""
        self.start()
        previous: dict[int, Any] = {}
        with contextlib.suppress(ValueError):  # handlers can only be set in the main thread
            for signum in (signal.SIGINT, signal.SIGTERM):
                previous[signum] = signal.signal(signum, self._on_signal)
        try:
            self._triton.serve()  # PyTriton stops Triton on KeyboardInterrupt, or Triton died
        except KeyboardInterrupt:  # a signal outside PyTriton's own try
            pass
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self.stop()
        if self._signal is None:
            raise ServeError(
                f"the Triton server serving {self.model_name!r} exited on its own; see its log "
                "(hydra-serve prints it on stderr unless --quiet)"
            )

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._signal = signum
        raise KeyboardInterrupt  # what PyTriton's serve() stops on

    def stop(self) -> None:
        """Stop Triton (in-flight requests get ``exit_timeout_s``) and free the runners."""
        triton, self._triton = self._triton, None
        if triton is not None:
            try:
                triton.stop()
            except Exception as err:  # stopping is best effort; the process is going anyway
                logger.warning("stopping Triton: %s", err)

    def close(self) -> None:
        self.stop()
        for runner in self.runners:
            runner.close()

    def __enter__(self) -> HydraServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(config: ServeConfig, on_ready: Callable[[HydraServer], None] | None = None) -> None:
    """Serve ``config`` until SIGINT/SIGTERM; ``on_ready(server)`` is called once it is ready."""
    server = HydraServer(config)
    try:
        server.start()
        if on_ready is not None:
            on_ready(server)
        server.serve_forever()
    finally:
        server.close()


__all__ = [
    "DECISION_OUTPUTS",
    "EXIT_TIMEOUT_S",
    "OUTPUT_NAMES",
    "RESTRICTED_APIS",
    "START_ATTEMPTS",
    "Batching",
    "HydraServer",
    "ServeConfig",
    "TensorInfo",
    "check_config",
    "check_ports_free",
    "check_python_supported",
    "decision_outputs",
    "default_model_name",
    "make_infer_func",
    "model_tensors",
    "one_line",
    "prefer_own_libpython",
    "resolve_batching",
    "sanitize_model_name",
    "score_batch",
    "serve",
]
