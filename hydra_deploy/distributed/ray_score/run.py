"""The run: :func:`score_dataset` (items, manifest, output folder, the actors' pool, parts)
and its Ray Client form.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hydra_deploy import __version__
from hydra_deploy.distributed.ray_score.actors import HydraScorer
from hydra_deploy.distributed.ray_score.cluster import (
    _connect_error,
    _data_context,
    _import_ray,
    _ray_console,
    check_address,
    ray_bars_shown,
    ray_session,
    unwrap_ray_error,
)
from hydra_deploy.distributed.ray_score.export import DriverExport
from hydra_deploy.distributed.ray_score.manifest import Manifest
from hydra_deploy.distributed.ray_score.output import inspect_out, prepare_out
from hydra_deploy.distributed.ray_score.parts import (
    columns_for,
    decision_columns,
    part_table,
    unreadable_rows,
    write_part,
)
from hydra_deploy.distributed.ray_score.shards import (
    Shard,
    _digest,
    collect_items,
    plan_shards,
    source_columns,
)
from hydra_deploy.errors import HydraError, RunnerError, ServeError, counted
from hydra_deploy.optional import lazy_module
from hydra_deploy.progress import Progress
from hydra_deploy.progress import progress as shown

logger = logging.getLogger("hydra_deploy")
pa = lazy_module("pyarrow", purpose="hydra-score-dataset", error=ServeError)


DEFAULT_SHARD_SIZE = 256
#: Test hook: seconds each actor sleeps after every batch (so that a test can kill a run midway).
TEST_DELAY_ENV = "HYDRA_SCORE_DATASET_TEST_DELAY_S"


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
    decisions: list[str] = field(default_factory=list)  # the decision columns written
    #: the images --skip-unreadable left out ({"input", "reason"} each; their rows' scores null)
    skipped: list[dict[str, str]] = field(default_factory=list)

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
    decisions: bool = True,
    allow_decisions_mismatch: bool = False,
    skip_unreadable: bool = False,
) -> ScoreReport:
    """Score every input with the export on a Ray cluster into the Parquet folder ``out``.

    ``address``: None starts a local cluster (``num_cpus``: default all CPUs); 'auto', HOST:PORT
    or ray://HOST:PORT joins one. ``actors`` (default one per 2 CPUs of the cluster, at least 1)
    each reserve ``threads`` CPUs (default the cluster's CPUs / actors, at least 1) for their
    ONNX Runtime session. ``batch_size``: default the export's batch_profile opt, at most its max.
    ``progress``: Ray Data's progress bars; ``quiet`` keeps Ray's console output off stderr.
    ``decisions``: an export calibrated with hydra-calibrate also gets its decision columns
    (refused, before Ray starts, when they were fitted on another model.onnx, or on other
    numbers than ONNX Runtime's, which the actors run, unless ``allow_decisions_mismatch``);
    False (--raw): scores only. ``skip_unreadable``: an image that cannot be decoded is logged,
    listed in the report's ``skipped`` and given a row whose ``unreadable`` column says why (its
    scores null), instead of stopping the run. See the module docstring for the output, the
    manifest and resume.
    """

    if address is not None and address.startswith("ray://"):
        client = {k: v for k, v in locals().items() if k not in ("inputs", "out", "progress")}
        return _score_over_ray_client(client.pop("export_dir"), inputs, out, **client)
    begin = time.perf_counter()
    counts = (actors, threads, batch_size, shard_size, num_cpus)
    for name, value in zip(_COUNTED, counts, strict=True):
        _check_count(name, value)
    info = _read_export(export_dir, decisions, batch_size, allow_decisions_mismatch)
    batch = batch_size or info.default_batch_size()
    labels, shards, manifest = _plan(info, inputs, shard_size, member_logits, batch)
    decided, out = decision_columns(info.decisions), Path(out)
    state, pending = _pending(info.kind, out, manifest, shards, resume=resume, overwrite=overwrite)
    fixed = dict(
        out=str(out),
        items=len(labels),
        shards=len(shards),
        shards_skipped=len(state.done),
        batch_size=batch,
        decisions=decided,
    )
    if not pending:
        ran = _nothing_to_do(out, manifest, state, len(shards), (address, actors, threads))
    else:
        scorer = dict(
            batch_size=batch,
            member_logits=member_logits,
            providers=providers,
            decisions=decided,
            allow_decisions_mismatch=allow_decisions_mismatch,
            skip_unreadable=skip_unreadable,
        )
        ran = _score_pending(
            info,
            pending,
            out,
            (manifest, state, len(shards)),
            scorer,
            (address, num_cpus, actors, threads),
            progress=progress,
            quiet=quiet,
            debug=debug,
        )
    if ran.get("skipped"):
        logger.warning(
            "skipped %s of %d; see the warnings above",
            counted(len(ran["skipped"]), "unreadable file"),
            ran["items_scored"],
        )
    return ScoreReport(**fixed, **ran, seconds=round(time.perf_counter() - begin, 3))


def _nothing_to_do(
    out: Path, manifest: Manifest, state: Any, shards: int, cluster: tuple
) -> dict[str, Any]:
    """Every shard is done already: tidy OUT (what a finished run leaves), say so, and report
    nothing scored."""
    address, actors, threads = cluster
    if state.remove:
        prepare_out(out, manifest, state)
    logger.info("nothing to do: all %d shard(s) in %s are done", shards, out)
    ran = dict(items_scored=0, shards_done=0, ray_start_seconds=0.0, scoring_seconds=0.0)
    return ran | dict(actors=actors or 0, threads=threads or 0, address=address or "local")


def _pending(
    kind: str,
    out: Path,
    manifest: Manifest,
    shards: Sequence[Shard],
    *,
    resume: bool,
    overwrite: bool,
) -> tuple[Any, list[Shard]]:
    """(the output folder's state, the shards still to score); says what there is to do."""
    state = inspect_out(out, manifest, shards, resume=resume, overwrite=overwrite)
    pending = [s for s in shards if s.index not in state.done]
    what = "images" if kind == "images" else "text lines"
    items = sum(len(s.labels) for s in shards)
    logger.info("%d %s in %d shard(s) of %d", items, what, len(shards), manifest.shard_size)
    if state.done:
        logger.info(
            "resuming %s: %d of %d shard(s) done, %d to score",
            out,
            len(state.done),
            len(shards),
            len(pending),
        )
    return state, pending


def _score_pending(
    info: DriverExport,
    pending: Sequence[Shard],
    out: Path,
    run: tuple[Manifest, Any, int],
    scorer: dict[str, Any],
    cluster: tuple[str | None, int | None, int | None, int | None],
    *,
    progress: bool,
    quiet: bool,
    debug: bool,
) -> dict[str, Any]:
    """Start (or join) Ray (``cluster``: address, num_cpus, actors, threads), size the actors'
    pool, score the pending shards: the report's fields of what ran."""
    manifest, state, total = run
    address, num_cpus, actors, threads = cluster  # as score_dataset takes them
    batch = scorer["batch_size"]
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
        tally = _run_pool(
            ray,
            info,
            pending,
            out,
            total,
            len(state.done),
            {"threads": per_actor, **scorer, "delay_s": delay_s},
            pool,
            progress=progress and not quiet,
            debug=debug,
        )
        scoring_s = time.perf_counter() - scoring_begin
    return dict(
        items_scored=tally.scored,
        skipped=tally.skipped,
        shards_done=tally.written,
        ray_start_seconds=round(session.start_seconds, 3),
        scoring_seconds=round(scoring_s, 3),
        actors=pool,
        threads=per_actor,
        address=session.address,
    )


#: the counts score_dataset checks, as the command spells them
_COUNTED = ("actors", "threads", "batch-size", "shard-size", "num-cpus")


def _plan(
    info: DriverExport, inputs: Sequence[Any], shard_size: int, member_logits: bool, batch: int
) -> tuple[list[Any], list[Shard], Manifest]:
    """The items (their labels), their shards and the run's manifest."""
    labels, sources = collect_items(info.family, inputs)
    shards = plan_shards(labels, sources, shard_size)
    columns = columns_for(member_logits, decision_columns(info.decisions))
    manifest = _manifest(
        info, inputs, labels, sources, shards, shard_size, columns, member_logits, batch
    )
    return labels, shards, manifest


def _manifest(
    info: DriverExport,
    inputs: Sequence[Any],
    labels: Sequence[Any],
    sources: Sequence[Any],
    shards: Sequence[Shard],
    shard_size: int,
    columns: list[str],
    member_logits: bool,
    batch: int,
) -> Manifest:
    """The run's manifest: what a resumed run must match."""
    return Manifest(
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
        decisions_sha256=info.decisions_sha256,
        package_version=__version__,
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )


def _read_export(
    export_dir: Any, decisions: bool, batch_size: int | None, allow_mismatch: bool = False
) -> DriverExport:
    """The export to score, refused when its images cannot be prepared or the batch is too big."""
    info = DriverExport.read(
        export_dir, decisions=decisions, allow_decisions_mismatch=allow_mismatch
    )
    if info.kind == "images" and not info.has_preprocessing:
        raise RunnerError(
            f"{export_dir}: hydra.json has no preprocessing config, so images cannot be prepared; re-export the model"
        )
    if batch_size is not None and info.batch_max is not None and batch_size > info.batch_max:
        raise RunnerError(
            f"--batch-size {batch_size} exceeds the export's maximum batch {info.batch_max} "
            f"(hydra.json batch_profile); use at most {info.batch_max}"
        )
    return info


def _run_pool(
    ray: Any,
    info: DriverExport,
    pending: Sequence[Shard],
    out: Path,
    total: int,
    done_before: int,
    scorer: dict[str, Any],
    pool: int,
    *,
    progress: bool,
    debug: bool,
) -> _Tally:
    """Score the pending shards with ``pool`` actors (``scorer``: HydraScorer's keywords) and
    write their parts; the error that stopped the run says what is kept and what to do."""
    per_actor, batch = scorer["threads"], scorer["batch_size"]
    member_logits, decided = scorer["member_logits"], scorer["decisions"]
    shown_as = _shown(pending, progress)
    tally = _Tally(shown=shown_as)
    failure: HydraError | None = None
    with _data_context(progress), shown_as:
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
            _write_parts(dataset, pending, out, info.class_names, member_logits, decided, tally)
        except Exception as err:
            if isinstance(err, HydraError) and not isinstance(err, ray.exceptions.RayError):
                raise  # the driver's own (a part that cannot be written)
            failure = _stopped(unwrap_ray_error(err), done_before + tally.written, total, out)
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
            f"Ray Data returned no results for {counted(len(missing), 'shard')} ({', '.join(missing[:3])}"
            "...); rerun with --resume"
        )
    return tally


@dataclass
class _Tally:
    written: int = 0  # parts
    scored: int = 0  # items in them
    skipped: list[dict[str, str]] = field(default_factory=list)  # unreadable images among them
    shown: Progress | None = None  # the run's own progress (log lines; see _shown)

    def received(self, items: int, shards: int) -> None:
        """``items`` more scored rows have come back, of ``shards`` pending shards."""
        if self.shown is not None:
            self.shown.describe(f"scoring, {self.written}/{shards} shards written")
            self.shown.update(items)


def _shown(pending: Sequence[Shard], progress: bool) -> Progress:
    """The run's own progress: items received as the driver sees finished blocks, the shards
    written. Log lines only, where Ray Data's bars are off (:func:`ray_bars_shown`)."""
    ours = progress and not ray_bars_shown(progress)
    items = sum(len(s.labels) for s in pending)
    return shown(
        items,
        desc=f"scoring, 0/{len(pending)} shards written",
        unit="item",
        enabled=None if ours else False,
        bar=False,
    )


def _write_parts(
    dataset,
    pending: Sequence[Shard],
    out: Path,
    class_names: list[str] | None,
    member_logits: bool,
    decisions: Sequence[str],
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
                table = part_table(shard, merged, class_names, member_logits, decisions)
                write_part(out, table, index)
                for row in unreadable_rows(table):  # --skip-unreadable's
                    logger.warning("skipped %s: cannot read it as an image: %s", *row.values())
                    tally.skipped.append(row)
                tally.written += 1
                tally.scored += len(shard.labels)
                logger.debug("wrote %s", out / shard.part)
        tally.received(len(result["shard"]), len(pending))


def _stopped(cause: HydraError, finished: int, total: int, out: Path) -> HydraError:
    """The one-line error of a run an actor's error stopped, with what to do next."""
    fix = (
        "repair or replace that file and rerun with --resume to score the rest (removing it "
        "changes the input list, which needs --overwrite), or rerun with --resume "
        "--skip-unreadable to skip such files and report them"
        if "cannot read the image" in str(cause)
        else "fix the cause and rerun with --resume to score the rest"
    )
    return type(cause)(
        f"{cause}; the run stopped, {finished} of {total} shard(s) are finished in {out} and "
        f"kept: {fix}"
    )


def _dataset(ray, pending: Sequence[Shard]):
    """One block per pending shard (so a batch never spans two shards when batch <= shard size)."""
    return ray.data.from_arrow([pa.table(columns) for columns in shard_columns(pending)])


def shard_columns(pending: Sequence[Shard]) -> list[dict[str, Any]]:
    """The table columns of each pending shard: ``shard``, ``index`` and what the actors read
    (:func:`~hydra_deploy.distributed.ray_score.shards.source_columns`; every table gets a
    ``pair`` column when any item is a sentence pair, so the blocks share one schema)."""
    paired = any(isinstance(item, tuple) for s in pending for item in s.sources)
    tables = []
    for s in pending:
        read = source_columns(s.sources)
        if paired:
            read.setdefault("pair", [None] * len(s.sources))
        tables.append(
            {
                "shard": pa.array(np.full(len(s.labels), s.index, dtype=np.int64)),
                "index": pa.array(np.arange(len(s.labels), dtype=np.int64)),
                **{name: pa.array(values, pa.string()) for name, values in read.items()},
            }
        )
    return tables


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
