"""How far FP16 and BF16 move a Hydra ensemble's member logits and uncertainty scores from FP32.

Measured on the CPU, on real-looking inputs, for two models:

- ``digits``: a tiny ViT (16x16 pixels, 1 channel, 3 layers x 4 heads) trained here for 20
  epochs on 1,500 of scikit-learn's digits, Hydra with M=3 members keeping 2 of the 4 heads per
  layer (``HydraSpec.random``, seed 0), each member fine-tuned 2 epochs with its heads
  (``finetune_members``, fused with ``mlp_merge="grouped"``), scored on the 297 held-out digits;
- ``vit_b16``: ``load_backbone("vit_b16")`` with timm's random init (no checkpoint is available
  offline), Hydra with M=3 disjoint members of 4 heads per layer (``HydraSpec.random``, seed 0),
  on crops, flips and rescalings of scikit-learn's two sample photos (china.jpg, flower.jpg)
  preprocessed with timm's eval transform for the model.

Each model is wrapped in the in-graph ensemble head (``WithEnsembleHead``: member logits, probs,
predictive/expected entropy, mutual information, MSP; disagreement comes from
``ensemble_scores``). The FP32 PyTorch model is the reference; against it run, per precision:

- ``torch``: PyTorch under the low-precision graph's policy
  (:func:`hydra_deploy.export.precision.reference_model`: weights and compute in FP16/BF16,
  LayerNorms and the ensemble head in FP32);
- ``torch-w``: the same rounded weights computing in FP32 (``compute="fp32"``): how much of the
  drift is the weights' rounding alone;
- ``ort`` (FP16 only): the exported FP16 file (``export_onnx(..., precision="fp16",
  uq_outputs=True)``) in ONNX Runtime's CPU provider. BF16 files do not run there (no CPU kernels
  for BF16 Expand/MatMul/Softmax: NOT_IMPLEMENTED); the digits BF16 file is exported and loaded to
  record the error, the ViT-B/16 one is not exported.

Reported per member: max and mean absolute logit difference, the max difference relative to the
example's FP32 logit range (max - min over classes), argmax agreement; per score: max and mean
absolute difference against the tolerances of hydra_deploy.parity (FP16: probs/MSP 2e-2, entropies/MI 5e-2,
argmax >= 99%; BF16: 5e-2, 1e-1, >= 98%); the ensemble's argmax agreement; Spearman rank
correlations of MSP, predictive entropy and MI with FP32 (the ordering AUROC depends on); on
digits, accuracy in FP32 and in the low precision. Tables are printed as markdown and written,
with every number and the environment, to ``--out`` (JSON, atomic) and the same name with ``.md``.

PyTorch's FP16 kernels are slow on a CPU (~5-10x FP32); the ViT-B/16 FP16 runs dominate the time.

Run it from the repository root::

    .venv/bin/python benchmarks/precision_drift.py --overwrite
    .venv/bin/python benchmarks/precision_drift.py --models digits --no-ort --out /tmp/drift.json
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import add_output_options, load_average, machine, note, progress_bar, refuse_existing
from torch import nn

from hydra_deploy.atomic import atomic_write_json, atomic_write_text
from hydra_deploy.backbones import load_backbone
from hydra_deploy.export.heads import UQ_OUTPUTS, WithEnsembleHead
from hydra_deploy.export.precision import reference_model
from hydra_deploy.export.validate import DRIFT_TOLERANCE
from hydra_deploy.export_folder import ExportInfo
from hydra_deploy.fusion import HydraModel, fuse
from hydra_deploy.specs import HydraSpec
from hydra_deploy.uncertainty import SCORE_NAMES, ensemble_scores

DEFAULT_OUT = Path("benchmarks/results/precision_drift.json")
MODELS = ("digits", "vit_b16")
PRECISIONS = ("fp16", "bf16")
OUTPUTS = ("member_logits", *UQ_OUTPUTS)
SCORES = SCORE_NAMES
RANKED = ("msp", "predictive_entropy", "mutual_information")  # Spearman vs FP32
RUNTIMES = {
    "torch": "PyTorch, weights and compute in the precision (LayerNorm, ensemble head FP32)",
    "torch-w": "PyTorch, weights rounded to the precision, compute in FP32",
    "ort": "ONNX Runtime CPU, the exported strongly typed file",
}
FINETUNE_EPOCHS, FINETUNE_LR = 2.0, 1e-3  # the digits members, after head pruning
EXAMPLE = """example:
  .venv/bin/python benchmarks/precision_drift.py --overwrite
  .venv/bin/python benchmarks/precision_drift.py --models digits --no-ort --out /tmp/drift.json
