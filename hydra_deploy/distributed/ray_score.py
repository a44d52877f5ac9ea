"""Score a data set of images or text lines on a Ray cluster; write resumable Parquet parts.

``score_dataset(export_dir, inputs, out)`` is what ``hydra-score-dataset`` runs:

1. **Items.** The inputs become one ordered list of items: image files and folders (searched
   recursively, sorted, as ``hydra-run`` finds them) for vision exports; for text (BERT) exports,
   the non-empty lines of ``.txt`` files, labelled ``file:line`` like ``hydra-run``'s. The list is
   cut into **shards** of ``shard_size`` consecutive items, across file boundaries (one rule for
   images and text: a shard may hold the end of one .txt file and the start of the next).
2. **Manifest.** ``OUT/_hydra_manifest.json`` records the model (sha256 of ``model.onnx``), the
   items (a sha256 over labels and absolute paths / texts, and one per shard), the shard size, the
   columns and the package version. It is written first, atomically; ``--resume`` compares it.
3. **Scoring.** The pending shards become a Ray Dataset, one block per shard
   (``ray.data.from_arrow``). ``map_batches`` runs :class:`HydraScorer` in a fixed pool of
   ``actors`` actors (``compute=ray.data.ActorPoolStrategy(size=actors)``; ``concurrency=`` is
   deprecated in Ray 2.60), each reserving ``threads`` CPUs. Every actor builds one runner (one
   ONNX Runtime session with ``threads`` intra-op threads) in ``__init__``, and per batch reads
   and preprocesses its images (or tokenizes its text) itself, runs the model and computes
   :func:`~hydra_deploy.uncertainty.ensemble_scores`. The driver only ships paths and texts.
4. **Parts.** The driver streams the results (``iter_batches``), groups them by shard and, once a
   shard is complete, writes ``OUT/part-<shard:05d>.parquet`` in input order, atomically (temporary
   name in OUT, then ``os.replace``): a part file exists only when complete.

``pyarrow.parquet.read_table(OUT)`` and ``pandas.read_parquet(OUT)`` read OUT as one table in input
order (parts sort by name; ``_``- and ``.``-prefixed files are ignored). Columns: ``item``,
``shard``, ``prediction`` (int64), ``label`` (class name, null without class names), ``msp``,
``predictive_entropy``, ``expected_entropy``, ``mutual_information``, ``disagreement`` (float32),
``probs`` (list<float32>) and, with ``member_logits=True``, ``member_logits``
(list<list<float32>>, [members][classes]).

Clusters: ``address`` None starts a local cluster for the run (shut down afterwards); 'auto' or
HOST:PORT joins a running one from a driver on one of its nodes; ray://HOST:PORT (Ray Client) runs
the whole of this function as one task on the cluster (Ray Data's executor does not run in a Ray
Client driver), with the paths made absolute here (so ``item`` holds absolute paths). Every node
needs hydra-deploy[ray] with onnxruntime and pillow (tokenizers for text), and the export folder,
the inputs and OUT at the same paths (a shared file system).

Resume: an existing OUT is refused unless ``resume`` or ``overwrite``. ``resume`` needs a matching
manifest (same model, items, shard size and columns; batch size, actors and threads may change),
keeps finished parts untouched and scores only the missing shards; temporary files of a crashed
run are removed. Errors (an undecodable image, a failing actor) stop the run; the parts finished
before stay valid, and ``resume`` continues from them once the cause is fixed.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import math
import os
import re
import socket
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hydra_deploy.errors import HydraError, RunnerError, ServeError
from hydra_deploy.optional import require
from hydra_deploy.uncertainty.scores import SCALAR_SCORES

logger = logging.getLogger("hydra_deploy")

MANIFEST = "_hydra_manifest.json"
MANIFEST_FORMAT = "hydra-score-dataset/1"
DEFAULT_SHARD_SIZE = 256
DEFAULT_BATCH_SIZE = 32  # an export without a batch profile
OBJECT_STORE_BYTES = 256 * 1024**2  # local cluster: only paths, texts and scores travel
CONNECT_TIMEOUT_S = 5.0
#: Test hook: seconds each actor sleeps after every batch (so that a test can kill a run midway).
TEST_DELAY_ENV = "HYDRA_SCORE_DATASET_TEST_DELAY_S"
SCALAR_COLUMNS = SCALAR_SCORES

_PART_RE = re.compile(r"^part-(\d{5,})\.parquet$")
_TEMP_RE = re.compile(r"^\.(part-\d{5,}\.parquet|" + re.escape(MANIFEST) + r")\..*\.tmp$")
_UDF_SUFFIX = "\nFailed to apply UDF transform"  # what Ray Data appends to a UDF's message


def part_name(shard: int) -> str:
    """The Parquet file of shard ``shard`` in OUT: ``part-00007.parquet``."""
    return f"part-{shard:05d}.parquet"


def columns_for(member_logits: bool) -> list[str]:
    """The columns of every part, in order."""
    names = ["item", "shard", "prediction", "label", *SCALAR_COLUMNS, "probs"]
    return names + (["member_logits"] if member_logits else [])


# --- the export, as the driver sees it (hydra.json only: the driver opens no session) -----------
@dataclass(frozen=True)
class DriverExport:
    """What the driver needs of an export folder: read from hydra.json, model.onnx hashed."""

    path: Path
    onnx_sha256: str
    family: str
    class_names: list[str] | None
    batch_opt: int | None
    batch_max: int | None
    has_preprocessing: bool

    @classmethod
    def read(cls, export_dir: str | os.PathLike) -> DriverExport:
        from hydra_deploy.export_folder import MODEL_FILE, file_sha256, read_info

        folder = Path(export_dir)
        if not folder.exists():
            raise RunnerError(
                f"the export folder {str(folder)!r} does not exist; give a folder written by "
                "hydra-export --out"
            )
        onnx_path = folder / MODEL_FILE
        if not folder.is_dir() or not onnx_path.is_file():
            raise RunnerError(
                f"{str(folder)!r} is not an export folder: {MODEL_FILE} is missing (make one with "
                "hydra-export --out DIR)"
            )
        info = read_info(folder)  # preprocessing, batch profile, class names: the one reader
        try:
            digest = file_sha256(onnx_path)
        except OSError as err:
            raise RunnerError(f"cannot read {onnx_path}: {err}") from err
        profile = info.batch_profile
        return cls(
            path=folder.absolute(),
            onnx_sha256=digest,
            family=info.family or "vit",
            class_names=None if info.class_names is None else list(info.class_names),
            batch_opt=None if profile is None else profile[1],
            batch_max=None if profile is None else profile[2],
            has_preprocessing=bool(info.record.get("preprocessing")),
        )

    @property
    def kind(self) -> str:
        """``"text"`` or ``"images"``: what the export's family takes."""
        from hydra_deploy.families import get_family

        return get_family(self.family).input_kind

    def default_batch_size(self) -> int:
        """The batch profile's opt, capped at its max (no profile: 32)."""
        size = self.batch_opt or self.batch_max or DEFAULT_BATCH_SIZE
        return min(size, self.batch_max) if self.batch_max else size


