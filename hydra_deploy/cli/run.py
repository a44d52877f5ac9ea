"""hydra-run: uncertainty scores for images, text lines or arrays, from an export or an engine."""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hydra_deploy.cli import common
from hydra_deploy.engines.inputs import pick_inputs
from hydra_deploy.engines.scoring import score_batch
from hydra_deploy.errors import HydraError, RunnerError
from hydra_deploy.families import get_family

EXAMPLES = """\
  hydra-run export/vit_b16-m3 images/                    # every image under images/, a table
  hydra-run export/vit_b16-m3 cat.jpg dog.png --top-k 3
  hydra-run export/vit_b16-m3 images/ --json scores.json --batch-size 16
  hydra-run engines/vit_b16-m3.fp16.engine batch.npy --csv scores.csv --overwrite
  hydra-run export/vit_b16-m3/model.onnx arrays.npz --providers cpu --json -   # JSON on stdout
  hydra-run export/minilm-m3 glosses.txt --text "a domesticated carnivorous mammal"   # BERT
"""

ARRAY_SUFFIXES = (".npy", ".npz")
TEXT_SUFFIXES = (".txt", ".csv", ".tsv", ".jsonl", ".json")


def build_parser() -> argparse.ArgumentParser:
    from hydra_deploy.engines.preprocess import IMAGE_SUFFIXES

    p = common.parser(
        "hydra-run",
        "Run a Hydra ensemble (export folder, .onnx file or TensorRT engine) on images or "
        "preprocessed arrays and report, per input, the ensemble prediction and its uncertainty "
        "scores (msp, predictive and expected entropy, mutual information, disagreement). "
        f"Images ({', '.join(IMAGE_SUFFIXES)}; folders are searched recursively, sorted) are "
        "preprocessed as timm's eval transform from the export's hydra.json; .npy/.npz arrays "
        "(npz key 'x' or the model's input name) are taken as already preprocessed.",
        EXAMPLES,
    )
    p.add_argument("model", type=Path, metavar="MODEL", help="export folder, .onnx or engine file")
    p.add_argument(
        "inputs",
        type=Path,
        nargs="*",
        metavar="INPUT",
        help="image files or folders, .npy/.npz arrays, or (text models) .txt files "
        "with one input per line",
    )
    p.add_argument(
        "--text",
        action="append",
        metavar="TEXT",
        help="a text to classify (text models; repeat for more)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        help="examples per forward pass (default: the model's max batch, else 32)",
    )
    out = p.add_mutually_exclusive_group()
    out.add_argument(
        "--json", type=Path, metavar="FILE", help="write the results as JSON ('-': stdout)"
    )
    out.add_argument(
        "--csv", type=Path, metavar="FILE", help="write the results as CSV ('-': stdout)"
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=1,
        metavar="K",
        help="also report the K most probable classes (default 1: the prediction only)",
    )
    p.add_argument(
        "--backend",
        choices=("onnxruntime", "tensorrt"),
        help="default: TensorRT for engine files, ONNX Runtime otherwise",
    )
    p.add_argument(
        "--providers", help="ONNX Runtime providers, comma-separated (cpu,cuda,tensorrt)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --json/--csv file")
    p.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="run inputs holding NaN/inf and pass non-finite logits through (prediction "
        "-1, scores null in JSON, empty in CSV) instead of refusing them",
    )
    return p


@dataclass
class _Source:
    """One input argument: image files, or an array file's examples."""

    kind: str  # "images" | "array" | "text"
    labels: list[str]
    images: list[Path] | None = None
    array: np.ndarray | dict[str, np.ndarray] | None = None
    texts: list[str] | None = None

    def batches(self, runner, size: int) -> Iterator[tuple[list[str], Any]]:
        from hydra_deploy.engines.preprocess import preprocess_images

        for start in range(0, len(self.labels), size):
            labels = self.labels[start : start + size]
            if self.kind == "images":
                yield (
                    labels,
                    preprocess_images(self.images[start : start + size], runner.preprocessing),
                )
            elif self.kind == "text":
                yield labels, runner.text_encoder()(self.texts[start : start + size])
            elif isinstance(self.array, dict):
                yield labels, {k: v[start : start + size] for k, v in self.array.items()}
            else:
                yield labels, self.array[start : start + size]


