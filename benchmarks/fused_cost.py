"""CPU cost of a fused Hydra ensemble against one model and a sequential deep ensemble.

What it measures, per backbone (random-weight timm ViT-S/16 and ViT-B/16 by default) and batch
size, with PyTorch on the CPU under ``torch.inference_mode()``:

- ``single``: the timm VisionTransformer itself;
- ``hydra``: ``fuse(backbone, HydraSpec.random(..., disjoint=True))`` -- M members keeping k
  heads each per layer, all different (disjoint where M x k fits in the layer's heads; otherwise
  the members' head sets overlap, which the report notes);
- ``hydra_trunk``: the same with ``shared_layers=--trunk-layers``: the first layers are one
  shared stream (checked: ``model.trunk_layers`` must equal ``--trunk-layers``);
- ``deep_ensemble_seq``: M independent timm models (own random weights) run one after another.

After warm-up, every round times each variant once, in a rotating order, so that machine noise
hits all variants alike. It reports the median latency and its spread, the latency ratio against
``single`` (medians of the same run), the analytic FLOPs (MACs) ratio, ``gap = latency ratio /
FLOPs ratio``, MACs per image and parameters, then the acceptance checks:

- ``hydra gap <= 1.15`` (binding at ``--gap-batch``, default 8; informational elsewhere);
- ``hydra < deep_ensemble``: hydra's median latency is below the sequential ensemble's;
- ``hydra_trunk < hydra``: the shared trunk is faster still.

Results go to a JSON file (written atomically). The exit status is 0 (it is a report) unless
``--strict`` is given; then it is 1 when a binding check fails.

Run it from the repository root::

    .venv/bin/python benchmarks/fused_cost.py
    .venv/bin/python benchmarks/fused_cost.py --backbones vit_s16 --batch 8 --repeats 3 --overwrite
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from common import load_average, machine, note, progress_bar
from torch import nn

from hydra_deploy.atomic import atomic_write_json
from hydra_deploy.backbones import BackboneAdapter, load_backbone
from hydra_deploy.errors import SpecError
from hydra_deploy.fusion import HydraModel, fuse
from hydra_deploy.specs import HydraSpec

DEFAULT_OUT = Path("benchmarks/results/fused_cost.json")
VARIANTS = ("single", "hydra", "hydra_trunk", "deep_ensemble_seq")
EXAMPLE = """example:
  .venv/bin/python benchmarks/fused_cost.py
  .venv/bin/python benchmarks/fused_cost.py --backbones vit_b16 --batch 8 --repeats 5 --overwrite