"""


# --------------------------------------------------------------------------------------------------
# command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Drift of member logits and uncertainty scores under FP16/BF16 vs FP32 "
        "(PyTorch and ONNX Runtime, CPU).",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=MODELS,
        default=list(MODELS),
        help="models to measure (default: digits vit_b16)",
    )
    parser.add_argument(
        "--images",
        type=int,
        default=16,
        help="photo crops for vit_b16 (default 16; at most 16 x the variants of each photo)",
    )
    parser.add_argument(
        "--batch", type=int, default=8, help="examples per forward pass (default 8)"
    )
    parser.add_argument(
        "--epochs", type=int, default=20, help="training epochs of the digits ViT (default 20)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of everything (default 0)")
    parser.add_argument(
        "--no-ort",
        dest="ort",
        action="store_false",
        help="skip the exported FP16 file in ONNX Runtime",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch and ONNX Runtime intra-op threads (default: torch.get_num_threads() as found)",
    )
    add_output_options(
        parser,
        f"JSON output file (default {DEFAULT_OUT}); the tables go beside it as .md",
        default=DEFAULT_OUT,
        quiet_help="no progress bar or notes",
    )
    args = parser.parse_args(argv)
    if args.images < 1 or args.batch < 1 or args.epochs < 0:
        parser.error("--images and --batch must be >= 1, --epochs >= 0")
    return args


# --------------------------------------------------------------------------------------------------
# models and inputs


@dataclass
class Setup:
    """One model to measure: the FP32 Hydra with its ensemble head, inputs, labels (or None)."""

    name: str
    hydra: HydraModel
    inputs: torch.Tensor
    labels: np.ndarray | None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def model(self) -> nn.Module:
        return WithEnsembleHead(self.hydra).eval()


def digits_tensors(size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits (1,797 8x8 images, 10 classes) upsampled to ``size``, in [-1, 1]."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # [N, 1, 8, 8]
    x = nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    return (x - 0.5) / 0.5, torch.tensor(digits.target, dtype=torch.long)


def build_digits(args: argparse.Namespace) -> Setup:
    """A tiny ViT trained on the first 1,500 digits; M=3 members of 2 of 4 heads, fine-tuned."""
    import timm

    from hydra_deploy.pruning import finetune_members, load_data

    started = time.perf_counter()
    x, y = digits_tensors()
    train = 1500
    torch.manual_seed(args.seed)
    model = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=16,
        patch_size=4,
        in_chans=1,
        embed_dim=32,
        depth=3,
        num_heads=4,
        mlp_ratio=2.0,
        num_classes=10,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    generator = torch.Generator().manual_seed(args.seed)
    model.train()
    for _ in range(args.epochs):
        order = torch.randperm(train, generator=generator)
        for start in range(0, train, 64):
            idx = order[start : start + 64]
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    backbone = load_backbone(model)
    with torch.inference_mode():
        single_accuracy = float((model(x[train:]).argmax(-1) == y[train:]).float().mean())
    spec = HydraSpec.random(
        backbone.name,
        backbone.num_layers,
        backbone.num_heads,
        backbone.head_dim,
        members=3,
        heads_per_member=2,
        seed=args.seed,
    )
    data = load_data((x[:train], y[:train]), backbone, name="digits-train")
    members = finetune_members(
        backbone, spec, data, epochs=FINETUNE_EPOCHS, lr=FINETUNE_LR, seed=args.seed, progress=False
    )
    hydra = fuse(list(members), spec, mlp_merge="grouped").eval()
    info = {
        "backbone": "timm VisionTransformer img 16, patch 4, 1 channel, dim 32, depth 3, 4 heads, "
        f"trained {args.epochs} epochs on 1,500 digits (AdamW 3e-3)",
        "weights": f"trained here; members fine-tuned {FINETUNE_EPOCHS} epochs (lr {FINETUNE_LR:g}) "
        "with their heads, mlp_merge='grouped'",
        "inputs": f"{len(x) - train} held-out scikit-learn digits, 8x8 upsampled to 16x16",
        "members": spec.num_members,
        "heads_per_member": 2,
        "num_heads": backbone.num_heads,
        "head_selection": "HydraSpec.random, seed 0",
        "spec_heads": [m.heads for m in spec.members],
        "single_model_accuracy": single_accuracy,
        "build_s": round(time.perf_counter() - started, 2),
    }
    return Setup("digits", hydra, x[train:].contiguous(), y[train:].numpy(), info)


PHOTO_VIEWS = (
    # (name, (left, top, right, bottom) as fractions of the photo, horizontal flip, downscale)
    ("full", (0.0, 0.0, 1.0, 1.0), False, 1.0),
    ("full-flip", (0.0, 0.0, 1.0, 1.0), True, 1.0),
    ("center-60%", (0.2, 0.2, 0.8, 0.8), False, 1.0),
    ("top-left-55%", (0.0, 0.0, 0.55, 0.55), False, 1.0),
    ("top-right-55%", (0.45, 0.0, 1.0, 0.55), False, 1.0),
    ("bottom-left-55%", (0.0, 0.45, 0.55, 1.0), False, 1.0),
    ("bottom-right-55%-flip", (0.45, 0.45, 1.0, 1.0), True, 1.0),
    ("center-35%-x0.5", (0.325, 0.325, 0.675, 0.675), False, 0.5),
)


def sample_photos(count: int, data_config: dict, seed: int) -> tuple[torch.Tensor, list[str]]:
    """``count`` views of scikit-learn's sample photos through timm's eval transform.

    Views alternate between the photos: the fixed ``PHOTO_VIEWS`` first, then seeded random
    crops (30-90% of the side, random flip) when more are asked for.
    """
    from PIL import Image
    from sklearn.datasets import load_sample_images
    from timm.data import create_transform

    bunch = load_sample_images()
    photos = [Image.fromarray(image) for image in bunch.images]
    names = [Path(f).name for f in bunch.filenames]
    transform = create_transform(**data_config, is_training=False)
    rng = np.random.default_rng(seed)
    tensors, described = [], []
    for index in range(count):
        photo, name = photos[index % len(photos)], names[index % len(photos)]
        view = index // len(photos)
        if view < len(PHOTO_VIEWS):
            label, box, flip, scale = PHOTO_VIEWS[view]
        else:
            side = rng.uniform(0.3, 0.9)
            left, top = rng.uniform(0, 1 - side, size=2)
            label, box, flip, scale = (
                f"random-{view}",
                (left, top, left + side, top + side),
                bool(rng.integers(2)),
                1.0,
            )
        width, height = photo.size
        image = photo.crop(
            tuple(round(f * s) for f, s in zip(box, (width, height) * 2, strict=True))
        )
        if flip:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        if scale != 1.0:
            image = image.resize(
                (round(image.width * scale), round(image.height * scale)), Image.Resampling.BILINEAR
            )
        tensors.append(transform(image))
        described.append(f"{name}:{label}")
    return torch.stack(tensors), described


def build_vit_b16(args: argparse.Namespace) -> Setup:
    started = time.perf_counter()
    torch.manual_seed(args.seed)
    backbone = load_backbone("vit_b16")
    spec = HydraSpec.random(
        backbone.name,
        backbone.num_layers,
        backbone.num_heads,
        backbone.head_dim,
        members=3,
        heads_per_member=4,
        seed=args.seed,
        disjoint=True,
    )
    hydra = fuse(backbone, spec).eval()
    config = backbone.data_config()
    x, views = sample_photos(args.images, config, args.seed)
    info = {
        "backbone": backbone.name,
        "weights": "timm random init (no checkpoint offline)",
        "inputs": f"{len(views)} views of scikit-learn's sample photos, timm eval transform",
        "views": views,
        "data_config": {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()},
        "members": spec.num_members,
        "heads_per_member": 4,
        "num_heads": backbone.num_heads,
        "head_selection": "HydraSpec.random(disjoint=True)",
        "build_s": round(time.perf_counter() - started, 2),
    }
    return Setup("vit_b16", hydra, x, None, info)


BUILDERS = {"digits": build_digits, "vit_b16": build_vit_b16}


# --------------------------------------------------------------------------------------------------
# running


def chunks(total: int, size: int) -> list[slice]:
    return [slice(start, min(start + size, total)) for start in range(0, total, size)]


def run_torch(module: nn.Module, x: torch.Tensor, batch: int, progress: Any) -> dict:
    """All outputs of ``module`` (a WithEnsembleHead or its reference) as float32 numpy arrays."""
    parts: list[tuple[torch.Tensor, ...]] = []
    with torch.inference_mode():
        for part in chunks(len(x), batch):
            parts.append(tuple(o.float() for o in module(x[part])))
            progress.update(part.stop - part.start)
    return {name: torch.cat([p[i] for p in parts]).numpy() for i, name in enumerate(OUTPUTS)}


def ort_session(path: Path, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def export_file(hydra: HydraModel, folder: Path, precision: str, batch: int) -> ExportInfo:
    from hydra_deploy.export import export_onnx

    logger = logging.getLogger("hydra_deploy")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        return export_onnx(
            hydra,
            folder,
            precision=precision,
            uq_outputs=True,
            batch=(1, batch, max(batch, 16)),
            validate=False,
        )
    finally:
        logger.setLevel(level)


def run_ort(session, x: torch.Tensor, batch: int, progress: Any) -> dict:
    input_name = session.get_inputs()[0].name
    names = [o.name for o in session.get_outputs()]
    parts = []
    for part in chunks(len(x), batch):
        parts.append(
            dict(zip(names, session.run(None, {input_name: x[part].numpy()}), strict=True))
        )
        progress.update(part.stop - part.start)
    return {name: np.concatenate([p[name] for p in parts]).astype(np.float32) for name in OUTPUTS}


def with_disagreement(outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    scores = ensemble_scores(outputs["member_logits"], allow_nonfinite=True)
    return {**outputs, "disagreement": scores["disagreement"]}


# --------------------------------------------------------------------------------------------------
# comparing


def spearman(a: np.ndarray, b: np.ndarray) -> float | None:
    from scipy.stats import spearmanr

    if np.ptp(a) == 0 or np.ptp(b) == 0:
        return None  # constant: undefined
    return float(spearmanr(a, b).statistic)


def compare(
    low: dict[str, np.ndarray],
    fp32: dict[str, np.ndarray],
    precision: str,
    labels: np.ndarray | None,
) -> dict[str, Any]:
    """Every drift number of one run against FP32, and the tolerances it exceeds."""
    limits = DRIFT_TOLERANCE[precision]
    z32 = fp32["member_logits"].astype(np.float64)
    zlow = low["member_logits"].astype(np.float64)
    result: dict[str, Any] = {
        "nonfinite_examples": int((~np.isfinite(zlow)).any(axis=(1, 2)).sum())
    }
    members = []
    for m in range(z32.shape[1]):
        diff = np.abs(zlow[:, m] - z32[:, m])  # [B, C]
        spread = z32[:, m].max(-1) - z32[:, m].min(-1)  # [B]
        members.append(
            {
                "member": m,
                "max_abs": float(diff.max()),
                "mean_abs": float(diff.mean()),
                "max_rel_range": float((diff.max(-1) / spread).max()),
                "fp32_logit_range_median": float(np.median(spread)),
                "argmax_agreement": float((zlow[:, m].argmax(-1) == z32[:, m].argmax(-1)).mean()),
            }
        )
    result["members"] = members
    result["member_argmax_agreement"] = float((zlow.argmax(-1) == z32.argmax(-1)).mean())
    scores = {}
    for name in SCORES:
        diff = np.abs(low[name].astype(np.float64) - fp32[name].astype(np.float64))
        tolerance = limits.get(name)
        scores[name] = {
            "max_abs": float(diff.max()),
            "mean_abs": float(diff.mean()),
            "tolerance": tolerance,
            "within": None if tolerance is None else bool(diff.max() <= tolerance),
        }
    result["scores"] = scores
    prediction32, prediction = fp32["probs"].argmax(-1), low["probs"].argmax(-1)
    result["ensemble_argmax_agreement"] = float((prediction == prediction32).mean())
    # argmax flips and how close FP32's top two were there (a flip of a near tie is rounding)
    top2 = np.sort(z32, axis=-1)[..., -2:]
    margins = top2[..., 1] - top2[..., 0]  # [B, M]
    result["fp32_top2_logit_margin_median"] = float(np.median(margins))
    result["member_flips"] = [
        {"example": int(b), "member": int(m), "fp32_top2_logit_margin": float(margins[b, m])}
        for b, m in zip(*np.nonzero(zlow.argmax(-1) != z32.argmax(-1)), strict=True)
    ]
    probs_top2 = np.sort(fp32["probs"].astype(np.float64), axis=-1)[:, -2:]
    result["ensemble_flips"] = [
        {"example": int(b), "fp32_top2_prob_margin": float(probs_top2[b, 1] - probs_top2[b, 0])}
        for b in np.flatnonzero(prediction != prediction32)
    ]
    result["examples"] = len(z32)
    result["spearman"] = {name: spearman(fp32[name], low[name]) for name in RANKED}
    if labels is not None:
        result["accuracy"] = {
            "fp32_ensemble": float((prediction32 == labels).mean()),
            f"{precision}_ensemble": float((prediction == labels).mean()),
            "fp32_members": [
                float((z32[:, m].argmax(-1) == labels).mean()) for m in range(z32.shape[1])
            ],
            f"{precision}_members": [
                float((zlow[:, m].argmax(-1) == labels).mean()) for m in range(z32.shape[1])
            ],
        }
    exceeds = [
        f"{name} max {s['max_abs']:.3g} > {s['tolerance']:g}"
        for name, s in scores.items()
        if s["within"] is False
    ]
    floor = limits["argmax_agreement"]
    for label, value in (
        ("member argmax agreement", result["member_argmax_agreement"]),
        ("ensemble argmax agreement", result["ensemble_argmax_agreement"]),
    ):
        if value < floor:
            exceeds.append(f"{label} {value:.1%} < {floor:.0%}")
    if result["nonfinite_examples"]:
        exceeds.append(f"{result['nonfinite_examples']} example(s) with non-finite logits")
    result["exceeds"] = exceeds
    return result


# --------------------------------------------------------------------------------------------------
# tables


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = [
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---" if i == 0 else "--:" for i in range(len(columns))) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: float | None, spec: str = ".3g") -> str:
    return "n/a" if value is None else format(value, spec)


def model_tables(name: str, result: dict[str, Any]) -> str:
    runs = result["runs"]
    info = result["info"]
    parts = [
        f"### {name}: {info['backbone']}",
        f"{info['inputs']}; weights: {info['weights']}; M={info['members']} x "
        f"{info['heads_per_member']} of {info['num_heads']} heads ({info['head_selection']}).",
    ]
    member_rows = []
    for run, entry in runs.items():
        for m in entry["members"]:
            member_rows.append(
                [
                    run,
                    str(m["member"]),
                    fmt(m["max_abs"]),
                    fmt(m["mean_abs"]),
                    fmt(m["max_rel_range"]),
                    fmt(m["fp32_logit_range_median"]),
                    f"{m['argmax_agreement']:.1%}",
                ]
            )
    parts += [
        "Member logits vs FP32 (`rel` = max |diff| / the example's FP32 logit range):",
        markdown_table(
            [
                "run",
                "member",
                "max abs",
                "mean abs",
                "max rel",
                "FP32 range (median)",
                "argmax agree",
            ],
            member_rows,
        ),
    ]
    score_rows = []
    for run, entry in runs.items():
        for score, s in entry["scores"].items():
            verdict = "-" if s["within"] is None else ("ok" if s["within"] else "**EXCEEDED**")
            score_rows.append(
                [
                    run,
                    score,
                    fmt(s["max_abs"]),
                    fmt(s["mean_abs"]),
                    fmt(s["tolerance"], "g"),
                    verdict,
                ]
            )
    parts += [
        "Uncertainty scores vs FP32:",
        markdown_table(["run", "score", "max abs", "mean abs", "tolerance", "check"], score_rows),
    ]
    agree_rows = []
    has_accuracy = any("accuracy" in entry for entry in runs.values())
    for run, entry in runs.items():
        precision = run.split("/")[0]
        row = [
            run,
            f"{entry['member_argmax_agreement']:.1%}",
            f"{entry['ensemble_argmax_agreement']:.1%}",
            f"{DRIFT_TOLERANCE[precision]['argmax_agreement']:.0%}",
            *(fmt(entry["spearman"][k], ".5f") for k in RANKED),
            flips_cell(entry),
        ]
        if has_accuracy:
            accuracy = entry["accuracy"]
            row += [f"{accuracy['fp32_ensemble']:.2%}", f"{accuracy[f'{precision}_ensemble']:.2%}"]
        agree_rows.append(row)
    columns = [
        "run",
        "member argmax",
        "ensemble argmax",
        "floor",
        *(f"Spearman {k}" for k in RANKED),
        "flips (FP32 top-2 margin)",
    ]
    if has_accuracy:
        columns += ["acc FP32", "acc low"]
    parts += [
        f"Agreement and ranking vs FP32 ({next(iter(runs.values()))['examples']} examples):",
        markdown_table(columns, agree_rows),
    ]
    return "\n\n".join(parts)


def flips_cell(entry: dict[str, Any]) -> str:
    """Argmax flips with FP32's top-2 margin there: members (logits), then the ensemble (probs)."""
    cells = [
        f"m{f['member']} ex{f['example']} ({f['fp32_top2_logit_margin']:.2g})"
        for f in entry["member_flips"][:4]
    ]
    if len(entry["member_flips"]) > 4:
        cells.append(f"+{len(entry['member_flips']) - 4} more")
    cells += [
        f"ens ex{f['example']} ({f['fp32_top2_prob_margin']:.2g})"
        for f in entry["ensemble_flips"][:3]
    ]
    if len(entry["ensemble_flips"]) > 3:
        cells.append(f"+{len(entry['ensemble_flips']) - 3} more")
    return ", ".join(cells) or "none"


