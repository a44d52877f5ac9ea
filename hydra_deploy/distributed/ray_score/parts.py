"""Parts: the columns of every part, the Parquet table of one complete shard, and writing
it atomically to ``OUT/part-<shard>.parquet``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hydra_deploy.atomic import atomic_path
from hydra_deploy.distributed.ray_score.shards import Shard, part_name
from hydra_deploy.errors import ServeError
from hydra_deploy.optional import lazy_module
from hydra_deploy.uncertainty.scores import SCALAR_SCORES

pa = lazy_module("pyarrow", purpose="hydra-score-dataset", error=ServeError)
pq = lazy_module("pyarrow.parquet", purpose="hydra-score-dataset", error=ServeError)
pc = lazy_module("pyarrow.compute", purpose="hydra-score-dataset", error=ServeError)

SCALAR_COLUMNS = SCALAR_SCORES
#: The columns of an export with decisions (hydra-calibrate), for the rules its record holds:
#: ``confidence`` (float32, the calibrated max probability), ``prediction_set`` (list<int64>: the
#: class indices of the conformal set), ``accept`` and ``ood_flag`` (bool).
DECISION_COLUMNS = ("confidence", "prediction_set", "accept", "ood_flag")


def decision_columns(record: Any) -> list[str]:
    """The :data:`DECISION_COLUMNS` a decisions record (or None: none) gives."""
    return [] if record is None else [n for n in record.fields if n in DECISION_COLUMNS]


def columns_for(member_logits: bool, decisions: Sequence[str] = ()) -> list[str]:
    """The columns of every part, in order (``decisions``: the decision columns, if any).
    ``label`` is ``predicted_name``'s old name, kept for one release; ``unreadable``: why an
    image was skipped (``--skip-unreadable``; null for the rows scored)."""
    names = ["item", "shard", "prediction", "predicted_name", "label", *SCALAR_COLUMNS, "probs"]
    return [*names, *decisions, *(["member_logits"] if member_logits else []), "unreadable"]


def part_table(
    shard: Shard,
    rows: dict[str, np.ndarray],
    class_names: list[str] | None,
    member_logits: bool,
    decisions: Sequence[str] = (),
):
    """The Parquet table of one complete shard from its scored rows (in any order)."""
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
        "predicted_name": pa.array(labels, pa.string()),
        "label": pa.array(labels, pa.string()),  # predicted_name's old name, for one release
    }
    for name in SCALAR_COLUMNS:
        columns[name] = pa.array(rows[name][order].astype(np.float32))
    columns["probs"] = _list_column(rows["probs"][order])
    for name in decisions:
        value = rows[name][order]
        if name == "prediction_set":
            columns[name] = _index_lists(value)
        elif name == "confidence":
            columns[name] = pa.array(value.astype(np.float32))
        else:
            columns[name] = pa.array(value.astype(np.bool_), pa.bool_())
    if member_logits:
        columns["member_logits"] = _list_column(rows["member_logits"][order])
    return pa.table(_masked_unreadable(columns, rows["unreadable"][order]))


def _masked_unreadable(columns: dict[str, Any], reasons: np.ndarray) -> dict[str, Any]:
    """``columns`` with the ``unreadable`` column (each row's reason, null where it was read)
    and every score of an unreadable row null (it was fed as zeros)."""
    skipped = np.asarray([bool(r) for r in reasons.tolist()])
    columns["unreadable"] = pa.array([r or None for r in reasons.tolist()], pa.string())
    if skipped.any():
        mask = pa.array(skipped)
        for name, column in columns.items():
            if name not in ("item", "shard", "unreadable"):
                columns[name] = pc.if_else(mask, pa.scalar(None, type=column.type), column)
    return columns


def unreadable_rows(table) -> list[dict[str, str]]:
    """The rows of a part skipped as unreadable: ``{"input": item, "reason": ...}`` each."""
    items, reasons = table["item"].to_pylist(), table["unreadable"].to_pylist()
    return [
        {"input": item, "reason": reason}
        for item, reason in zip(items, reasons, strict=True)
        if reason is not None
    ]


def _list_column(values: np.ndarray):
    """[N, ...] float32 -> list<float32> (2-D) or list<list<float32>> (3-D), row by row."""
    flat: Any = pa.array(np.ascontiguousarray(values, dtype=np.float32).reshape(-1))
    shape = values.shape
    for axis in range(len(shape) - 1, 0, -1):
        rows = math.prod(shape[:axis])
        offsets = pa.array(np.arange(0, rows * shape[axis] + 1, shape[axis], dtype=np.int32))
        flat = pa.ListArray.from_arrays(offsets, flat)
    return flat


def _index_lists(members: np.ndarray):
    """[N, C] bool -> list<int64>: each row's True columns (a prediction set's class indices)."""
    members = np.asarray(members, dtype=np.bool_).reshape(len(members), -1)
    _, classes = np.nonzero(members)  # row by row, columns ascending
    offsets = np.concatenate([[0], np.cumsum(members.sum(axis=1))]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(classes.astype(np.int64)))


def write_part(out: Path, table, shard: int) -> Path:
    """Write one shard's table to ``OUT/part-<shard>.parquet`` atomically."""
    target = out / part_name(shard)
    try:
        with atomic_path(target) as tmp:
            pq.write_table(table, tmp)
    except OSError as err:
        raise ServeError(f"cannot write {target}: {err}") from err
    return target