# --- items and shards -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shard:
    """``shard_size`` consecutive items: their labels (the ``item`` column) and what the actors
    read (absolute image paths, or the text lines)."""

    index: int
    labels: tuple[str, ...]
    sources: tuple[str, ...]

    @property
    def part(self) -> str:
        return part_name(self.index)

    @property
    def sha256(self) -> str:
        return _digest(self.labels, self.sources)

    def summary(self) -> dict[str, Any]:
        return {
            "part": self.part,
            "items": len(self.labels),
            "first": self.labels[0],
            "last": self.labels[-1],
            "sha256": self.sha256,
        }


def _digest(labels: Sequence[str], sources: Sequence[str]) -> str:
    digest = hashlib.sha256()
    for label, source in zip(labels, sources, strict=True):
        digest.update(f"{label}\t{source}\n".encode())
    return digest.hexdigest()


def collect_items(family: str, inputs: Sequence[str | os.PathLike]) -> tuple[list[str], list[str]]:
    """The INPUT arguments -> (labels, sources) in input order, read as hydra-run reads them
    (:func:`hydra_deploy.engines.sources.read_source`), arrays refused. ``family`` is the
    export's; sources are absolute image paths (image models) or the lines of ``.txt`` files."""
    from hydra_deploy.engines.sources import IMAGES, read_sources
    from hydra_deploy.families import get_family

    if not inputs:
        raise RunnerError(
            "no INPUTS given: give image files or folders (or .txt files for text models)"
        )
    labels: list[str] = []
    sources: list[str] = []
    for source in read_sources(
        inputs,
        get_family(family),
        model="EXPORT_DIR",
        arrays_elsewhere="hydra-score-dataset reads image files and folders (and .txt files "
        "for text models); score preprocessed .npy/.npz arrays with hydra-run",
    ):
        labels += source.names
        if source.kind == IMAGES:
            sources += [os.path.abspath(path) for path in source.items]
        else:
            sources += list(source.items)
    return labels, sources