def summary_table(results: dict[str, Any]) -> str:
    rows = []
    for name, result in results.items():
        for run, entry in result["runs"].items():
            logits = max(m["max_abs"] for m in entry["members"])
            rel = max(m["max_rel_range"] for m in entry["members"])
            s = entry["scores"]
            rows.append(
                [
                    name,
                    run,
                    fmt(logits),
                    fmt(rel),
                    fmt(s["probs"]["max_abs"]),
                    fmt(s["msp"]["max_abs"]),
                    fmt(s["predictive_entropy"]["max_abs"]),
                    fmt(s["expected_entropy"]["max_abs"]),
                    fmt(s["mutual_information"]["max_abs"]),
                    f"{entry['ensemble_argmax_agreement']:.1%}",
                    "; ".join(entry["exceeds"]) or "none",
                ]
            )
    return markdown_table(
        [
            "model",
            "run",
            "logits max",
            "logits rel",
            "probs",
            "msp",
            "pred H",
            "exp H",
            "MI",
            "ens argmax",
            "exceeded",
        ],
        rows,
    )


# --------------------------------------------------------------------------------------------------
# environment and progress


def environment(threads: int, found: int, load_at_start: list[float] | None) -> dict[str, Any]:
    import onnxruntime
    import scipy
    import timm

    return {
        **machine(),
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "timm": timm.__version__,
        "scipy": scipy.__version__,
        "numpy": np.__version__,
        "threads": threads,
        "torch_threads_found": found,
        "load_average_start": load_at_start,
        "load_average_end": load_average(),
    }


