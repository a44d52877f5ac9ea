"""Where ONNX Runtime spends Hydra's time: per-operator profile of the single model against Hydra.

Issue 8 asks, wherever Hydra's latency ratio exceeds its FLOPs ratio, *why*. This script exports
the single model and the fused Hydra exactly as ``hydra-bench`` does (random weights; the same
:func:`hydra_deploy.bench.latency.export_variant`), runs each ``--runs`` times in ONNX Runtime on
the CPU with the session profiler on, and sums the kernel time of every node by *role*:

- ``qkv`` / ``proj``: the attention's input and output projections (MatMul/Gemm/Add on them);
- ``attention``: the score and context products, the softmax and the scale;
- ``mlp``: fc1, GELU and fc2;
- ``norm``: LayerNormalization; ``layout``: Transpose/Reshape/Split/Concat/Slice/... (data moves);
- ``residual`` / ``other``: the rest (adds, multiplies, the head).

Roles come from the ONNX node's op type and its neighbours (MatMuls by their weight's shape), so
they do not depend on node names. It prints a table (ms per run, share, Hydra / single per role,
the role's FLOPs ratio where one exists) and writes JSON next to the latency results.

Run it from the repository root::

    .venv/bin/python benchmarks/profile_ort.py --overwrite
    .venv/bin/python benchmarks/profile_ort.py --lowering bmm --out benchmarks/results/profile_ort_bmm.json --overwrite
    .venv/bin/python benchmarks/profile_ort.py --backbone vit_s16 --batch 8 --runs 5 --overwrite
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import add_output_options, machine, note

from hydra_deploy.atomic import atomic_write_json
from hydra_deploy.bench.latency import (
    BenchConfig,
    build_variants,
    export_variant,
    feed_of,
    profile_session,
    versions,
)
from hydra_deploy.cli.common import print_table, refuse_existing
from hydra_deploy.errors import HydraError
from hydra_deploy.fusion import DEFAULT_LOWERING, LOWERINGS

DEFAULT_OUT = Path("benchmarks/results/profile_ort.json")
ROLES = ("qkv", "attention", "proj", "mlp", "norm", "layout", "residual", "other")
LAYOUT_OPS = {
    "Transpose",
    "Reshape",
    "Split",
    "Concat",
    "Slice",
    "Squeeze",
    "Unsqueeze",
    "Gather",
    "Expand",
    "Shape",
    "Flatten",
    "Identity",
    "Cast",
    "Tile",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/profile_ort.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--backbone", default="vit_b16", help="vit_s16, vit_b16, ... (default vit_b16)")
    p.add_argument("--members", type=int, default=3, help="M (default 3)")
    p.add_argument("--heads-per-member", type=int, default=4, help="k (default 4)")
    p.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    p.add_argument("--img-size", type=int, help="input resolution (default: the model's)")
    p.add_argument("--runs", type=int, default=5, help="profiled runs after 2 warm-ups (default 5)")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads (default 2)")
    p.add_argument("--exporter", default="auto", choices=("auto", "dynamo", "torchscript"))
    p.add_argument(
        "--lowering",
        default=DEFAULT_LOWERING,
        choices=LOWERINGS,
        help=f"Hydra's grouped projections (default {DEFAULT_LOWERING})",
    )
    add_output_options(
        p,
        f"JSON (default {DEFAULT_OUT})",
        default=DEFAULT_OUT,
        overwrite_help="replace an existing --out",
    )
    args = p.parse_args(argv)
    if args.runs < 1 or args.batch < 1 or args.threads < 1:
        p.error("--runs, --batch and --threads must be >= 1")
    return args


def node_roles(path: Path) -> dict[str, str]:
    """ONNX node name -> role, from op types and the graph's structure (see the module doc)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    consumers: dict[str, list[Any]] = collections.defaultdict(list)
    for node in graph.node:
        for name in node.input:
            consumers[name].append(node)
    roles: dict[str, str] = {}
    # attention: the MatMuls on both sides of a Softmax; MLP: the MatMuls around an Erf/Gelu
    softmax_inputs = {n.input[0] for n in graph.node if n.op_type == "Softmax"}
    producers = {out: node for node in graph.node for out in node.output}

    def upstream(name: str, depth: int) -> list[Any]:
        found, frontier = [], [name]
        for _ in range(depth):
            nxt = []
            for tensor in frontier:
                node = producers.get(tensor)
                if node is not None:
                    found.append(node)
                    nxt.extend(node.input)
            frontier = nxt
        return found

    for name in softmax_inputs:  # QK^T, scale, mask
        for node in upstream(name, 3):
            if node.op_type in ("MatMul", "Mul", "Div", "Add", "Softmax"):
                roles.setdefault(node.name, "attention")
    for node in graph.node:
        if node.op_type == "Softmax":
            roles[node.name] = "attention"
            for after in consumers[node.output[0]]:
                if after.op_type == "MatMul":
                    roles[after.name] = "attention"
        elif node.op_type in ("Erf", "Gelu", "FastGelu", "BiasGelu"):
            roles[node.name] = "mlp"
        elif node.op_type == "LayerNormalization":
            roles[node.name] = "norm"
        elif node.op_type in LAYOUT_OPS:
            roles[node.name] = "layout"
    # the MLP: MatMul -> (Add) -> GELU pattern -> MatMul; walk from each GELU both ways
    gelu_like = [n for n in graph.node if roles.get(n.name) == "mlp"]
    for gelu in gelu_like:
        for node in upstream(gelu.input[0], 3):
            if node.op_type in ("MatMul", "Gemm", "Add", "Mul", "Div"):
                roles.setdefault(node.name, "mlp")
        frontier = list(gelu.output)
        for _ in range(6):
            nxt = []
            for tensor in frontier:
                for after in consumers[tensor]:
                    if after.op_type in ("Mul", "Add", "Div", "MatMul", "Gemm"):
                        roles.setdefault(after.name, "mlp")
                        if after.op_type in ("MatMul", "Gemm"):
                            # fc2's bias add follows it
                            for bias in consumers[after.output[0]]:
                                if bias.op_type == "Add" and bias.input[1] in initializers:
                                    roles.setdefault(bias.name, "mlp")
                            continue
                        nxt.extend(after.output)
            frontier = nxt
    # qkv / proj: the remaining MatMuls feeding attention (qkv) or fed by it (proj)
    attention_outputs = {
        out
        for n in graph.node
        if roles.get(n.name) == "attention" and n.op_type == "MatMul"
        for out in n.output
    }
    for node in graph.node:
        if node.op_type not in ("MatMul", "Gemm") or node.name in roles:
            continue
        ups = upstream(node.input[0], 6)
        if any(u.output[0] in attention_outputs for u in ups) or node.input[0] in attention_outputs:
            roles[node.name] = "proj"
        else:
            roles[node.name] = "qkv"
        for bias in consumers[node.output[0]]:
            if bias.op_type == "Add" and bias.name not in roles:
                roles[bias.name] = roles[node.name]
    for node in graph.node:
        roles.setdefault(node.name, "residual" if node.op_type == "Add" else "other")
    return roles