def plan_shards(labels: Sequence[str], sources: Sequence[str], shard_size: int) -> list[Shard]:
    """Consecutive chunks of ``shard_size`` items (the last one may be shorter)."""
    return [
        Shard(
            index,
            tuple(labels[start : start + shard_size]),
            tuple(sources[start : start + shard_size]),
        )
        for index, start in enumerate(range(0, len(labels), shard_size))
    ]


# --- the manifest --------------------------------------------------------------------------------
@dataclass
class Manifest:
    """``OUT/_hydra_manifest.json``: what OUT holds (or will hold once every part is written)."""

    export: str
    onnx_sha256: str
    kind: str
    inputs: list[str]
    items: int
    items_sha256: str
    shard_size: int
    shards: list[dict[str, Any]]
    columns: list[str]
    member_logits: bool
    batch_size: int
    class_names: list[str] | None = None
    package_version: str = ""
    created: str = ""
    format: str = MANIFEST_FORMAT

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def read(cls, path: Path) -> Manifest:
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"not a {MANIFEST_FORMAT} manifest")
            return cls.from_dict(data)
        except (OSError, ValueError, TypeError) as err:
            raise ServeError(
                f"cannot read {path} ({err}); pass --overwrite to start OUT over"
            ) from err

    def differences(self, other: Manifest) -> list[str]:
        """What differs between this (OUT's) manifest and ``other`` (this run's), in words."""
        found = []
        if self.onnx_sha256 != other.onnx_sha256:
            found.append(
                f"the model differs (model.onnx sha256 {self.onnx_sha256[:12]}... in "
                f"OUT, {other.onnx_sha256[:12]}... now, {other.export})"
            )
        if self.kind != other.kind:
            found.append(f"the inputs are {other.kind}, OUT holds {self.kind}")
        elif self.items_sha256 != other.items_sha256:
            where = ""
            for mine, theirs in zip(self.shards, other.shards, strict=False):
                if mine.get("sha256") != theirs.get("sha256"):
                    where = f"; the first difference is in shard {theirs['part']}"
                    break
            found.append(f"the inputs differ ({self.items} items in OUT, {other.items} now{where})")
        if self.shard_size != other.shard_size:
            found.append(
                f"the shard size differs ({self.shard_size} in OUT, {other.shard_size} now)"
            )
        if self.columns != other.columns:
            found.append(
                f"the columns differ ({'with' if self.member_logits else 'without'} "
                f"--member-logits in OUT, {'with' if other.member_logits else 'without'} now)"
            )
        return found


# --- the output folder ---------------------------------------------------------------------------
@dataclass
class OutState:
    """What is in OUT before a run: finished shards, files to clean up."""

    done: set[int] = field(default_factory=set)
    remove: list[Path] = field(default_factory=list)  # ours, removed before scoring starts
    keep_manifest: bool = False


def _ours(name: str) -> bool:
    return name == MANIFEST or bool(_PART_RE.match(name)) or bool(_TEMP_RE.match(name))