# --------------------------------------------------------------------------------------------------
# main


def measure(setup: Setup, args: argparse.Namespace, threads: int, progress: Any) -> dict[str, Any]:
    model, x, batch = setup.model, setup.inputs, args.batch
    seconds: dict[str, float] = {}

    def timed(label: str, func, *a):
        progress.set_description(f"{setup.name} {label}")
        started = time.perf_counter()
        value = func(*a)
        seconds[label] = round(time.perf_counter() - started, 2)
        return value

    fp32 = with_disagreement(timed("fp32/torch", run_torch, model, x, batch, progress))
    runs: dict[str, Any] = {}
    ort_notes: dict[str, Any] = {}
    for precision in PRECISIONS:
        low = timed(
            f"{precision}/torch", run_torch, reference_model(model, precision), x, batch, progress
        )
        runs[f"{precision}/torch"] = compare(with_disagreement(low), fp32, precision, setup.labels)
        weights_only = timed(
            f"{precision}/torch-w",
            run_torch,
            reference_model(model, precision, compute="fp32"),
            x,
            batch,
            progress,
        )
        runs[f"{precision}/torch-w"] = compare(
            with_disagreement(weights_only), fp32, precision, setup.labels
        )
        if not args.ort:
            continue
        with tempfile.TemporaryDirectory(prefix="precision_drift.") as tmp:
            folder = Path(tmp) / f"{setup.name}-{precision}"
            if precision == "bf16" and setup.name != "digits":
                ort_notes[precision] = (
                    "not exported: ONNX Runtime's CPU provider has no BF16 kernels for "
                    "Expand/MatMul/Softmax (NOT_IMPLEMENTED, as loading the digits BF16 file shows)"
                )
                continue
            info = timed(f"{precision}/export", export_file, setup.hydra, folder, precision, batch)
            try:
                session = ort_session(info.onnx_path, threads)
            except Exception as err:  # onnxruntime raises its own exception types
                message = str(err).strip().splitlines()[0][:300]
                ort_notes[precision] = f"not run: ONNX Runtime cannot load the file: {message}"
                continue
            report = info.precision_report or {}
            ort_notes[precision] = {
                "low_precision_nodes": report.get("low_precision_nodes"),
                "fp32_nodes": report.get("fp32_nodes"),
                "casts": report.get("casts"),
            }
            got = timed(f"{precision}/ort", run_ort, session, x, batch, progress)
            runs[f"{precision}/ort"] = compare(
                with_disagreement(got), fp32, precision, setup.labels
            )
    fp32_scores = {
        name: {
            "min": float(np.min(fp32[name])),
            "median": float(np.median(fp32[name])),
            "max": float(np.max(fp32[name])),
        }
        for name in ("member_logits", *SCORES)
    }
    return {
        "info": setup.info,
        "fp32_ranges": fp32_scores,
        "runs": runs,
        "ort": ort_notes,
        "seconds": seconds,
    }


