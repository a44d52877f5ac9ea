"""Write scikit-learn's digits (1,797 labelled 8x8 images, shipped with the package: no download)
as PNG image folders, the labelled data the README and docs/decisions.md use:

- ``train/0/ ... train/9/``: 1,000 images (fine-tuning, head selection);
- ``calib/0/ ... calib/9/``: 500 images (hydra-calibrate, INT8 calibration);
- ``test/0/ ... test/9/``: the other 297 (hydra-eval);
- ``images/``: 10 unlabelled images from the test part (hydra-run, hydra-score-dataset);
- ``noise/``: 50 images of uniform noise, out-of-distribution inputs (hydra-eval --ood,
  hydra-calibrate --ood-check).

The class sub-folders are named by class index (0..9), which the readers take as class indices.
Usage: ``python scripts/digits_data.py [FOLDER]`` (default: the current folder); the split is
fixed (seed 0), so a second run rewrites the same files. Needs scikit-learn and Pillow (the
``dev`` extra).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits

SPLITS = (("train", 1000), ("calib", 500), ("test", None))
UNLABELLED = 10  # test images copied into images/
NOISE = 50  # noise images in noise/


def write_digits(root: Path, sizes: tuple[tuple[str, int | None], ...] = SPLITS) -> dict[str, int]:
    """Write the split into ``root``; returns the number of images in each folder."""
    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))
    counts, start = {}, 0
    for split, size in sizes:
        picks = order[start : None if size is None else start + size]
        start += len(picks)
        for label in range(10):
            (root / split / str(label)).mkdir(parents=True, exist_ok=True)
        for index in picks:
            pixels = (digits.images[index] * 255 / 16).round().astype(np.uint8)
            target = root / split / str(digits.target[index]) / f"{index}.png"
            Image.fromarray(pixels, "L").save(target)
        counts[split] = len(picks)
    (root / "images").mkdir(parents=True, exist_ok=True)
    for index in order[-UNLABELLED:]:
        pixels = (digits.images[index] * 255 / 16).round().astype(np.uint8)
        Image.fromarray(pixels, "L").save(root / "images" / f"digit{index}.png")
    counts["images"] = UNLABELLED
    (root / "noise").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    for index in range(NOISE):
        noise = rng.integers(0, 256, (8, 8), dtype=np.uint8)
        Image.fromarray(noise, "L").save(root / "noise" / f"noise{index}.png")
    counts["noise"] = NOISE
    return counts


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print("usage: python scripts/digits_data.py [FOLDER]", file=sys.stderr)
        return 2
    root = Path(argv[0] if argv else ".")
    counts = write_digits(root)
    print(", ".join(f"{split}/ {count} images" for split, count in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
