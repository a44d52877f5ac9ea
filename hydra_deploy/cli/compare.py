"""hydra-compare: PyTorch vs ONNX Runtime vs a TensorRT engine, per member and per score."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hydra_deploy.cli import common
from hydra_deploy.evaluation.compare import compare_export
from hydra_deploy.options import RunnerOptions, add_options
from hydra_deploy.threads import use_threads

PROVIDERS_HELP = {"providers": "ONNX Runtime providers, comma-separated (default: CUDA, CPU)"}

EXAMPLES = """\
  hydra-compare export/vit_b16-m3                       # PyTorch vs ONNX Runtime, 8 random inputs
  hydra-compare export/vit_b16-m3 --engine engines/vit_b16-m3.fp16.engine --batch 32
  hydra-compare export/vit_b16-m3 --inputs val_batch.npy --json > parity.json
"""


def build_parser() -> argparse.ArgumentParser:
    p = common.parser(
        "hydra-compare",
        "Run an export in PyTorch (float32 reference, rebuilt from the folder), ONNX Runtime and, "
        "with --engine, a TensorRT engine on the same inputs; report per member the member-logit "
        "max difference and argmax agreement, and per uncertainty score the max difference, "
        "against tolerances that fit each precision (fp32, fp16, bf16, int8: hydra_deploy."
        "parity's table; an argmax is judged only where the reference's top-2 margin exceeds "
        "twice the error bound, near-ties are counted). INT8 activations were calibrated on "
        "data: compare on such data with --inputs. An export calibrated "
        "with hydra-calibrate also gets its decisions compared: calibrated_probs (max "
        "difference) and the share of examples whose prediction set, accept and ood_flag agree "
        "with the reference's (the graph's outputs with --in-graph, else the decisions applied "
        "to the backend's logits; examples within tolerance of a threshold are not counted). "
        "Exits 1 when a tolerance fails: run it after every engine build.",
        EXAMPLES,
    )
    p.add_argument("export_dir", type=Path, metavar="EXPORT_DIR", help="a hydra-export folder")
    p.add_argument("--engine", type=Path, metavar="FILE", help="a TensorRT engine built from it")
    p.add_argument(
        "--inputs",
        type=Path,
        metavar="FILE",
        help="preprocessed inputs (.npy, or .npz with key 'x' or the input name; text "
        "models: .npz with input_ids, attention_mask[, token_type_ids]); default: "
        "--batch of the model's own seeded examples (random pixels, or token ids "
        "with padded rows)",
    )
    p.add_argument("--batch", type=int, default=8, help="random examples when no --inputs (8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (0)")
    add_options(p, RunnerOptions, p, only=("providers", "threads"), helps=PROVIDERS_HELP)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def _table(report) -> str:
    lines = [
        f"{report.export_dir} ({report.precision}), {report.batch} inputs "
        f"({report.inputs}), reference: {report.reference}"
    ]
    for backend in report.backends:
        if backend.status == "skipped":
            lines.append(f"\n{backend.backend}: skipped: {backend.reason}")
            continue
        verdict = "PASS" if backend.passed else "FAIL"
        lines.append(
            f"\n{backend.backend} ({backend.path}), {backend.tolerance.precision} "
            f"tolerances: {verdict}"
        )
        rows = []
        by_member: dict[int, dict] = {}
        for check in backend.members:
            by_member.setdefault(check.member, {})[check.name] = check
        for member, checks in by_member.items():
            logits, argmax = checks["member_logits"], checks["argmax"]
            rows.append(
                [
                    f"member {member}",
                    f"{logits.value:.3g}",
                    f"{logits.bound:.3g}",
                    _agreement(argmax),
                    f">= {100 * argmax.bound:.0f}%",
                    "ok" if logits.passed and argmax.passed else "FAIL",
                ]
            )
        lines.append(
            common.print_table(
                rows, ["member", "logits max diff", "bound", "argmax agree", "needs", "verdict"]
            )
        )
        rows = []
        for check in backend.scores:
            if check.kind == "agreement":
                value, bound = _agreement(check), f">= {100 * check.bound:.0f}%"
            else:
                value = "n/a (ties)" if check.judged == 0 else f"{check.value:.3g}"
                bound = f"<= {check.bound:.3g}"
            rows.append([check.name, check.kind, value, bound, "ok" if check.passed else "FAIL"])
        lines.append(common.print_table(rows, ["score", "measure", "value", "bound", "verdict"]))
        if backend.near_ties()[0]:  # the verdict, with the near-ties it leaves out (parity's rule)
            lines.append(f"{backend.backend}: {backend.verdict()}")
    failures = report.failures()
    lines.append("\n" + ("PASSED" if not failures else "FAILED:\n  " + "\n  ".join(failures)))
    return "\n".join(lines)


def _agreement(check) -> str:
    """An agreement cell: the share, and how many examples were judged when near-ties were left
    out (none judged: every reference example is a near-tie)."""
    if check.judged == 0:
        return "n/a (ties)"
    cell = f"{100 * check.value:.1f}%"
    return cell + (f" of {check.judged}" if check.near_ties else "")


def main_body(args: argparse.Namespace) -> int:
    runtime = common.options(RunnerOptions, args)
    use_threads(runtime.threads, torch=True)  # the PyTorch reference and ONNX Runtime
    report = compare_export(
        args.export_dir,
        engine=args.engine,
        inputs=args.inputs,
        batch=args.batch,
        seed=args.seed,
        providers=runtime.providers,
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    elif not args.quiet:
        print(_table(report))
    if not report.passed:
        if args.quiet or args.json:
            print("error: " + "; ".join(report.failures()), file=sys.stderr)
        return common.EXIT_ERROR
    return 0


main = common.entry_point(build_parser, main_body, "hydra-compare")


if __name__ == "__main__":
    sys.exit(main())