def inspect_out(
    out: Path, manifest: Manifest, shards: Sequence[Shard], *, resume: bool, overwrite: bool
) -> OutState:
    """Check OUT against this run and the flags; nothing is changed yet (see :func:`prepare_out`)."""
    if resume and overwrite:
        raise ServeError("--resume and --overwrite exclude each other: pick one")
    if not out.exists():
        return OutState()
    if not out.is_dir():
        if overwrite:
            return OutState(remove=[out])
        raise ServeError(f"{str(out)!r} exists and is a file; pass --overwrite to replace it")
    names = sorted(p.name for p in out.iterdir())
    if not names:
        return OutState()
    foreign = [n for n in names if not _ours(n)]
    if foreign:
        shown = ", ".join(foreign[:3]) + (
            f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        )
        raise ServeError(
            f"{str(out)!r} holds files hydra-score-dataset did not write ({shown}); choose another "
            "--out (nothing was changed)"
        )
    temps = [out / n for n in names if _TEMP_RE.match(n)]
    parts = {int(m.group(1)): out / n for n in names if (m := _PART_RE.match(n))}
    if overwrite:
        return OutState(remove=[out / n for n in names])
    if not resume:
        raise ServeError(
            f"{str(out)!r} exists; pass --resume to score only its missing shards, or --overwrite "
            "to start over"
        )
    if MANIFEST not in names:
        raise ServeError(
            f"{str(out)!r} has no {MANIFEST}, so it cannot be resumed; pass --overwrite to start over"
        )
    previous = Manifest.read(out / MANIFEST)
    differences = previous.differences(manifest)
    if differences:
        raise ServeError(
            f"cannot resume {str(out)!r}: " + "; ".join(differences) + ". Pass --overwrite to "
            "score everything again into it, or choose another --out"
        )
    done = set()
    for index, path in sorted(parts.items()):
        if index >= len(shards):
            raise ServeError(
                f"{path} is not one of the {len(shards)} shards of the manifest; remove it and rerun with --resume"
            )
        rows = _parquet_rows(path)
        if rows != len(shards[index].labels):
            raise ServeError(
                f"{path} holds {rows} rows, its shard {len(shards[index].labels)}: it is not a "
                "part this run wrote; remove it and rerun with --resume"
            )
        done.add(index)
    return OutState(done=done, remove=temps, keep_manifest=True)


def _parquet_rows(path: Path) -> int:
    import pyarrow.parquet as pq

    try:
        return pq.read_metadata(path).num_rows
    except Exception as err:  # pyarrow raises ArrowInvalid / OSError for a damaged file
        raise ServeError(
            f"{path} is not a readable Parquet file ({err}); remove it and rerun with --resume"
        ) from err


def prepare_out(out: Path, manifest: Manifest, state: OutState) -> None:
    """Remove what ``state`` says (stray temporary files; everything ours on --overwrite), then
    write the manifest first, atomically (kept as it is on --resume)."""
    from hydra_deploy.atomic import atomic_write_json

    try:
        for path in state.remove:
            path.unlink()
            logger.debug("removed %s", path)
        out.mkdir(parents=True, exist_ok=True)
        if not state.keep_manifest:
            atomic_write_json(out / MANIFEST, manifest.to_dict())
    except OSError as err:
        raise ServeError(f"cannot prepare {out}: {err}") from err