def profile(path: Path, feed: dict[str, np.ndarray], runs: int, threads: int, workdir: Path):
    """Per node name: mean kernel microseconds per run; op types; wall ms per run; the optimized
    graph (:func:`hydra_deploy.bench.latency.profile_session`, 2 warm-ups)."""
    found = profile_session(path, feed, runs, threads, workdir)
    return found.per_node_us, found.op_type, found.wall_ms, found.optimized


def role_of(name: str, op: str, roles: dict[str, str]) -> str:
    """A profiled node -> role: by the optimized graph's structure, else by its op type."""
    if name in roles:
        return roles[name]
    if op in ("LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization"):
        return "norm"
    if op in ("Gelu", "FastGelu", "BiasGelu"):
        return "mlp"
    if op in LAYOUT_OPS:
        return "layout"
    return "other"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    refuse_existing(args.out, args.overwrite)
    config = BenchConfig(
        backbone=args.backbone,
        members=args.members,
        heads_per_member=args.heads_per_member,
        batches=(args.batch,),
        backends=("ort",),
        variants=("single", "hydra"),
        threads=args.threads,
        exporter=args.exporter,
        lowering=args.lowering,
        img_size=args.img_size,
    )
    started = time.perf_counter()
    variants = build_variants(config)
    feed = feed_of(variants.input_names, variants.example_inputs(args.batch))
    table, result = [], {"variants": {}}
    with tempfile.TemporaryDirectory(prefix="hydra-profile-") as tmp:
        workdir = Path(tmp)
        for variant in variants.variants:
            note(args, f"exporting {variant.name}")
            paths, done = export_variant(
                variant,
                variants,
                workdir / variant.name,
                exporter=args.exporter,
                max_batch=args.batch,
            )
            note(args, f"profiling {variant.name} ({args.runs} runs at batch {args.batch})")
            per_node, ops, walls, optimized = profile(
                paths[0], feed, args.runs, args.threads, workdir
            )
            roles = node_roles(optimized)
            by_role: dict[str, float] = dict.fromkeys(ROLES, 0.0)
            by_op: dict[str, float] = collections.defaultdict(float)
            for name, us in per_node.items():
                by_role[role_of(name, ops[name], roles)] += us / 1000
                by_op[ops[name]] += us / 1000
            result["variants"][variant.name] = {
                "wall_ms": walls,
                "median_wall_ms": float(np.median(walls)),
                "kernel_ms_by_role": by_role,
                "kernel_ms_by_op": dict(sorted(by_op.items(), key=lambda kv: -kv[1])),
                "exporter": done["exporter"],
                "flops_ratio": variant.flops_ratio,
            }
    single, hydra = result["variants"]["single"], result["variants"]["hydra"]
    flops = role_flops_ratios(variants)
    s_total = sum(single["kernel_ms_by_role"].values())
    h_total = sum(hydra["kernel_ms_by_role"].values())
    for role in ROLES:
        s, h = single["kernel_ms_by_role"][role], hydra["kernel_ms_by_role"][role]
        if s == 0 and h == 0:
            continue
        table.append(
            [
                role,
                f"{s:.1f}",
                f"{h:.1f}",
                f"{h / s:.2f}" if s else "-",
                f"{flops[role]:.2f}" if role in flops else "-",
                f"{100 * (h - s) / max(1e-9, h_total - s_total):.0f}%",
            ]
        )
    table.append(
        [
            "kernels (sum)",
            f"{s_total:.1f}",
            f"{h_total:.1f}",
            f"{h_total / s_total:.2f}",
            f"{hydra['flops_ratio']:.2f}",
            "100%",
        ]
    )
    table.append(
        [
            "wall (median)",
            f"{single['median_wall_ms']:.1f}",
            f"{hydra['median_wall_ms']:.1f}",
            f"{hydra['median_wall_ms'] / single['median_wall_ms']:.2f}",
            f"{hydra['flops_ratio']:.2f}",
            "",
        ]
    )
    header = ["role", "single ms", "hydra ms", "hydra x single", "FLOPs x", "share of the extra"]
    print(
        f"{args.backbone}, M={args.members}, k={args.heads_per_member} ({args.lowering} "
        f"lowering), batch {args.batch}, "
        f"{args.threads} threads, ONNX Runtime CPU ({args.runs} profiled runs)"
    )
    print(print_table(table, header))
    result.update(
        command="python benchmarks/profile_ort.py " + " ".join(argv or sys.argv[1:]),
        settings=vars(args) | {"out": str(args.out)},
        role_flops_ratio=flops,
        environment={**machine(), "versions": versions()},
        seconds=round(time.perf_counter() - started, 1),
    )
    atomic_write_json(args.out, result)
    note(args, f"wrote {args.out}")
    return 0


def role_flops_ratios(variants: Any) -> dict[str, float]:
    """Hydra / single multiply-adds per role, from the backbone's geometry (ViT and BERT)."""
    adapter = variants.adapter
    spec = variants.info["hydra_spec"]
    H = adapter.num_heads
    M = len(spec["members"])
    kept = np.mean([[len(layer) for layer in m["heads"]] for m in spec["members"]])
    return {
        "qkv": M * kept / H,
        "proj": M * kept / H,
        "attention": M * kept / H,
        "mlp": float(M),
        "norm": float(M),
        "residual": float(M),
    }


if __name__ == "__main__":
    try:
        sys.exit(main())
    except HydraError as err:  # a bad setting: one line, as the hydra-* commands answer
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
