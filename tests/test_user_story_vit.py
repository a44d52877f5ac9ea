"""User story (issue 17): a small timm ViT trained from scratch on scikit-learn's digits, saved in
timm's hub layout, taken through the README's commands.

The model is grayscale (in_chans=1), 16x16 pixels, trained on ``(x - 0.5) / 0.5`` with bilinear
resizing and no crop, and its folder says so (config.json ``model_args`` and ``pretrained_cfg``).
``hydra-export --backbone <folder>`` needs no other flag than the members; ``hydra-run`` on the
test digits as PNG files and ``hydra-eval`` on them as an image folder must give what the same
fused model gives in plain PyTorch on the user's own preprocessing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import save_file
from sklearn.datasets import load_digits

from hydra_deploy.backbones import load_backbone
from hydra_deploy.fusion import fuse
from hydra_deploy.specs import HydraSpec
from hydra_deploy.uncertainty import ensemble_scores
from hydra_deploy.uncertainty.metrics import nll

CLASSES = 4
MODEL_ARGS = {
    "img_size": 16,
    "patch_size": 4,
    "embed_dim": 32,
    "depth": 2,
    "num_heads": 4,
    "in_chans": 1,
}


def user_preprocess(image: Image.Image) -> torch.Tensor:
    """The user's own transform: resize bilinear -> [0, 1] -> (x - 0.5) / 0.5, one channel."""
    pixels = np.asarray(image.convert("L").resize((16, 16), Image.Resampling.BILINEAR), np.float32)
    return (torch.from_numpy(pixels / 255.0)[None] - 0.5) / 0.5


def cli(module: str, *argv: str) -> subprocess.CompletedProcess:
    """Run a console script (``python -m hydra_deploy.cli.<module>``) as a user would."""
    return subprocess.run(
        [sys.executable, "-m", f"hydra_deploy.cli.{module}", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ},
    )


@pytest.fixture(scope="module")
def story(tmp_path_factory):
    root = tmp_path_factory.mktemp("story")
    digits = load_digits()
    keep = digits.target < CLASSES
    images = [
        Image.fromarray((img * 255 / 16).round().astype(np.uint8), "L")
        for img in digits.images[keep]
    ]
    labels = digits.target[keep]
    test_idx = np.concatenate([np.flatnonzero(labels == c)[:6] for c in range(CLASSES)])
    train_idx = np.setdiff1d(np.arange(len(labels)), test_idx)

    # train from scratch, a couple hundred steps
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, num_classes=CLASSES, **MODEL_ARGS
    )
    x = torch.stack([user_preprocess(images[i]) for i in train_idx])
    y = torch.as_tensor(labels[train_idx])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(200):  # ~4 s on one CPU thread; 96% on the test digits
        batch = torch.randint(0, len(x), (64,), generator=generator)
        loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()

    folder = root / "digits-vit"  # timm's hub layout
    folder.mkdir()
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        str(folder / "model.safetensors"),
    )
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architecture": "vit_tiny_patch16_224",
                "num_classes": CLASSES,
                "model_args": MODEL_ARGS,
                "pretrained_cfg": {
                    "mean": [0.5],
                    "std": [0.5],
                    "interpolation": "bilinear",
                    "crop_pct": 1.0,
                    "crop_mode": "center",
                    "input_size": [1, 16, 16],
                },
            }
        )
    )

    test_dir = root / "test"  # the test digits as 8x8 grayscale PNGs, one folder per class
    files = []
    for i in test_idx:
        path = test_dir / str(labels[i]) / f"{i}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        images[i].save(path)
        files.append(path)
    noise_dir = root / "noise" / "none"  # OOD: noise images
    noise_dir.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(8):
        Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8), "L").save(
            noise_dir / f"{i}.png"
        )
    np.savez(root / "raw.npz", x=digits.images[test_idx].astype(np.float32), y=labels[test_idx])
    return {
        "root": root,
        "model": model,
        "folder": folder,
        "files": files,
        "labels": labels[test_idx],
    }