"""


# --------------------------------------------------------------------------------------------------
# command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Latency and FLOPs of single model vs fused Hydra vs sequential deep ensemble "
        "(PyTorch, CPU).",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--backbones",
        nargs="+",
        default=["vit_s16", "vit_b16"],
        help="backbone aliases or timm names (default: vit_s16 vit_b16)",
    )
    parser.add_argument(
        "--batch", nargs="+", type=int, default=[1, 8], help="batch sizes (default: 1 8)"
    )
    parser.add_argument("--members", type=int, default=3, help="ensemble members M (default 3)")
    parser.add_argument(
        "--heads-per-member",
        type=int,
        default=4,
        help="heads each member keeps per layer (default 4)",
    )
    parser.add_argument(
        "--trunk-layers",
        type=int,
        default=6,
        help="shared leading layers of hydra_trunk (default 6)",
    )
    parser.add_argument(
        "--repeats", type=int, default=7, help="timed runs per variant and batch (default 7)"
    )
    parser.add_argument(
        "--warmup", type=int, default=2, help="untimed runs per variant and batch first (default 2)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch.get_num_threads() as found)",
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"JSON output file (default {DEFAULT_OUT})"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    parser.add_argument(
        "--max-gap",
        type=float,
        default=1.15,
        help="largest accepted hydra latency/FLOPs gap (default 1.15)",
    )
    parser.add_argument(
        "--gap-batch",
        type=int,
        default=8,
        help="batch size at which the gap check is binding (default 8)",
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 when a binding check fails (default: always exit 0)",
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bar, notes or warnings (tables and checks still print)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of weights, specs and inputs")
    args = parser.parse_args(argv)  # fmt: skip
    for name in ("members", "heads_per_member", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or args.trunk_layers < 0:
        parser.error("--warmup and --trunk-layers must be >= 0")
    if any(b < 1 for b in args.batch):
        parser.error("--batch sizes must be >= 1")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be >= 1")
    return args


# --------------------------------------------------------------------------------------------------
# variants


@dataclass
class Variant:
    """One thing to time: a callable on the input batch plus its analytic cost."""

    name: str
    run: Callable[[torch.Tensor], torch.Tensor]
    macs_per_image: int
    flops_ratio: float
    parameters: int


@dataclass
class BackboneSetup:
    """The built variants of one backbone and what was checked about them."""

    name: str
    adapter: BackboneAdapter
    variants: list[Variant]
    info: dict[str, Any] = field(default_factory=dict)


def seeded_backbone(name: str, seed: int) -> BackboneAdapter:
    """A random-weight backbone whose weights depend on ``seed`` only."""
    torch.manual_seed(seed)
    return load_backbone(name)


def make_spec(adapter: BackboneAdapter, args: argparse.Namespace, shared_layers: int) -> HydraSpec:
    """M members x k heads, pairwise different; disjoint when M x k fits in one layer."""
    return HydraSpec.random(
        adapter.name, adapter.num_layers, adapter.num_heads, adapter.head_dim,
        args.members, args.heads_per_member,
        shared_layers=shared_layers, disjoint=can_be_disjoint(adapter, args), seed=args.seed,
    )  # fmt: skip


def can_be_disjoint(adapter: BackboneAdapter, args: argparse.Namespace) -> bool:
    return args.members * args.heads_per_member <= adapter.num_heads


def fused_variant(name: str, model: HydraModel) -> Variant:
    macs = model.macs
    return Variant(
        name, model, macs["hydra"], macs["hydra"] / macs["single"], model.num_parameters()
    )


def ensemble_variant(modules: Sequence[nn.Module], macs: dict[str, int]) -> Variant:
    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.stack([module(x) for module in modules], dim=1)  # [B, M, C], one after another

    parameters = sum(p.numel() for module in modules for p in module.parameters())
    ratio = macs["deep_ensemble"] / macs["single"]
    return Variant("deep_ensemble_seq", run, macs["deep_ensemble"], ratio, parameters)


def build_backbone(name: str, args: argparse.Namespace) -> BackboneSetup:
    """Build the four variants of one backbone (all modules up front)."""
    adapter = seeded_backbone(name, args.seed)
    if args.trunk_layers > adapter.num_layers:
        raise SystemExit(
            f"--trunk-layers {args.trunk_layers} > {name}'s {adapter.num_layers} layers"
        )
    hydra = fuse(adapter, make_spec(adapter, args, shared_layers=0))
    trunk = fuse(adapter, make_spec(adapter, args, shared_layers=args.trunk_layers))
    if hydra.trunk_layers != 0:
        raise RuntimeError(
            f"{name}: hydra has a shared trunk of {hydra.trunk_layers} layers, expected 0"
        )
    if trunk.trunk_layers != args.trunk_layers:
        raise RuntimeError(
            f"{name}: hydra_trunk has trunk_layers={trunk.trunk_layers}, expected "
            f"{args.trunk_layers}; the fused model does not share the requested leading layers"
        )
    members = [seeded_backbone(name, args.seed + 1 + m).module for m in range(args.members)]
    single_macs = adapter.macs()
    variants = [
        Variant("single", adapter.module, single_macs, 1.0, adapter.num_parameters()),
        fused_variant("hydra", hydra),
        fused_variant("hydra_trunk", trunk),
        ensemble_variant(members, hydra.macs),
    ]
    info = {
        "num_layers": adapter.num_layers, "num_heads": adapter.num_heads,
        "head_dim": adapter.head_dim, "num_classes": adapter.num_classes,
        "disjoint": can_be_disjoint(adapter, args),
        "hydra_merge": hydra.merge, "hydra_trunk_merge": trunk.merge,
        "macs_check": {"single_adapter": single_macs, "single_fused": hydra.macs["single"]},
    }  # fmt: skip
    return BackboneSetup(name, adapter, variants, info)


def check_outputs(setup: BackboneSetup, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """The fused models give finite member logits [B, M, C]; raises otherwise."""
    x = setup.adapter.example_inputs(batch, args.seed)
    expected = (batch, args.members, setup.adapter.num_classes)
    report: dict[str, Any] = {"batch": batch, "expected_shape": list(expected)}
    with torch.inference_mode():
        for variant in setup.variants:
            if not variant.name.startswith("hydra"):
                continue
            out = variant.run(x)
            if tuple(out.shape) != expected or not bool(torch.isfinite(out).all()):
                raise RuntimeError(
                    f"{setup.name} {variant.name}: output shape {tuple(out.shape)} (expected "
                    f"{expected}), finite={bool(torch.isfinite(out).all())}"
                )
            spread = float((out - out.mean(dim=1, keepdim=True)).abs().max())
            report[variant.name] = {"shape": list(out.shape), "finite": True,
                                    "max_member_deviation": spread}  # fmt: skip
    return report


# --------------------------------------------------------------------------------------------------
# timing


def rotated(items: Sequence[Variant], shift: int) -> list[Variant]:
    shift %= len(items)
    return [*items[shift:], *items[:shift]]


def time_once(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> float:
    start = time.perf_counter()
    run(x)
    return time.perf_counter() - start


def time_variants(
    variants: Sequence[Variant], x: torch.Tensor, args: argparse.Namespace, progress: Any
) -> dict[str, list[float]]:
    """Warm-up, then interleaved rounds; returns each variant's raw times in seconds."""
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    with torch.inference_mode():
        for variant in variants:
            for _ in range(args.warmup):
                variant.run(x)
                progress.update(1)
        for round_index in range(args.repeats):
            gc.collect()
            for variant in rotated(variants, round_index):
                times[variant.name].append(time_once(variant.run, x))
                progress.update(1)
    return times


