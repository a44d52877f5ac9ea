"""Score a data set of images or text lines on a Ray cluster; write resumable Parquet parts.

``score_dataset(export_dir, inputs, out)`` is what ``hydra-score-dataset`` runs:

1. **Items.** The inputs become one ordered list of items: image files and folders (searched
   recursively, sorted, as ``hydra-run`` finds them) for vision exports; for text (BERT) exports,
   the non-empty lines of ``.txt`` files, labelled ``file:line`` like ``hydra-run``'s. The list is
   cut into **shards** of ``shard_size`` consecutive items, across file boundaries (one rule for
   images and text: a shard may hold the end of one .txt file and the start of the next).
2. **Manifest.** ``OUT/_hydra_manifest.json`` records the model (sha256 of ``model.onnx``), the
   items (a sha256 over labels and absolute paths / texts, and one per shard), the shard size, the
   columns, the decisions applied (a sha256 of the record) and the package version. It is written first, atomically; ``--resume`` compares it.
3. **Scoring.** The pending shards become a Ray Dataset, one block per shard
   (``ray.data.from_arrow``). ``map_batches`` runs :class:`HydraScorer` in a fixed pool of
   ``actors`` actors (``compute=ray.data.ActorPoolStrategy(size=actors)``; ``concurrency=`` is
   deprecated in Ray 2.60), each reserving ``threads`` CPUs. Every actor builds one runner (one
   ONNX Runtime session with ``threads`` intra-op threads) in ``__init__``, and per batch reads
   and preprocesses its images (or tokenizes its text) itself, runs the model and computes
   :func:`~hydra_deploy.engines.scoring.score_batch` (the ensemble scores, and the export's
   decisions). The driver only ships paths and texts.
4. **Parts.** The driver streams the results (``iter_batches``), groups them by shard and, once a
   shard is complete, writes ``OUT/part-<shard:05d>.parquet`` in input order, atomically (temporary
   name in OUT, then ``os.replace``): a part file exists only when complete.

``pyarrow.parquet.read_table(OUT)`` and ``pandas.read_parquet(OUT)`` read OUT as one table in input
order (parts sort by name; ``_``- and ``.``-prefixed files are ignored). Columns: ``item``,
``shard``, ``prediction`` (int64), ``predicted_name`` (its class name, null without class
names; ``label``: the same under its old name, kept for one release), ``msp``,
``predictive_entropy``, ``expected_entropy``, ``mutual_information``, ``disagreement`` (float32),
``probs`` (list<float32>); for an export calibrated with ``hydra-calibrate`` (``decisions=True``,
the default), for the rules its record holds, ``confidence`` (float32, the calibrated max
probability), ``prediction_set`` (list<int64>: the class indices of the conformal set),
``accept`` and ``ood_flag`` (bool), and ``prediction``/``predicted_name`` are then the calibrated argmax
(``decisions=False``, ``--raw``: scores only); and, with ``member_logits=True``,
``member_logits`` (list<list<float32>>, [members][classes]); last, ``unreadable`` (string: why
``skip_unreadable`` skipped the image, whose other columns but ``item`` and ``shard`` are then
null; null for the rows scored). A record fitted on another
model.onnx is refused before Ray starts (as a runner refuses it).

Clusters: ``address`` None starts a local cluster for the run (shut down afterwards); 'auto' or
HOST:PORT joins a running one from a driver on one of its nodes; ray://HOST:PORT (Ray Client) runs
the whole of this function as one task on the cluster (Ray Data's executor does not run in a Ray
Client driver), with the paths made absolute here (so ``item`` holds absolute paths). Every node
needs hydra-deploy[ray] with onnxruntime and pillow (tokenizers for text), and the export folder,
the inputs and OUT at the same paths (a shared file system).

Resume: an existing OUT is refused unless ``resume`` or ``overwrite``. ``resume`` needs a matching
manifest (same model, items, shard size, columns and decisions; batch size, actors and threads may change),
keeps finished parts untouched and scores only the missing shards; temporary files of a crashed
run are removed. Errors (an undecodable image without ``skip_unreadable``, a failing actor) stop
the run; the parts finished before stay valid, and ``resume`` continues from them once the cause
is fixed.

Modules: :mod:`.export` (the export as the driver sees it), :mod:`.shards` (items and shards),
:mod:`.manifest` (the manifest), :mod:`.output` (the output folder before a run), :mod:`.actors`
(:class:`HydraScorer`, the actors' UDF), :mod:`.parts` (the Parquet parts), :mod:`.cluster` (Ray:
connecting, its console, its errors) and :mod:`.run` (:func:`score_dataset`).
"""

from hydra_deploy.distributed.ray_score.actors import HydraScorer
from hydra_deploy.distributed.ray_score.cluster import (
    CONNECT_TIMEOUT_S,
    OBJECT_STORE_BYTES,
    RaySession,
    check_address,
    ray_session,
    unwrap_ray_error,
)
from hydra_deploy.distributed.ray_score.export import DEFAULT_BATCH_SIZE, DriverExport
from hydra_deploy.distributed.ray_score.manifest import MANIFEST, MANIFEST_FORMAT, Manifest
from hydra_deploy.distributed.ray_score.output import OutState, inspect_out, prepare_out
from hydra_deploy.distributed.ray_score.parts import (
    DECISION_COLUMNS,
    SCALAR_COLUMNS,
    columns_for,
    decision_columns,
    part_table,
    write_part,
)
from hydra_deploy.distributed.ray_score.run import (
    DEFAULT_SHARD_SIZE,
    TEST_DELAY_ENV,
    ScoreReport,
    score_dataset,
)
from hydra_deploy.distributed.ray_score.shards import Shard, collect_items, part_name, plan_shards

__all__ = [
    "CONNECT_TIMEOUT_S",
    "DECISION_COLUMNS",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_SHARD_SIZE",
    "MANIFEST",
    "MANIFEST_FORMAT",
    "OBJECT_STORE_BYTES",
    "SCALAR_COLUMNS",
    "TEST_DELAY_ENV",
    "DriverExport",
    "HydraScorer",
    "Manifest",
    "OutState",
    "RaySession",
    "ScoreReport",
    "Shard",
    "check_address",
    "collect_items",
    "columns_for",
    "decision_columns",
    "inspect_out",
    "part_name",
    "part_table",
    "plan_shards",
    "prepare_out",
    "ray_session",
    "score_dataset",
    "unwrap_ray_error",
    "write_part",
]