def test_custom_vit_export_run_eval(story):
    root, folder, files = story["root"], story["folder"], story["files"]
    export = root / "export"
    done = cli(
        "export",
        "--backbone",
        str(folder),
        "--members",
        "2",
        "--heads-per-member",
        "2",
        "--max-batch",
        "8",
        "--out",
        str(export),
    )
    assert done.returncode == 0, done.stderr
    assert "WARNING" not in done.stderr and "default" not in done.stderr, done.stderr
    info = json.loads((export / "hydra.json").read_text())
    assert info["preprocessing"] == {
        "input_size": [1, 16, 16],
        "interpolation": "bilinear",
        "mean": [0.5],
        "std": [0.5],
        "crop_pct": 1.0,
        "crop_mode": "center",
    }

    # the same fused model in plain PyTorch, on the user's own preprocessing
    spec = HydraSpec.from_dict(info["spec"])
    hydra = fuse(load_backbone(story["model"]), spec)
    x = torch.stack([user_preprocess(Image.open(f)) for f in files])
    with torch.inference_mode():
        expected_logits = hydra(x).numpy()
    expected = ensemble_scores(expected_logits)
    single = story["model"](x).argmax(1).numpy()
    assert (single == story["labels"]).mean() >= 0.75  # the model learnt something

    from hydra_deploy.engines import load_runner
    from hydra_deploy.engines.preprocess import preprocess_images

    runner = load_runner(export)
    got = runner(preprocess_images(files, runner.preprocessing))["member_logits"]
    np.testing.assert_allclose(got, expected_logits, atol=1e-5, rtol=0)

    done = cli("run", str(export), *map(str, files), "--json", str(root / "run.json"), "--quiet")
    assert done.returncode == 0, done.stderr
    results = json.loads((root / "run.json").read_text())["results"]
    assert [r["prediction"] for r in results] == expected["prediction"].tolist()
    for name in ("msp", "predictive_entropy", "mutual_information"):
        np.testing.assert_allclose([r[name] for r in results], expected[name], atol=1e-5, rtol=0)

    done = cli(
        "eval",
        str(export),
        "--id",
        str(root / "test"),
        "--ood",
        f"noise={root / 'noise'}",
        "--out",
        str(root / "report"),
        "--quiet",
    )
    assert done.returncode == 0, done.stderr
    report = json.loads((root / "report" / "report.json").read_text())["id"]
    assert report["count"] == len(files)
    metrics = report["classification"]
    assert metrics["accuracy"] == pytest.approx((expected["prediction"] == story["labels"]).mean())
    assert metrics["nll"] == pytest.approx(nll(expected["probs"], story["labels"]), abs=1e-5)
    assert metrics["accuracy"] >= 0.75
    # the library, on the fused PyTorch model of the folder, reads images the same way
    from hydra_deploy.evaluation.evaluate import evaluate

    from_folder = fuse(load_backbone(folder), spec)
    assert from_folder.preprocessing == {
        **info["preprocessing"],
        "input_size": (1, 16, 16),
        "mean": (0.5,),
        "std": (0.5,),
    }
    in_torch = evaluate(from_folder, root / "test", {"noise": root / "noise"})
    in_torch = in_torch["id"]["classification"]
    assert in_torch["accuracy"] == metrics["accuracy"]
    assert in_torch["nll"] == pytest.approx(metrics["nll"], abs=1e-5)

    # raw [N, 8, 8] digits given as arrays: the message says what the model expects and what is wrong
    done = cli("run", str(export), str(root / "raw.npz"))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "[N, C, H, W] = [N, 1, 16, 16]" in done.stderr, done.stderr
    assert (
        "without the channel axis" in done.stderr
        and "height 8 vs 16 and width 8 vs 16" in done.stderr
    )
    assert "add the batch axis" not in done.stderr