def _load_array(path: Path, runner) -> np.ndarray | dict[str, np.ndarray]:
    from hydra_deploy.arrays import read_array_file

    names = runner.input_names
    data: Any = read_array_file(
        path,
        error=RunnerError,
        hint="give a complete .npy (np.save) or .npz (np.savez) of preprocessed numeric arrays",
    )
    if isinstance(data, dict):
        data = pick_inputs(data, names, str(path))
    if isinstance(data, dict):
        return data
    from hydra_deploy.engines.runner import is_one_example

    if is_one_example(runner.inputs[0], data.shape):  # one example without its batch axis
        data = data[None]
    return data


def collect_sources(runner, paths: list[Path]) -> list[_Source]:
    """Sort the INPUT arguments into image groups and arrays; refuse what the model cannot take."""
    from hydra_deploy.engines.preprocess import IMAGE_SUFFIXES, find_images

    family = get_family(runner.family or "vit")
    sources: list[_Source] = []
    for path in paths:
        suffix = path.suffix.lower()
        if not path.exists():
            raise RunnerError(f"input {str(path)!r} does not exist")
        if path.is_dir() or suffix in IMAGE_SUFFIXES:
            if family.input_kind != "images":
                raise RunnerError(
                    f"{path}: images need a vision model; MODEL is a {family.name} model"
                )
            images = find_images([path])
            sources.append(_Source("images", [str(p) for p in images], images=images))
        elif suffix in ARRAY_SUFFIXES:
            data = _load_array(path, runner)
            first = next(iter(data.values())) if isinstance(data, dict) else data
            count = len(first) if first.ndim else 0
            if count == 0:
                raise RunnerError(
                    f"the array file {path} holds no examples (shape {first.shape}); give 1 or "
                    "more examples"
                )
            labels = [f"{path}[{i}]" for i in range(count)]
            sources.append(_Source("array", labels, array=data))
        elif suffix == ".txt" and family.text:
            from hydra_deploy.engines.text import read_lines

            lines = read_lines(path)
            labels = [f"{path}:{i}" for i in range(1, len(lines) + 1)]
            sources.append(_Source("text", labels, texts=lines))
        elif suffix in TEXT_SUFFIXES:
            first = runner.inputs[0]
            what = (
                "text models read .txt files (one input per line)"
                if family.text
                else f"text inputs are for text models; MODEL is a {family.name} model taking "
                f"{first.describe()}: give image files, folders or preprocessed .npy/.npz arrays"
            )
            raise RunnerError(f"{path} looks like text: {what}")
        else:
            raise RunnerError(
                f"cannot tell what {str(path)!r} is: give image files ({', '.join(IMAGE_SUFFIXES)}), "
                "folders of images, or .npy/.npz arrays"
            )
    return sources


def _finite_or_none(value: float) -> float | None:
    return float(value) if np.isfinite(value) else None


def _fmt(value: float | None) -> str:
    """A score in the printed table: 4 decimals, ``nan`` for a non-finite one."""
    return "nan" if value is None else f"{value:.4f}"


