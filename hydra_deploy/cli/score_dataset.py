"""hydra-score-dataset: score a data set with an export on a Ray cluster into resumable Parquet parts."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hydra_deploy.cli import common
from hydra_deploy.distributed import score_dataset
from hydra_deploy.distributed.ray_score import DEFAULT_SHARD_SIZE, MANIFEST
from hydra_deploy.errors import counted
from hydra_deploy.options import RunnerOptions, add_options

EXAMPLES = """\
  hydra-score-dataset export/vit_b16-m3 images/ --out scores.parquet        # a local Ray cluster
  hydra-score-dataset export/vit_b16-m3 images/ --out scores.parquet --resume   # after a crash
  hydra-score-dataset export/vit_b16-m3 /data/imagenet/val --out /data/scores.parquet \\
      --address ray://head:10001 --actors 16 --threads 4 --member-logits      # a cluster
  hydra-score-dataset export/minilm-m3 glosses.txt more.txt --out text.parquet --json
  hydra-score-dataset export/vit_b16-m3 images/ --out raw.parquet --raw   # calibrated: scores only
  python -c "import pandas; print(pandas.read_parquet('scores.parquet'))"   # read the result
"""


DESCRIPTION = (
    "Score many images (vision exports) or text lines (text exports) with a Hydra export on "
    "a Ray cluster, in a pool of actors that each run one ONNX Runtime session, and write "
    "OUT as a folder of Parquet parts (one per shard of --shard-size consecutive inputs) "
    "that pandas.read_parquet(OUT) reads as one table in input order. Columns: item (the "
    "path, or file:line for text), shard, prediction, predicted_name (label: its old name, "
    "kept for one release), msp, predictive_entropy, expected_entropy, mutual_information, "
    "disagreement, probs (and member_logits), unreadable; an "
    "export calibrated with hydra-calibrate adds confidence, prediction_set (class indices), "
    "accept and ood_flag for the rules it holds, and prediction is then the calibrated "
    "argmax (--raw: scores only). "
    f"OUT/{MANIFEST} records the model, inputs and options; a part file exists only when "
    "complete, so --resume after a crash scores only the missing shards. An image that "
    "cannot be decoded stops the run (the parts finished before are kept), or with "
    "--skip-unreadable is skipped: a warning names it, its row's unreadable column says why "
    "and its scores are null."
)

#: this command's wording of the runtime options it takes
RUNNER_HELP = {
    "threads": "ONNX Runtime intra-op threads per actor, also the CPUs each actor reserves "
    "(default: the cluster's CPUs / actors, at least 1)",
    "batch_size": "examples per forward pass (default: the export's batch_profile opt from "
    "hydra.json, capped at its max; at most that max)",
}


def build_parser() -> argparse.ArgumentParser:
    p = common.parser("hydra-score-dataset", DESCRIPTION, EXAMPLES)
    p.add_argument(
        "export_dir", type=Path, metavar="EXPORT_DIR", help="export folder (hydra-export --out)"
    )
    p.add_argument(
        "inputs",
        type=Path,
        nargs="+",
        metavar="INPUT",
        help="image files or folders (searched recursively, sorted, as hydra-run); for "
        "text exports .txt files with one input per non-empty line",
    )
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="OUT",
        help="output folder of part-NNNNN.parquet files (e.g. scores.parquet)",
    )
    _add_ray_arguments(p)
    add_options(
        p, RunnerOptions, p, only=("batch_size", "raw", "skip_unreadable"), helps=RUNNER_HELP
    )
    p.add_argument(
        "--shard-size",
        type=int,
        default=DEFAULT_SHARD_SIZE,
        metavar="N",
        help=f"inputs per shard and part file (default {DEFAULT_SHARD_SIZE}); text "
        "lines are sharded the same way, across .txt files",
    )
    p.add_argument(
        "--member-logits",
        action="store_true",
        help="also store every member's logits (list<list<float32>>: members x classes)",
    )
    add_options(p, RunnerOptions, p, only=("allow_decisions_mismatch",))
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--resume",
        action="store_true",
        help="finish an existing OUT: keep its parts, score the missing shards (the "
        "model, inputs, shard size, columns and decisions must match its manifest)",
    )
    mode.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p.add_argument(
        "--json",
        action="store_true",
        help="print a JSON summary on stdout (items, shards done/skipped, seconds, items/s)",
    )
    return p


def _add_ray_arguments(p: argparse.ArgumentParser) -> None:
    """The cluster: where it is, its CPUs, the actors and their threads."""
    ray_args = p.add_argument_group("Ray")
    ray_args.add_argument(
        "--address",
        metavar="ADDR",
        help="join a running cluster: 'auto' (this machine's, from ray start), "
        "HOST:6379, or ray://HOST:10001 (Ray Client: the run goes to the "
        "cluster as one task; paths are made absolute); default: start a "
        "local cluster on this machine for this run. Every node needs "
        "hydra-deploy[ray] and the export, inputs and OUT at the same "
        "paths",
    )
    ray_args.add_argument(
        "--num-cpus",
        type=int,
        metavar="N",
        help="CPUs of the local cluster (default: all of this machine's)",
    )
    ray_args.add_argument(
        "--actors",
        type=int,
        metavar="N",
        help="scoring actors, one ONNX Runtime session each (default: one per 2 "
        "CPUs of the cluster, at least 1)",
    )
    add_options(p, RunnerOptions, ray_args, only=("threads",), helps=RUNNER_HELP)


def main_body(args: argparse.Namespace) -> int:
    runtime = common.options(RunnerOptions, args)
    report = score_dataset(
        args.export_dir,
        args.inputs,
        args.out,
        address=args.address,
        num_cpus=args.num_cpus,
        actors=args.actors,
        threads=runtime.threads,
        batch_size=runtime.batch_size,
        shard_size=args.shard_size,
        member_logits=args.member_logits,
        allow_decisions_mismatch=runtime.allow_decisions_mismatch,
        resume=args.resume,
        overwrite=args.overwrite,
        progress=not args.quiet,
        quiet=args.quiet,
        debug=args.debug,
        decisions=runtime.decisions,
        skip_unreadable=runtime.skip_unreadable,
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    elif not args.quiet:
        skipped = f" ({report.shards_skipped} were done already)" if report.shards_skipped else ""
        if report.shards_done:  # (nothing to do: the library said so)
            print(
                f"wrote {counted(report.shards_done, 'part')} to {report.out}{skipped}: "
                f"{counted(report.items_scored, 'item')} in {report.seconds:.1f} s "
                f"({report.items_per_second:.1f} items/s; "
                f"{report.items_per_second_scoring:.1f} items/s after Ray start-up)"
            )
    return 0


main = common.entry_point(build_parser, main_body, "hydra-score-dataset")


if __name__ == "__main__":
    sys.exit(main())
