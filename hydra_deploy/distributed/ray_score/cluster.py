"""Ray: importing it, connecting to a cluster (or starting a local one), keeping its console
output in its place, Ray Data's settings of a run, and the errors its actors raise.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hydra_deploy import errors
from hydra_deploy.errors import HydraError, ServeError
from hydra_deploy.optional import lazy_module, require

ray_data = lazy_module("ray.data", purpose="hydra-score-dataset", error=ServeError)

logger = logging.getLogger("hydra_deploy")


OBJECT_STORE_BYTES = 256 * 1024**2  # local cluster: only paths, texts and scores travel
CONNECT_TIMEOUT_S = 5.0

_UDF_SUFFIX = "\nFailed to apply UDF transform"  # what Ray Data appends to a UDF's message


def _pyarrow_numpy_hint(err: BaseException) -> str | None:
    if "numpy" in str(err).lower():
        return "pyarrow 26 and later need NumPy 2; with numpy<2 install 'pyarrow>=17,<26'"
    return None


def _import_ray():
    purpose = "hydra-score-dataset"
    # pyarrow first: Ray Data needs it, and its ImportError is the clearer one
    require("pyarrow", purpose=purpose, error=ServeError, extra_hint=_pyarrow_numpy_hint)
    require("ray.data", purpose=purpose, error=ServeError)
    return require("ray", purpose=purpose, error=ServeError)


def check_address(address: str) -> None:
    """ServeError unless ``address`` ('auto', HOST:PORT or ray://HOST:PORT) answers within
    seconds; Ray itself waits minutes for a cluster that is not there."""
    if address == "auto":
        return
    target = address[len("ray://") :] if address.startswith("ray://") else address
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit() or "/" in target:
        raise ServeError(
            f"--address {address!r} is not 'auto', HOST:PORT (a head's GCS, port 6379 by default) "
            "or ray://HOST:PORT (Ray Client, port 10001 by default)"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as err:
        raise ServeError(
            f"cannot connect to the Ray cluster at {address}: {err.strerror or err}; is a head "
            "running there (ray start --head) and the port open? Omit --address to start a "
            "local cluster on this machine"
        ) from err


@dataclass
class RaySession:
    """The Ray connection a run uses: whether this run started it, its CPUs and start time."""

    address: str
    started: bool
    cpus: int
    start_seconds: float


@contextlib.contextmanager
def _ray_console(quiet: bool, debug: bool) -> Iterator[None]:
    """Keep Ray's console output where it belongs while Ray runs in this process.

    Always: ``sys.stdout`` goes to stderr, because Ray's driver prints the errors its raylets
    report (``(raylet) Task ... failed``) on stdout, where they would mix with ``--json``. Under
    ``quiet`` (not ``debug``): Ray's Python console handlers go to CRITICAL (the session log files
    keep everything), and file descriptor 2 to a temporary file, because Ray's C++ core worker
    writes straight to it (e.g. the "constructor arguments in the object store" line that every
    Ray Data actor pool logs, ray-project/ray#57733). Our own errors are printed afterwards."""
    with contextlib.redirect_stdout(sys.stderr):
        if not quiet or debug:
            yield
            return
        handlers = [
            h
            for name in ("ray", "ray.data")
            for h in logging.getLogger(name).handlers
            if type(h) is not logging.FileHandler and isinstance(h, logging.StreamHandler)
        ]
        levels = [h.level for h in handlers]
        for handler in handlers:
            handler.setLevel(logging.CRITICAL)
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            with tempfile.TemporaryFile() as sink:
                os.dup2(sink.fileno(), 2)
                try:
                    yield
                finally:
                    sys.stderr.flush()
                    os.dup2(saved, 2)
        finally:
            os.close(saved)
            for handler, level in zip(handlers, levels, strict=True):
                handler.setLevel(level)


@contextlib.contextmanager
def ray_session(
    address: str | None = None,
    num_cpus: int | None = None,
    *,
    quiet: bool = False,
    debug: bool = False,
) -> Iterator[RaySession]:
    """Connect to Ray: a new local cluster (``address`` None; ``num_cpus``: default all of this
    machine's), or the cluster at ``address`` ('auto', HOST:PORT, ray://HOST:PORT). A process
    already connected (``ray.init`` in a notebook) keeps its connection. A cluster started here
    is shut down on exit."""
    ray = _import_ray()
    if address is not None:
        if num_cpus is not None:
            raise ServeError(
                "--num-cpus sizes a local cluster; a cluster joined with --address has its own CPUs"
            )
        check_address(address)
    started = False
    begin = time.perf_counter()
    with _ray_console(quiet, debug):
        if ray.is_initialized():
            where = "the Ray cluster this process is connected to"
        else:
            kwargs: dict[str, Any] = dict(
                include_dashboard=False,
                log_to_driver=debug,
                logging_level=logging.DEBUG if debug else logging.ERROR,
            )
            try:
                if address is None:
                    ray.init(
                        address="local",
                        num_cpus=num_cpus or os.cpu_count() or 1,
                        object_store_memory=OBJECT_STORE_BYTES,
                        **kwargs,
                    )
                    where = "a local Ray cluster"
                else:
                    ray.init(address=address, **kwargs)
                    where = f"the Ray cluster at {address}"
            except (ConnectionError, RuntimeError, ValueError, SystemExit) as err:
                raise _connect_error(address, err) from err
            started = True
        try:
            cpus = int(ray.cluster_resources().get("CPU", 0))
            session = RaySession(address or "local", started, cpus, time.perf_counter() - begin)
            logger.info(
                "%s %s (%d CPUs) in %.1f s",
                "started" if started and address is None else "connected to",
                where,
                cpus,
                session.start_seconds,
            )
            yield session
        finally:
            if started:
                ray.shutdown()


def _connect_error(address: str | None, err: BaseException) -> ServeError:
    """Why ray.init failed, in one line, with the fix (token authentication: Ray >= 2.59)."""
    chain, current = [], err
    while current is not None and len(chain) < 8:
        chain.append(f"{type(current).__name__}: {current}")
        current = current.__cause__ or current.__context__
    if any("AuthToken" in c or "AuthenticationError" in c for c in chain):
        fix = (
            "the cluster uses token authentication: set RAY_AUTH_MODE=token here, with the "
            "cluster's token in ~/.ray/auth_token or RAY_AUTH_TOKEN (ray get-auth-token on the "
            "head prints it)"
        )
    else:
        fix = "start one with ray start --head, or omit --address to start a local cluster"
    return ServeError(
        f"cannot connect to the Ray cluster at {address or 'local'}: "
        f"{str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}; {fix}"
    )


#: Ray Data's logger that says, once, that its progress bars are off (they are, in a log)
_RAY_PROGRESS_LOGGER = "ray.data._internal.progress"


def ray_bars_shown(progress: bool) -> bool:
    """Whether a run shows Ray Data's own progress bars: when asked (``progress``: not --quiet)
    and stderr is a terminal (Ray Data looks at stdout, which the run sends to stderr). In a log
    Ray Data would write a block of seven lines every 10 s instead; the run writes one line of
    its own every 30 s there (:mod:`hydra_deploy.progress`)."""
    try:
        return progress and sys.stderr.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stderr
        return False


@contextlib.contextmanager
def _data_context(progress: bool) -> Iterator[Any]:
    """Ray Data settings of a run (restored afterwards): its progress bars in a terminal when
    asked (:func:`ray_bars_shown`), and a UDF's own exception raised rather than wrapped in
    UserCodeException."""
    context = ray_data.DataContext.get_current()
    bars = ray_bars_shown(progress)
    wanted = {
        "enable_progress_bars": bars,
        "print_on_execution_start": progress,
        "raise_original_map_exception": True,
    }
    saved = {k: getattr(context, k) for k in wanted if hasattr(context, k)}
    for key in saved:
        setattr(context, key, wanted[key])
    says_off = logging.getLogger(_RAY_PROGRESS_LOGGER)  # "Progress bars disabled. To enable..."
    level = says_off.level
    if not bars:
        says_off.setLevel(logging.ERROR)
    try:
        yield context
    finally:
        says_off.setLevel(level)
        for key, value in saved.items():
            setattr(context, key, value)


def unwrap_ray_error(err: BaseException) -> HydraError:
    """The error a Ray actor raised, as one line: the HydraError inside a RayTaskError /
    UserCodeException (Ray Data appends its retry advice; cut), else the innermost cause."""
    try:
        from ray.exceptions import RayError
    except ImportError:  # pragma: no cover - ray is there when its errors are
        RayError = ()  # type: ignore[assignment]
    seen: set[int] = set()
    current: BaseException | None = err
    innermost = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, HydraError) and not isinstance(current, RayError):
            message = str(current).split(_UDF_SUFFIX, 1)[0].strip()
            return type(current)(message)
        innermost = current
        current = getattr(current, "cause", None) or current.__cause__
    text = str(err)
    found = re.findall(r"^hydra_deploy\.errors\.(\w+): (.+)$", text, flags=re.MULTILINE)
    if found:  # a Ray that lost the cause object still prints its traceback
        name, message = found[-1]
        kind = getattr(errors, name, HydraError)
        return (kind if isinstance(kind, type) and issubclass(kind, HydraError) else HydraError)(
            message
        )
    lines = [line for line in str(innermost).split(_UDF_SUFFIX, 1)[0].splitlines() if line.strip()]
    detail = lines[-1].strip() if lines else type(innermost).__name__
    return ServeError(
        f"a scoring actor failed: {type(innermost).__name__}: {detail[:300]} (rerun with --debug "
        "for Ray's traceback; the actors' logs are in /tmp/ray/session_latest/logs)"
    )
