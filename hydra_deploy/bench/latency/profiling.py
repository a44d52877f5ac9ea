"""ONNX Runtime's profiler on one graph: kernel time per node, and the precision each node runs in.

:func:`profile_session` runs a graph with ``SessionOptions.enable_profiling`` and sums every
node's kernel time (``benchmarks/profile_ort.py`` splits it by role); :func:`precision_breakdown`
sorts the time of an INT8 graph into what runs in INT8, what stays in float and what converts
between the two (the answer to "why is the INT8 graph not faster").
"""

from __future__ import annotations

import collections
import json
import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: The kinds of time in an INT8 graph.
PRECISION_CLASSES = ("int8", "float", "convert", "other")
#: Operators that only convert between float and INT8.
CONVERT_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"})
#: Operators that compute on INT8 inputs (ONNX and ONNX Runtime's contrib operators).
INTEGER_OPS = frozenset(
    {
        "MatMulInteger",
        "MatMulIntegerToFloat",
        "DynamicQuantizeMatMul",
        "DynamicQuantizeLSTM",
        "ConvInteger",
        "QGemm",
        "QAttention",
        "QEmbedLayerNormalization",
        "QOrderedMatMul",
        "QOrderedLayerNormalization",
    }
)
INTEGER_TYPES = frozenset({"int8", "uint8", "int4", "uint4"})
FLOAT_TYPES = frozenset({"float", "float16", "bfloat16", "double"})


@dataclass
class KernelProfile:
    """One graph's profile: per node, the mean kernel microseconds per run, its operator and
    the element types of its inputs and outputs; the wall time of every profiled run."""

    per_node_us: dict[str, float]
    op_type: dict[str, str]
    node_types: dict[str, frozenset[str]]
    wall_ms: list[float]
    optimized: Path | None = None


def _element_types(entries: Iterable[Any] | None) -> set[str]:
    """``[{"float": [8, 197, 768]}, {"int8": [...]}]`` (the profiler's type-and-shape lists)."""
    found: set[str] = set()
    for entry in entries or ():
        if isinstance(entry, Mapping):
            found.update(str(key) for key in entry)
    return found


def profile_session(
    path: Path,
    feed: Mapping[str, np.ndarray],
    runs: int,
    threads: int,
    workdir: Path,
    *,
    warmup: int = 2,
    save_optimized: bool = True,
) -> KernelProfile:
    """Run ``path`` ``warmup`` + ``runs`` times on the CPU with the profiler on (``threads``
    intra-op threads, no spinning) and return the kernel time of the ``runs`` timed runs.

    ``save_optimized``: first write the graph ONNX Runtime optimizes to (the one the profile's
    node names name) under ``workdir``, for callers that read its structure.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3
    optimized = None
    if save_optimized:
        optimized = workdir / f"{path.parent.name}.optimized.onnx"
        options.optimized_model_filepath = str(optimized)
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        options.optimized_model_filepath = ""
    options.enable_profiling = True
    options.profile_file_prefix = str(workdir / path.parent.name)
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feed = {i.name: feed[i.name] for i in session.get_inputs()}
    walls = []
    for _ in range(warmup):
        session.run(None, feed)  # profiled too; dropped below by run index
    for _ in range(runs):
        start = time.perf_counter()
        session.run(None, feed)
        walls.append(1000 * (time.perf_counter() - start))
    trace_path = Path(session.end_profiling())
    trace = json.loads(trace_path.read_text())
    trace_path.unlink(missing_ok=True)
    runs_seen = [e for e in trace if e.get("cat") == "Session" and e.get("name") == "model_run"]
    keep_after = runs_seen[warmup]["ts"] if len(runs_seen) > warmup else 0
    per_node: dict[str, float] = collections.defaultdict(float)
    op_type: dict[str, str] = {}
    node_types: dict[str, frozenset[str]] = {}
    for event in trace:
        if event.get("cat") != "Node" or not event.get("name", "").endswith("_kernel_time"):
            continue
        if event["ts"] < keep_after:
            continue
        name = event["name"][: -len("_kernel_time")]
        args = event.get("args", {})
        per_node[name] += event["dur"] / runs
        op_type[name] = args.get("op_name", "?")
        node_types[name] = frozenset(
            _element_types(args.get("input_type_shape"))
            | _element_types(args.get("output_type_shape"))
        )
    return KernelProfile(dict(per_node), op_type, node_types, walls, optimized)


def precision_of(op: str, types: Iterable[str] = ()) -> str:
    """One node -> ``convert`` (Q/DQ), ``int8`` (computes on INT8 data), ``float`` or ``other``
    (integer shape arithmetic). Without type information, by the operator alone."""
    types = set(types)
    if op in CONVERT_OPS:
        return "convert"
    if op in INTEGER_OPS or op.startswith("QLinear") or types & INTEGER_TYPES:
        return "int8"
    if types & FLOAT_TYPES or not types:
        return "float"
    return "other"


def precision_breakdown(profile: KernelProfile) -> dict[str, Any]:
    """Kernel time per precision class and per operator (ms per run, share of the kernel time).

    ``ops`` lists every (operator, class) pair, the largest first: the float ones are what stays
    in float in an INT8 graph.
    """
    by_class = dict.fromkeys(PRECISION_CLASSES, 0.0)
    by_op: dict[tuple[str, str], float] = collections.defaultdict(float)
    for name, us in profile.per_node_us.items():
        op = profile.op_type.get(name, "?")
        kind = precision_of(op, profile.node_types.get(name, ()))
        by_class[kind] += us / 1000
        by_op[(op, kind)] += us / 1000
    total = sum(by_class.values())

    def share(ms: float) -> float:
        return ms / total if total > 0 else 0.0

    return {
        "median_wall_ms": statistics.median(profile.wall_ms) if profile.wall_ms else None,
        "kernel_ms": total,
        "kernel_ms_by_class": by_class,
        "share_by_class": {kind: share(ms) for kind, ms in by_class.items()},
        "ops": [
            {"op": op, "precision": kind, "ms": ms, "share": share(ms)}
            for (op, kind), ms in sorted(by_op.items(), key=lambda kv: -kv[1])
        ],
    }
