"""Throughput of hydra-score-dataset (Ray Data actors) against in-process scoring, same run.

The model: ``load_backbone("vit_s16")`` at 224 x 224 with timm's random init (no checkpoint is
available offline; throughput does not depend on the weights), Hydra with M=3 members keeping 4
of the 6 heads per layer (``HydraSpec.random``, seed 0), exported with batch profile
(1, 8, 16). The data: ``--images`` JPEGs (default 256) cut from scikit-learn's two sample photos
(random crops of 160-420 pixels, flips), so that decoding and timm's eval preprocessing are part
of the work, as on a real data set.

Measured, one after the other on this machine:

- ``in-process``: hydra-run's path (:func:`hydra_deploy.engines.sources.score_inputs`): one runner with 2
  ONNX Runtime threads, batches of 8; its time includes loading the session;
- ``ray 1x2`` and ``ray 2x1``: :func:`hydra_deploy.distributed.score_dataset` on a new local Ray
  cluster (2 CPUs) with 1 actor x 2 threads and 2 actors x 1 thread, batch 8, shards of
  ``--shard-size`` (default 64), Parquet parts written. ``wall`` includes starting and stopping
  the cluster; ``scoring`` excludes the cluster start (``ray.init``) but includes starting the
  actors and loading their sessions.

Each Ray run's scores are checked against the in-process ones (max |probs difference|). Ratios are
items/s over the in-process items/s of the same run (> 1: faster). Written: ``--out`` (JSON) and
the same name with ``.md``.

Run it from the repository root::

    .venv/bin/python benchmarks/score_dataset.py --overwrite
    .venv/bin/python benchmarks/score_dataset.py --images 64 --backbone vit_ti16 --heads-per-member 2 --out /tmp/s.json
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from common import add_output_options, load_average, machine, note, refuse_existing

from hydra_deploy.atomic import atomic_write_json, atomic_write_text
from hydra_deploy.cli.common import print_table

DEFAULT_OUT = Path("benchmarks/results/score_dataset.json")
PROG = ".venv/bin/python benchmarks/score_dataset.py"
RAY_CONFIGS = ((1, 2), (2, 1))  # (actors, threads per actor) on 2 CPUs


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.split("\n\n", 1)[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--backbone", default="vit_s16", help="timm ViT name or alias (default vit_s16)"
    )
    parser.add_argument("--members", type=int, default=3, help="Hydra members (default 3)")
    parser.add_argument(
        "--heads-per-member",
        type=int,
        default=4,
        help="heads kept per member and layer (default 4)",
    )
    parser.add_argument("--images", type=int, default=256, help="JPEGs to score (default 256)")
    parser.add_argument("--batch", type=int, default=8, help="batch size (profile opt; default 8)")
    parser.add_argument("--shard-size", type=int, default=64, help="images per shard (default 64)")
    parser.add_argument(
        "--cpus",
        type=int,
        default=2,
        help="CPUs of the local Ray cluster and threads in-process (default 2)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of everything (default 0)")
    add_output_options(
        parser,
        f"JSON report (default {DEFAULT_OUT}; .md beside it)",
        default=DEFAULT_OUT,
        quiet_help="no notes on stderr",
    )
    return parser.parse_args(argv)


def build_export(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    import torch

    from hydra_deploy.backbones import load_backbone
    from hydra_deploy.export import export_onnx
    from hydra_deploy.fusion import fuse
    from hydra_deploy.specs import HydraSpec

    torch.manual_seed(args.seed)
    backbone = load_backbone(args.backbone)
    spec = HydraSpec.random(
        backbone.name,
        backbone.num_layers,
        backbone.num_heads,
        backbone.head_dim,
        args.members,
        args.heads_per_member,
        seed=args.seed,
        disjoint=args.members * args.heads_per_member <= backbone.num_heads,
    )
    info = export_onnx(
        fuse(backbone, spec), folder, batch=(1, args.batch, 2 * args.batch), validate=False
    )
    return {
        "backbone": backbone.name,
        "img_size": list(info.preprocessing_config.input_size[1:]),
        "members": args.members,
        "heads_per_member": args.heads_per_member,
        "layers": backbone.num_layers,
        "heads": backbone.num_heads,
        "macs_per_example": info.macs_per_example["hydra"],
    }


def make_images(folder: Path, count: int, seed: int) -> None:
    from PIL import Image
    from sklearn.datasets import load_sample_image

    rng = np.random.default_rng(seed)
    photos = [load_sample_image("china.jpg"), load_sample_image("flower.jpg")]
    folder.mkdir(parents=True)
    for index in range(count):
        photo = photos[index % 2]
        h, w = (int(v) for v in rng.integers(160, 421, 2))
        y, x = int(rng.integers(0, photo.shape[0] - h)), int(rng.integers(0, photo.shape[1] - w))
        crop = photo[y : y + h, x : x + w]
        if rng.random() < 0.5:
            crop = crop[:, ::-1]
        Image.fromarray(np.ascontiguousarray(crop)).save(folder / f"img{index:04d}.jpg", quality=90)


def in_process(
    export: Path, images: Path, args: argparse.Namespace
) -> tuple[dict[str, Any], np.ndarray]:
    from hydra_deploy.engines import load_runner
    from hydra_deploy.engines.preprocess import find_images, preprocess_images
    from hydra_deploy.engines.sources import score_inputs
    from hydra_deploy.uncertainty import ensemble_scores

    begin = time.perf_counter()
    runner = load_runner(export, providers=["cpu"], threads=args.cpus)
    loaded = time.perf_counter()
    results = score_inputs(runner, [images], batch_size=args.batch)
    wall = time.perf_counter() - begin
    files = find_images([images])  # the reference probs for the Ray runs (not timed)
    probs = np.concatenate(
        [
            ensemble_scores(
                runner(preprocess_images(files[i : i + 64], runner.preprocessing))["member_logits"]
            )["probs"]
            for i in range(0, len(files), 64)
        ]
    )
    row = {
        "name": "in-process",
        "actors": 1,
        "threads": args.cpus,
        "items": len(results),
        "wall_s": wall,
        "ray_start_s": 0.0,
        "scoring_s": wall,
        "session_load_s": loaded - begin,
    }
    return row, probs


def on_ray(
    export: Path,
    images: Path,
    work: Path,
    actors: int,
    threads: int,
    args: argparse.Namespace,
    reference: np.ndarray,
) -> dict[str, Any]:
    import pyarrow.parquet as pq

    from hydra_deploy.distributed import score_dataset

    out = work / f"scores-{actors}x{threads}.parquet"
    begin = time.perf_counter()
    report = score_dataset(
        export,
        [images],
        out,
        num_cpus=args.cpus,
        actors=actors,
        threads=threads,
        batch_size=args.batch,
        shard_size=args.shard_size,
        providers=["cpu"],
        progress=False,
        quiet=True,
    )
    wall = time.perf_counter() - begin
    probs = np.array(pq.read_table(out, columns=["probs"])["probs"].to_pylist())
    return {
        "name": f"ray {actors}x{threads}",
        "actors": actors,
        "threads": threads,
        "items": report.items_scored,
        "wall_s": wall,
        "ray_start_s": report.ray_start_seconds,
        "scoring_s": report.scoring_seconds,
        "shards": report.shards,
        "max_abs_probs_diff": float(np.abs(probs - reference).max()),
    }


def with_ratios(rows: list[dict[str, Any]]) -> None:
    base = rows[0]
    for row in rows:
        row["items_per_s"] = row["items"] / row["wall_s"]
        row["items_per_s_excl_start"] = row["items"] / row["scoring_s"]
    for row in rows:
        row["ratio"] = row["items_per_s"] / base["items_per_s"]
        row["ratio_excl_start"] = row["items_per_s_excl_start"] / base["items_per_s"]


HEADER = [
    "run",
    "actors x threads",
    "wall s",
    "Ray start s",
    "scoring s",
    "items/s",
    "items/s excl. start",
    "x in-process",
    "x in-process excl. start",
]


def table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    return [
        [
            r["name"],
            f"{r['actors']} x {r['threads']}",
            f"{r['wall_s']:.1f}",
            f"{r['ray_start_s']:.1f}",
            f"{r['scoring_s']:.1f}",
            f"{r['items_per_s']:.1f}",
            f"{r['items_per_s_excl_start']:.1f}",
            f"{r['ratio']:.2f}",
            f"{r['ratio_excl_start']:.2f}",
        ]
        for r in rows
    ]


def markdown(result: dict[str, Any], command: str) -> str:
    model = result["model"]
    lines = [
        "# hydra-score-dataset throughput",
        "",
        f"{model['backbone']} at {model['img_size'][0]}x{model['img_size'][1]}, random weights, "
        f"Hydra M={model['members']} x {model['heads_per_member']} of {model['heads']} heads per "
        f"layer; {result['config']['images']} JPEGs (decoded and preprocessed in the timed "
        f"work), batch {result['config']['batch']}, shards of {result['config']['shard_size']}; "
        f"{result['machine']['cpu_count']} CPUs ({result['machine']['cpu_model']}), load average "
        f"{result['load_average_start']} at start, {result['load_average_end']} at the end.",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
        *("| " + " | ".join(row) + " |" for row in table_rows(result["runs"])),
        "",
        "`wall`: the whole call (a Ray run: starting the local cluster, the actors and their "
        "sessions, scoring, writing Parquet, shutting the cluster down). `excl. start`: without "
        "`ray.init` (actor start-up still counted). Ratios: items/s over the in-process items/s "
        "of this run.",
        "",
        "Largest |probs difference| of a Ray run from in-process: "
        + ", ".join(f"{r['name']} {r['max_abs_probs_diff']:.1e}" for r in result["runs"][1:])
        + ".",
        "",
        f"Reproduce: `{command}`",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    markdown_out = refuse_existing(args.out, args.overwrite)
    if markdown_out is None:
        return 2
    logging.getLogger("hydra_deploy").setLevel(logging.ERROR)
    load_start = load_average()
    if load_start and load_start[0] > 0.5:
        note(args, f"note: load average {load_start[0]} at start; other processes share the CPU")
    work = Path(tempfile.mkdtemp(prefix="score-dataset-bench-"))
    try:
        note(args, f"exporting {args.backbone} (M={args.members} x {args.heads_per_member} heads)")
        model = build_export(args, work / "export")
        note(args, f"writing {args.images} JPEGs")
        make_images(work / "images", args.images, args.seed)
        note(args, "in-process (hydra-run's path)")
        base, reference = in_process(work / "export", work / "images", args)
        rows = [base]
        for actors, threads in RAY_CONFIGS:
            note(
                args,
                f"hydra-score-dataset on a local cluster: {actors} actor(s) x {threads} thread(s)",
            )
            rows.append(
                on_ray(work / "export", work / "images", work, actors, threads, args, reference)
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    with_ratios(rows)
    import onnxruntime
    import ray

    from hydra_deploy import __version__

    command = f"{PROG} " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {
        "benchmark": "score_dataset",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command.strip(),
        "model": model,
        "config": {
            "images": args.images,
            "batch": args.batch,
            "shard_size": args.shard_size,
            "cpus": args.cpus,
            "seed": args.seed,
        },
        "runs": [
            {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in rows
        ],
        "machine": machine(),
        "versions": {
            "hydra-deploy": __version__,
            "ray": ray.__version__,
            "onnxruntime": onnxruntime.__version__,
            "numpy": np.__version__,
        },
        "load_average_start": load_start,
        "load_average_end": load_average(),
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(print_table(table_rows(rows), HEADER))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, result)
    atomic_write_text(markdown_out, markdown(result, result["command"]))
    note(args, f"wrote {args.out} and {markdown_out} in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