# --- the actors ------------------------------------------------------------------------------------
class HydraScorer:
    """The Ray Data UDF: one runner (one ONNX Runtime session) per actor; a numpy batch of
    ``shard``, ``index``, ``source`` (absolute image path or text) in, score columns out."""

    def __init__(
        self,
        export_dir: str,
        kind: str,
        *,
        threads: int = 1,
        batch_size: int | None = None,
        member_logits: bool = False,
        providers: Sequence[Any] | None = None,
        delay_s: float = 0.0,
    ) -> None:
        from hydra_deploy.engines.runner import load_runner
        from hydra_deploy.engines.scoring import check_member_logits

        self.runner = load_runner(export_dir, providers=providers, threads=threads)
        check_member_logits(self.runner, self.runner.output_names)
        if kind == "images" and not self.runner.preprocessing:
            raise RunnerError(
                f"{export_dir}: hydra.json has no preprocessing config; re-export the model"
            )
        self.kind = kind
        self.encoder = self.runner.text_encoder() if kind == "text" else None
        self.batch_size = batch_size
        self.member_logits = member_logits
        self.delay_s = float(delay_s)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from hydra_deploy.engines.scoring import score_batch
        from hydra_deploy.engines.sources import prepare

        sources = [str(s) for s in batch["source"]]
        inputs = prepare(self.runner, self.kind, sources, self.encoder)
        scores = score_batch(self.runner, inputs, batch_size=self.batch_size)
        logits = scores["member_logits"]
        columns = {
            "shard": np.asarray(batch["shard"], dtype=np.int64),
            "index": np.asarray(batch["index"], dtype=np.int64),
            "prediction": scores["prediction"].astype(np.int64),
            **{name: scores[name].astype(np.float32) for name in SCALAR_COLUMNS},
            "probs": scores["probs"].astype(np.float32),
        }
        if self.member_logits:
            columns["member_logits"] = np.asarray(logits, dtype=np.float32)
        if self.delay_s:
            time.sleep(self.delay_s)
        return columns


# --- parts -------------------------------------------------------------------------------------------
def part_table(
    shard: Shard, rows: dict[str, np.ndarray], class_names: list[str] | None, member_logits: bool
):
    """The Parquet table of one complete shard from its scored rows (in any order)."""
    import pyarrow as pa

    order = np.argsort(rows["index"], kind="stable")
    if not np.array_equal(rows["index"][order], np.arange(len(shard.labels))):
        raise ServeError(
            f"shard {shard.index} came back with rows {sorted(rows['index'].tolist())[:10]}..., "
            f"not each of its {len(shard.labels)} items once; this is a bug, please report it"
        )
    prediction = rows["prediction"][order]
    labels = [
        class_names[p] if class_names and 0 <= p < len(class_names) else None
        for p in prediction.tolist()
    ]
    columns: dict[str, Any] = {
        "item": pa.array(shard.labels, pa.string()),
        "shard": pa.array(np.full(len(order), shard.index, dtype=np.int64)),
        "prediction": pa.array(prediction, pa.int64()),
        "label": pa.array(labels, pa.string()),
    }
    for name in SCALAR_COLUMNS:
        columns[name] = pa.array(rows[name][order].astype(np.float32))
    columns["probs"] = _list_column(rows["probs"][order])
    if member_logits:
        columns["member_logits"] = _list_column(rows["member_logits"][order])
    return pa.table(columns)


def _list_column(values: np.ndarray):
    """[N, ...] float32 -> list<float32> (2-D) or list<list<float32>> (3-D), row by row."""
    import pyarrow as pa

    flat: Any = pa.array(np.ascontiguousarray(values, dtype=np.float32).reshape(-1))
    shape = values.shape
    for axis in range(len(shape) - 1, 0, -1):
        rows = math.prod(shape[:axis])
        offsets = pa.array(np.arange(0, rows * shape[axis] + 1, shape[axis], dtype=np.int32))
        flat = pa.ListArray.from_arrays(offsets, flat)
    return flat


def write_part(out: Path, table, shard: int) -> Path:
    """Write one shard's table to ``OUT/part-<shard>.parquet`` atomically."""
    import pyarrow.parquet as pq

    from hydra_deploy.atomic import atomic_path

    target = out / part_name(shard)
    try:
        with atomic_path(target) as tmp:
            pq.write_table(table, tmp)
    except OSError as err:
        raise ServeError(f"cannot write {target}: {err}") from err
    return target


# --- Ray ---------------------------------------------------------------------------------------------
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


@contextlib.contextmanager
def _data_context(progress: bool) -> Iterator[Any]:
    """Ray Data settings of a run (restored afterwards): progress bars only when asked, and a
    UDF's own exception raised rather than wrapped in UserCodeException."""
    import ray.data

    context = ray.data.DataContext.get_current()
    wanted = {
        "enable_progress_bars": progress,
        "print_on_execution_start": progress,
        "raise_original_map_exception": True,
    }
    saved = {k: getattr(context, k) for k in wanted if hasattr(context, k)}
    for key in saved:
        setattr(context, key, wanted[key])
    try:
        yield context
    finally:
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
        import hydra_deploy.errors as errors

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