def spread(seconds: Sequence[float]) -> dict[str, Any]:
    ms = [1000.0 * s for s in seconds]
    if len(ms) >= 2:
        q1, _, q3 = statistics.quantiles(ms, n=4, method="inclusive")
    else:
        q1 = q3 = ms[0]
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms),
            "q1_ms": q1, "q3_ms": q3, "times_ms": ms}  # fmt: skip


def summarize(variants: Sequence[Variant], times: dict[str, list[float]]) -> dict[str, Any]:
    base = statistics.median(times["single"])
    rows: dict[str, Any] = {}
    for variant in variants:
        stats = spread(times[variant.name])
        ratio = statistics.median(times[variant.name]) / base
        rows[variant.name] = {
            **stats,
            "ratio_vs_single": ratio,
            "flops_ratio": variant.flops_ratio,
            "gap": ratio / variant.flops_ratio,
            "macs_per_image": variant.macs_per_image,
            "parameters": variant.parameters,
        }
    return rows


def run_checks(
    backbone: str, batch: int, rows: dict[str, Any], args: argparse.Namespace
) -> list[dict[str, Any]]:
    hydra, trunk = rows["hydra"], rows["hydra_trunk"]
    ensemble = rows["deep_ensemble_seq"]

    def check(name: str, passed: bool, required: bool, detail: str) -> dict[str, Any]:
        return {"backbone": backbone, "batch": batch, "check": name, "passed": bool(passed),
                "required": required, "detail": detail}  # fmt: skip

    return [
        check(f"hydra gap <= {args.max_gap:g}", hydra["gap"] <= args.max_gap,
              batch == args.gap_batch, f"gap {hydra['gap']:.3f}"),
        check("hydra < deep_ensemble", hydra["median_ms"] < ensemble["median_ms"], True,
              f"{hydra['median_ms']:.1f} ms vs {ensemble['median_ms']:.1f} ms"),
        check("hydra_trunk < hydra", trunk["median_ms"] < hydra["median_ms"], True,
              f"{trunk['median_ms']:.1f} ms vs {hydra['median_ms']:.1f} ms"),
    ]  # fmt: skip


# --------------------------------------------------------------------------------------------------
# output


COLUMNS = ("variant", "latency_ms", "IQR_ms", "min-max_ms", "ratio_vs_single", "flops_ratio",
           "gap", "GMACs/img", "params_M")  # fmt: skip


def table_rows(rows: dict[str, Any]) -> list[list[str]]:
    out = []
    for name, r in rows.items():
        out.append([
            name, f"{r['median_ms']:.1f}", f"{r['q3_ms'] - r['q1_ms']:.1f}",
            f"{r['min_ms']:.1f}-{r['max_ms']:.1f}", f"{r['ratio_vs_single']:.3f}",
            f"{r['flops_ratio']:.3f}", f"{r['gap']:.3f}", f"{r['macs_per_image'] / 1e9:.3f}",
            f"{r['parameters'] / 1e6:.1f}",
        ])  # fmt: skip
    return out


def print_table(title: str, rows: dict[str, Any]) -> None:
    body = table_rows(rows)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print_plain_table(title, body)
        return
    table = Table(title=title, title_justify="left")
    for index, column in enumerate(COLUMNS):
        table.add_column(column, justify="left" if index == 0 else "right", no_wrap=True)
    for row in body:
        table.add_row(*row)
    Console(width=None if sys.stdout.isatty() else 160).print(table)