def images_per_model(name: str, args: argparse.Namespace) -> int:
    examples = 297 if name == "digits" else args.images
    runs = 1 + 2 * len(PRECISIONS) + (1 if args.ort else 0)  # fp32, torch, torch-w, ort fp16
    return examples * runs


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    markdown_out = refuse_existing(args.out, args.overwrite)
    if markdown_out is None:
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    logging.getLogger("hydra_deploy").setLevel(logging.ERROR if args.quiet else logging.WARNING)
    found = torch.get_num_threads()
    threads = found if args.threads is None else args.threads
    torch.set_num_threads(threads)
    load_at_start = load_average()
    if load_at_start and load_at_start[0] > 0.5:
        note(
            args,
            f"note: load average {load_at_start[0]} at start; other processes share the "
            "CPU (only the run times are affected)",
        )

    results: dict[str, Any] = {}
    total = sum(images_per_model(name, args) for name in args.models)
    with progress_bar(total, args.quiet, unit="img") as progress:
        for name in args.models:
            progress.set_description(f"building {name}")
            setup = BUILDERS[name](args)
            results[name] = measure(setup, args, threads, progress)
            del setup

    sections = [summary_table(results)]
    sections += [model_tables(name, result) for name, result in results.items()]
    ort_lines = [
        f"- {name} {precision} in ONNX Runtime: "
        + (note_ if isinstance(note_, str) else "run (the exported file)")
        for name, result in results.items()
        for precision, note_ in result["ort"].items()
    ]
    wall = time.perf_counter() - started
    exceeded = [
        f"{name} {run}: {item}"
        for name, result in results.items()
        for run, entry in result["runs"].items()
        for item in entry["exceeds"]
    ]
    env = environment(threads, found, load_at_start)
    header = (
        "# Precision drift: FP16 / BF16 vs FP32\n\n"
        f"Created {datetime.now(timezone.utc).isoformat(timespec='seconds')} by "
        f"`benchmarks/precision_drift.py` (wall time {wall:.0f} s; torch {env['torch']}, "
        f"onnxruntime {env['onnxruntime']}, {env['cpu_model']}, {threads} threads).\n\n"
        "Runs: " + "; ".join(f"`{k}`: {v}" for k, v in RUNTIMES.items()) + ". Tolerances from "
        "hydra_deploy.parity (FP16: probs/MSP 2e-2, entropies/MI 5e-2, argmax >= 99%; BF16: 5e-2, "
        "1e-1, >= 98%); disagreement and member logits are reported only.\n"
    )
    body = "\n\n".join(
        ["## Summary (max abs differences)", *sections[:1], "## Per model", *sections[1:]]
    )
    footer = "\n".join(
        [
            "",
            "## ONNX Runtime",
            *ort_lines,
            "",
            "## Exceeded tolerances",
            *(f"- {item}" for item in exceeded or ["none"]),
        ]
    )
    markdown = f"{header}\n{body}\n{footer}\n"
    print(markdown)
    atomic_write_json(
        args.out,
        {
            "benchmark": "precision_drift",
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "environment": env,
            "arguments": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "runtimes": RUNTIMES,
            "tolerances": DRIFT_TOLERANCE,
            "results": results,
            "exceeded": exceeded,
            "wall_time_s": round(wall, 1),
        },
    )
    atomic_write_text(markdown_out, markdown)
    print(f"wrote {args.out} and {markdown_out} (wall time {wall:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