# --- the run -------------------------------------------------------------------------------------------
@dataclass
class ScoreReport:
    """What a run did (``hydra-score-dataset --json`` prints it)."""

    out: str
    items: int
    items_scored: int
    shards: int
    shards_done: int
    shards_skipped: int
    seconds: float
    ray_start_seconds: float
    scoring_seconds: float
    actors: int
    threads: int
    batch_size: int
    address: str

    @property
    def items_per_second(self) -> float:
        """Items scored per second of the whole run (Ray start-up and shutdown included)."""
        return self.items_scored / self.seconds if self.seconds > 0 else 0.0

    @property
    def items_per_second_scoring(self) -> float:
        """Items scored per second once Ray was up (actor start-up included)."""
        return self.items_scored / self.scoring_seconds if self.scoring_seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "items_per_second": round(self.items_per_second, 3),
            "items_per_second_scoring": round(self.items_per_second_scoring, 3),
        }


def _check_count(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ServeError(f"--{name} must be an integer of at least 1, got {value!r}")


def score_dataset(
    export_dir: str | os.PathLike,
    inputs: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    address: str | None = None,
    num_cpus: int | None = None,
    actors: int | None = None,
    threads: int | None = None,
    batch_size: int | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    member_logits: bool = False,
    resume: bool = False,
    overwrite: bool = False,
    providers: Sequence[Any] | None = None,
    progress: bool = True,
    quiet: bool = False,
    debug: bool = False,
) -> ScoreReport:
    """Score every input with the export on a Ray cluster into the Parquet folder ``out``.

    ``address``: None starts a local cluster (``num_cpus``: default all CPUs); 'auto', HOST:PORT
    or ray://HOST:PORT joins one. ``actors`` (default one per 2 CPUs of the cluster, at least 1)
    each reserve ``threads`` CPUs (default the cluster's CPUs / actors, at least 1) for their
    ONNX Runtime session. ``batch_size``: default the export's batch_profile opt, at most its max.
    ``progress``: Ray Data's progress bars; ``quiet`` keeps Ray's console output off stderr.
    See the module docstring for the output, the manifest and resume.
    """
    from hydra_deploy import __version__

    if address is not None and address.startswith("ray://"):
        return _score_over_ray_client(
            export_dir,
            inputs,
            out,
            address=address,
            num_cpus=num_cpus,
            actors=actors,
            threads=threads,
            batch_size=batch_size,
            shard_size=shard_size,
            member_logits=member_logits,
            resume=resume,
            overwrite=overwrite,
            providers=providers,
            quiet=quiet,
            debug=debug,
        )
    begin = time.perf_counter()
    for name, value in (
        ("actors", actors),
        ("threads", threads),
        ("batch-size", batch_size),
        ("shard-size", shard_size),
        ("num-cpus", num_cpus),
    ):
        _check_count(name, value)
    info = DriverExport.read(export_dir)
    if info.kind == "images" and not info.has_preprocessing:
        raise RunnerError(
            f"{export_dir}: hydra.json has no preprocessing config, so images cannot be prepared; re-export the model"
        )
    if batch_size is not None and info.batch_max is not None and batch_size > info.batch_max:
        raise RunnerError(
            f"--batch-size {batch_size} exceeds the export's maximum batch {info.batch_max} "
            f"(hydra.json batch_profile); use at most {info.batch_max}"
        )
    batch = batch_size or info.default_batch_size()
    labels, sources = collect_items(info.family, inputs)
    shards = plan_shards(labels, sources, shard_size)
    out = Path(out)
    columns = columns_for(member_logits)
    manifest = Manifest(
        export=str(info.path),
        onnx_sha256=info.onnx_sha256,
        kind=info.kind,
        inputs=[str(p) for p in inputs],
        items=len(labels),
        items_sha256=_digest(labels, sources),
        shard_size=shard_size,
        shards=[s.summary() for s in shards],
        columns=columns,
        member_logits=member_logits,
        batch_size=batch,
        class_names=info.class_names,
        package_version=__version__,
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    state = inspect_out(out, manifest, shards, resume=resume, overwrite=overwrite)
    pending = [s for s in shards if s.index not in state.done]
    what = "images" if info.kind == "images" else "text lines"
    logger.info("%d %s in %d shard(s) of %d", len(labels), what, len(shards), shard_size)
    if state.done:
        logger.info(
            "resuming %s: %d of %d shard(s) done, %d to score",
            out,
            len(state.done),
            len(shards),
            len(pending),
        )

    def report(session: RaySession | None, scoring_s: float, done: int, scored: int) -> ScoreReport:
        return ScoreReport(
            out=str(out),
            items=len(labels),
            items_scored=scored,
            shards=len(shards),
            shards_done=done,
            shards_skipped=len(state.done),
            seconds=round(time.perf_counter() - begin, 3),
            ray_start_seconds=round(session.start_seconds, 3) if session else 0.0,
            scoring_seconds=round(scoring_s, 3),
            actors=pool,
            threads=per_actor,
            batch_size=batch,
            address=session.address if session else (address or "local"),
        )

    pool, per_actor = actors or 0, threads or 0
    if not pending:
        if state.remove:
            prepare_out(out, manifest, state)
        logger.info("nothing to do: all %d shard(s) in %s are done", len(shards), out)
        return report(None, 0.0, 0, 0)

    ray = _import_ray()
    delay_s = float(os.environ.get(TEST_DELAY_ENV) or 0)
    with ray_session(address, num_cpus, quiet=quiet, debug=debug) as session:
        cpus = max(1, session.cpus)
        pool = actors or max(1, cpus // 2)
        per_actor = threads or max(1, cpus // pool)
        if pool * per_actor > cpus:
            raise ServeError(
                f"--actors {pool} x --threads {per_actor} need {pool * per_actor} CPUs; the "
                f"cluster has {cpus}: lower --actors or --threads"
                + (" (or raise --num-cpus)" if session.started and address is None else "")
            )
        prepare_out(out, manifest, state)
        logger.info(
            "scoring %d item(s) of %d shard(s) with %d actor(s) x %d thread(s), batch %d",
            sum(len(s.labels) for s in pending),
            len(pending),
            pool,
            per_actor,
            batch,
        )
        scoring_begin = time.perf_counter()
        tally = _Tally()
        failure: HydraError | None = None
        with _data_context(progress and not quiet):
            scorer = dict(
                threads=per_actor,
                batch_size=batch,
                member_logits=member_logits,
                providers=providers,
                delay_s=delay_s,
            )
            dataset = _dataset(ray, pending).map_batches(
                HydraScorer,
                fn_constructor_args=(str(info.path), info.kind),
                fn_constructor_kwargs=scorer,
                batch_size=batch,
                batch_format="numpy",
                compute=ray.data.ActorPoolStrategy(size=pool),
                num_cpus=per_actor,
                udf_modifying_row_count=False,
            )
            try:
                _write_parts(dataset, pending, out, info.class_names, member_logits, tally)
            except Exception as err:
                if isinstance(err, HydraError) and not isinstance(err, ray.exceptions.RayError):
                    raise  # the driver's own (a part that cannot be written)
                failure = _stopped(
                    unwrap_ray_error(err), len(state.done) + tally.written, len(shards), out
                )
                if debug:
                    raise failure from err
        if failure is not None:
            # The failed execution's actors keep their CPUs until its frames are collected: free
            # them now, for a process that stays connected (a notebook, the next run).
            del dataset
            gc.collect()
            raise failure
        missing = [s.part for s in pending if not (out / s.part).exists()]
        if missing:
            raise ServeError(
                f"Ray Data returned no results for {len(missing)} shard(s) ({', '.join(missing[:3])}"
                "...); rerun with --resume"
            )
        scoring_s = time.perf_counter() - scoring_begin
    return report(session, scoring_s, tally.written, tally.scored)


@dataclass
class _Tally:
    written: int = 0  # parts
    scored: int = 0  # items in them


def _write_parts(
    dataset,
    pending: Sequence[Shard],
    out: Path,
    class_names: list[str] | None,
    member_logits: bool,
    tally: _Tally,
) -> None:
    """Stream the scored rows, group them by shard, write each shard's part once complete."""
    by_index = {s.index: s for s in pending}
    partial: dict[int, list[dict[str, np.ndarray]]] = {}
    counts: dict[int, int] = {}
    for result in dataset.iter_batches(batch_size=None, batch_format="numpy"):
        for index in np.unique(result["shard"]).tolist():
            rows = result["shard"] == index
            partial.setdefault(index, []).append({k: v[rows] for k, v in result.items()})
            counts[index] = counts.get(index, 0) + int(rows.sum())
            shard = by_index[index]
            if counts[index] == len(shard.labels):
                chunks = partial.pop(index)
                merged = {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]}
                write_part(out, part_table(shard, merged, class_names, member_logits), index)
                tally.written += 1
                tally.scored += len(shard.labels)
                logger.debug("wrote %s", out / shard.part)


def _stopped(cause: HydraError, finished: int, total: int, out: Path) -> HydraError:
    """The one-line error of a run an actor's error stopped, with what to do next."""
    fix = (
        "repair or replace that file and rerun with --resume to score the rest (removing it "
        "changes the input list, which needs --overwrite)"
        if "cannot read the image" in str(cause)
        else "fix the cause and rerun with --resume to score the rest"
    )
    return type(cause)(
        f"{cause}; the run stopped, {finished} of {total} shard(s) are finished in {out} and "
        f"kept: {fix}"
    )


def _dataset(ray, pending: Sequence[Shard]):
    """One block per pending shard (so a batch never spans two shards when batch <= shard size)."""
    import pyarrow as pa

    tables = [
        pa.table(
            {
                "shard": pa.array(np.full(len(s.labels), s.index, dtype=np.int64)),
                "index": pa.array(np.arange(len(s.labels), dtype=np.int64)),
                "source": pa.array(list(s.sources), pa.string()),
            }
        )
        for s in pending
    ]
    return ray.data.from_arrow(tables)


def _score_over_ray_client(
    export_dir,
    inputs,
    out,
    *,
    address: str,
    num_cpus: int | None,
    quiet: bool,
    debug: bool,
    **options: Any,
) -> ScoreReport:
    """``address`` ray://HOST:PORT: run the whole of :func:`score_dataset` as one task on the
    cluster (``num_cpus=0``). Ray Data's executor needs a core worker, which a Ray Client driver
    lacks (Ray 2.60: ``'Worker' object has no attribute 'core_worker'``); inside a task it has
    one. Paths are made absolute here and must name the same files on the cluster's nodes."""
    ray = _import_ray()
    if num_cpus is not None:
        raise ServeError(
            "--num-cpus sizes a local cluster; a cluster joined with --address has its own CPUs"
        )
    check_address(address)
    begin = time.perf_counter()
    with _ray_console(quiet, debug):
        try:
            ray.init(
                address=address,
                log_to_driver=debug,
                logging_level=logging.DEBUG if debug else logging.ERROR,
            )
        except (ConnectionError, RuntimeError, ValueError, SystemExit) as err:
            raise _connect_error(address, err) from err
        start_s = time.perf_counter() - begin
        logger.info(
            "connected to the Ray cluster at %s in %.1f s; scoring runs there as one task "
            "(progress is in its worker log)",
            address,
            start_s,
        )
        try:
            task = ray.remote(num_cpus=0, max_retries=0)(score_dataset)
            ref = task.remote(
                os.path.abspath(export_dir),
                [os.path.abspath(p) for p in inputs],
                os.path.abspath(out),
                progress=False,
                quiet=True,
                **options,
            )
            try:
                report = ray.get(ref)
            except KeyboardInterrupt:
                ray.cancel(ref, force=True)
                raise
            except ray.exceptions.RayError as err:
                raise unwrap_ray_error(err) from err
        finally:
            ray.shutdown()
    report.address = address
    report.ray_start_seconds = round(start_s, 3)
    report.seconds = round(time.perf_counter() - begin, 3)
    return report
