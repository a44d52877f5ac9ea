"""Time and peak memory of hydra-export at each precision: FP16, BF16 and INT8 of ViT-B/16.

Each export runs as its own child process (``hydra-export --backbone vit_b16 --precision P``,
random weights, M = 3 members x 4 heads, the default batch profile and validation), one after
the other: its peak resident memory (the child's own ``ru_maxrss``, from ``os.wait4``, as
``/usr/bin/time -v`` reports it), its wall time and its CPU time (user + sys, which other jobs on the machine disturb less than the wall time). The
threads are set explicitly (``--threads``: hydra-export's ``--threads``, and ``OMP_NUM_THREADS``/
``MKL_NUM_THREADS`` for what reads them).

INT8 is static, calibrated (MinMax) on ``--images`` random RGB images (256 x 256 JPEGs, seeded)
written as a class-folder tree: no ImageNet-like data set is available offline, and the cost of
calibration does not depend on what the pictures show. The default calibration size caps it at
256 of them (``--int8-calib-size``).

Written: ``--out`` (JSON) and the same name with ``.md``. Run it from the repository root, alone
on the machine (one ViT-B/16 export at a time)::

    .venv/bin/python benchmarks/export_cost.py --overwrite
    .venv/bin/python benchmarks/export_cost.py --precisions int8 --out /tmp/cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
import numpy as np

PRECISIONS = ("fp16", "bf16", "int8")
RESULTS = Path(__file__).resolve().parent / "results" / "export_cost.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    p.add_argument("--backbone", default="vit_b16")
    p.add_argument("--images", type=int, default=400, help="calibration images (default 400)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--work", type=Path, help="folder for the exports (default: a temporary one)")
    common.add_output_options(p, "the JSON to write", default=RESULTS)
    return p.parse_args(argv)


def write_images(folder: Path, count: int, classes: int = 10) -> Path:
    """``count`` seeded random RGB images, ``folder/class<k>/img<i>.jpg``."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(count):
        target = folder / f"class{i % classes}"
        target.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(target / f"img{i:04d}.jpg", quality=90)
    return folder


def command(args: argparse.Namespace, precision: str, work: Path, calib: Path) -> list[str]:
    line = [sys.executable, "-m", "hydra_deploy.cli.export", "--backbone", args.backbone]
    line += ["--precision", precision, "--out", str(work / precision), "--overwrite"]
    line += ["--threads", str(args.threads)]
    if precision == "int8":
        line += ["--int8-calib", str(calib)]
    return line


def measure(line: list[str], threads: int, log: Path) -> dict:
    """Run ``line`` as a child (its output to ``log``); its wall time, CPU time and peak RSS,
    this child's own (``os.wait4``'s resource usage, what ``/usr/bin/time -v`` reports)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    started = time.perf_counter()
    with log.open("w") as output:
        child = subprocess.Popen(line, env=env, stdout=output, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    if child.returncode != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"{' '.join(line)} failed ({child.returncode}):\n{tail}")
    return {
        "wall_s": round(wall, 1),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "peak_rss_gb": round(usage.ru_maxrss / 1e6, 2),  # kB on Linux
    }


def markdown(report: dict) -> str:
    rows = [
        "| precision | wall | CPU (user + sys) | peak RSS |",
        "|---|---|---|---|",
    ]
    for precision, entry in report["exports"].items():
        rows.append(
            f"| {precision} | {entry['wall_s']:.0f} s | {entry['cpu_s']:.0f} s | "
            f"{entry['peak_rss_gb']:.1f} GB |"
        )
    machine = report["machine"]
    return (
        f"# hydra-export cost: {report['backbone']} (M=3 x 4 heads)\n\n"
        + "\n".join(rows)
        + f"\n\n{report['threads']} threads; INT8: static MinMax on {report['images']} random "
        f"images (256 used); {machine.get('cpu_model', '')}; load average before "
        f"{report['load_before']}, after {report['load_after']}.\n"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    markdown_out = common.refuse_existing(args.out, args.overwrite)
    if markdown_out is None:
        return 1
    with tempfile.TemporaryDirectory(prefix="export-cost-") as scratch:
        work = args.work or Path(scratch)
        calib = work / "calib"
        if "int8" in args.precisions and not calib.exists():
            common.note(args, f"writing {args.images} random calibration images to {calib}")
            write_images(calib, args.images)
        report = {
            "backbone": args.backbone,
            "threads": args.threads,
            "images": args.images,
            "machine": common.machine(),
            "load_before": common.load_average(),
            "exports": {},
        }
        for precision in args.precisions:
            line = command(args, precision, work, calib)
            common.note(args, f"{precision}: {' '.join(line[1:])}")
            report["exports"][precision] = {
                "command": " ".join(["hydra-export", *line[3:]]),
                **measure(line, args.threads, work / f"{precision}.log"),
            }
            common.note(args, f"{precision}: {report['exports'][precision]}")
        report["load_after"] = common.load_average()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    markdown_out.write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