def print_plain_table(title: str, body: list[list[str]]) -> None:
    widths = [max(len(c), *(len(r[i]) for r in body)) for i, c in enumerate(COLUMNS)]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        return "  ".join([first, *(c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))])

    print(title)
    print(line(COLUMNS))
    print("  ".join("-" * w for w in widths))
    for row in body:
        print(line(row))
    print()


def check_line(check: dict[str, Any]) -> str:
    verdict = "PASS" if check["passed"] else "FAIL"
    note = "" if check["required"] else "  (informational)"
    return (f"{check['backbone']} batch {check['batch']}: {check['check']}: {verdict} "
            f"({check['detail']}){note}")  # fmt: skip


def environment(
    threads: int, found_threads: int, load_at_start: list[float] | None
) -> dict[str, Any]:
    import timm

    return {
        **machine(),
        "torch": torch.__version__,
        "timm": timm.__version__,
        "torch_threads": threads,
        "torch_threads_found": found_threads,
        "torch_interop_threads": torch.get_num_interop_threads(),
        "load_average_start": load_at_start,
        "load_average_end": load_average(),
    }


# --------------------------------------------------------------------------------------------------
# main


def benchmark_backbone(
    setup: BackboneSetup, args: argparse.Namespace, progress: Any
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    result: dict[str, Any] = {"info": setup.info, "batches": {}}
    checks: list[dict[str, Any]] = []
    for batch in args.batch:
        progress.set_description(f"{setup.name} batch {batch}")
        x = setup.adapter.example_inputs(batch, args.seed)
        times = time_variants(setup.variants, x, args, progress)
        rows = summarize(setup.variants, times)
        batch_checks = run_checks(setup.name, batch, rows, args)
        result["batches"][str(batch)] = {"variants": rows, "checks": batch_checks}
        checks += batch_checks
    return result, checks


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    if args.out.exists() and not args.overwrite:
        print(f"error: {args.out} exists; pass --overwrite to replace it", file=sys.stderr)
        return 2
    if args.quiet:
        logging.getLogger("hydra_deploy").setLevel(logging.ERROR)
    found_threads = torch.get_num_threads()
    threads = found_threads if args.threads is None else args.threads
    torch.set_num_threads(threads)
    load_at_start = load_average()
    if load_at_start and load_at_start[0] > 0.5 and not args.quiet:
        print(f"note: load average {load_at_start[0]} at start; other processes share the CPU, "
              "so latencies may be noisy", file=sys.stderr)  # fmt: skip

    results: dict[str, Any] = {}
    checks: list[dict[str, Any]] = []
    total = len(args.backbones) * len(args.batch) * len(VARIANTS) * (args.warmup + args.repeats)
    with progress_bar(total, args.quiet, unit="run") as progress:
        for name in args.backbones:
            progress.set_description(f"building {name}")
            try:
                setup = build_backbone(name, args)
            except SpecError as err:
                print(f"error: {name}: {err}", file=sys.stderr)
                return 2
            if not setup.info["disjoint"]:
                heads, wanted = setup.adapter.num_heads, args.members * args.heads_per_member
                note(args, f"note: {name} has {heads} heads < M x k = {wanted}; "
                     "the hydra members' head sets overlap (not disjoint)")  # fmt: skip
            setup.info["output_check"] = check_outputs(setup, args.batch[0], args)
            results[name], new_checks = benchmark_backbone(setup, args, progress)
            checks += new_checks
            del setup
            gc.collect()

    for name, result in results.items():
        for batch, entry in result["batches"].items():
            print_table(f"{name}, batch {batch} ({threads} threads, {args.repeats} rounds)",
                        entry["variants"])  # fmt: skip
    for check in checks:
        print(check_line(check))

    wall = time.perf_counter() - started
    atomic_write_json(args.out, {
        "benchmark": "fused_cost",
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "environment": environment(threads, found_threads, load_at_start),
        "arguments": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "results": results,
        "checks": checks,
        "all_required_passed": all(c["passed"] for c in checks if c["required"]),
        "wall_time_s": wall,
    })  # fmt: skip
    print(f"wrote {args.out} (wall time {wall:.0f} s)")
    failed = [c for c in checks if c["required"] and not c["passed"]]
    return 1 if (args.strict and failed) else 0


if __name__ == "__main__":
    sys.exit(main())