def score_inputs(
    runner,
    paths: list[Path],
    batch_size: int | None = None,
    top_k: int = 1,
    texts: list[str] | None = None,
    allow_nonfinite: bool = False,
) -> list[dict[str, Any]]:
    """Run ``runner`` over the INPUT paths; one result dict per example, in input order.

    ``allow_nonfinite``: run inputs holding NaN/inf and pass non-finite logits through; such an
    example gets prediction -1 and None for every score (null in JSON, empty in CSV)."""
    from hydra_deploy.uncertainty import SCALAR_SCORES

    sources = collect_sources(runner, paths)
    if texts:
        if not get_family(runner.family or "vit").text:
            raise RunnerError(f"--text needs a text model; MODEL is a {runner.family} model")
        sources.append(
            _Source("text", [f"text[{i}]" for i in range(len(texts))], texts=list(texts))
        )
    if not sources:
        raise RunnerError("nothing to run: give INPUT files or --text")
    if any(s.kind == "images" for s in sources) and not runner.preprocessing:
        raise RunnerError(
            f"{runner.path} comes without its hydra.json, so images cannot be preprocessed for it: "
            "run the export folder (or keep hydra.json beside the file), or pass .npy/.npz arrays"
        )
    size = batch_size or runner.max_batch or 32
    names = runner.class_names
    results: list[dict[str, Any]] = []
    for source in sources:
        for labels, batch in source.batches(runner, size):
            scores = score_batch(
                runner, batch, batch_size=batch_size, allow_nonfinite=allow_nonfinite
            )
            k = max(1, min(top_k, scores["probs"].shape[1]))
            top = np.argsort(-scores["probs"], axis=1, kind="stable")[:, :k]
            for row, label in enumerate(labels):
                prediction = int(scores["prediction"][row])
                result: dict[str, Any] = {
                    "input": label,
                    "prediction": prediction,
                    "label": names[prediction] if names and prediction >= 0 else None,
                }
                result.update({s: _finite_or_none(scores[s][row]) for s in SCALAR_SCORES})
                if top_k > 1:
                    result["top_k"] = [
                        {
                            "class": int(c),
                            "label": names[c] if names else None,
                            "prob": _finite_or_none(scores["probs"][row, c]),
                        }
                        for c in top[row]
                    ]
                results.append(result)
    return results


def _csv_text(results: list[dict[str, Any]]) -> str:
    rows = []
    for result in results:
        row = {k: v for k, v in result.items() if k != "top_k"}
        for rank, entry in enumerate(result.get("top_k", []), start=1):
            row[f"top{rank}_class"] = entry["class"]
            row[f"top{rank}_label"] = entry["label"]
            row[f"top{rank}_prob"] = entry["prob"]
        rows.append(row)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def _write(path: Path, text: str) -> None:
    from hydra_deploy.atomic import atomic_write_text

    if str(path) == "-":
        sys.stdout.write(text)
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text)
    except OSError as err:
        raise HydraError(f"cannot write {path}: {err}") from err


def main_body(args: argparse.Namespace) -> int:
    from hydra_deploy.engines.runner import load_runner
    from hydra_deploy.uncertainty import SCALAR_SCORES

    if args.top_k < 1:
        raise HydraError(f"--top-k must be at least 1, got {args.top_k}")
    if args.batch_size is not None and args.batch_size < 1:
        raise HydraError(f"--batch-size must be at least 1, got {args.batch_size}")
    target = args.json or args.csv
    if target is not None and str(target) != "-":
        common.refuse_existing(target, args.overwrite)
    providers = args.providers.split(",") if args.providers else None
    with load_runner(args.model, backend=args.backend, providers=providers) as runner:
        results = score_inputs(
            runner,
            args.inputs,
            args.batch_size,
            args.top_k,
            args.text,
            allow_nonfinite=args.allow_nonfinite,
        )
        meta = {
            "model": str(args.model),
            "backend": runner.backend,
            "providers": list(runner.providers),
            "precision": runner.precision,
        }
    if args.json is not None:
        report = {**meta, "count": len(results), "results": results}
        _write(args.json, json.dumps(report, indent=2, allow_nan=False) + "\n")
    elif args.csv is not None:
        _write(args.csv, _csv_text(results))
    if target is None:
        if not args.quiet:
            header = ["input", "prediction", *SCALAR_SCORES]
            header.remove("expected_entropy")
            rows = [
                [
                    r["input"],
                    r["label"] if r["label"] is not None else r["prediction"],
                    *(_fmt(r[s]) for s in header[2:]),
                ]
                for r in results
            ]
            print(common.print_table(rows, header))
            if args.top_k > 1:
                for r in results:
                    print(
                        f"{r['input']}: "
                        + ", ".join(
                            f"{e['label'] if e['label'] is not None else e['class']} {_fmt(e['prob'])}"
                            for e in r["top_k"]
                        )
                    )
    elif not args.quiet and str(target) != "-":
        print(
            f"wrote {len(results)} result(s) to {target} ({meta['backend']}, "
            f"{', '.join(meta['providers'])})"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hydra-run``; returns the exit code."""
    args = build_parser().parse_args(argv)
    return common.run(main_body, args)


if __name__ == "__main__":
    sys.exit(main())
