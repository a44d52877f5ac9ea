"""The data a user has, as one labelled-examples type for importance, selection and fine-tuning.

``load_data`` accepts: a ``LabelledData`` (returned as is), an image folder (one sub-folder per
class, torchvision ``ImageFolder`` layout, preprocessed with the backbone's timm eval transform), a
``.npz`` file with ``x``/``y``, an ``(x, y)`` pair of arrays/tensors, a map-style torch ``Dataset`` of ``(input, label)`` items, a
``DataLoader`` (its dataset is used when it is map-style), or any iterable of ``(inputs, labels)``
batches (read once into memory). Inputs are checked against the backbone (shape) and labels against
the classifier (integers in ``[0, num_classes)``); empty data is refused.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from hydra_deploy.errors import DataError


class LabelledData:
    """Labelled examples: a map-style dataset of ``(x [C, H, W] float, y int)`` items."""

    def __init__(
        self, dataset: Dataset, name: str = "data", classes: list[str] | None = None
    ) -> None:
        self.dataset = dataset
        self.name = name
        #: Class names by label index where known (an image folder's sorted sub-folder names).
        self.classes = None if classes is None else list(classes)

    def __len__(self) -> int:
        return len(self.dataset)

    def __repr__(self) -> str:
        return f"LabelledData({self.name!r}, {len(self)} examples)"

    def loader(
        self, batch_size: int = 32, shuffle: bool = False, seed: int = 0, drop_last: bool = False
    ) -> DataLoader:
        """Batches of ``(x [B, ...], y [B] int64)``; shuffling is seeded."""
        if batch_size < 1:
            raise DataError(f"batch_size must be at least 1, got {batch_size}")
        generator = torch.Generator().manual_seed(seed) if shuffle else None
        return DataLoader(
            self.dataset, batch_size=batch_size, shuffle=shuffle, generator=generator,
            drop_last=drop_last, collate_fn=_collate,
        )  # fmt: skip

    def subset(self, indices: Sequence[int]) -> LabelledData:
        return LabelledData(Subset(self.dataset, list(map(int, indices))), self.name, self.classes)

    def resample(self, seed: int, fraction: float = 1.0, replace: bool = True) -> LabelledData:
        """A seeded bootstrap (``replace=True``) or subsample of ``fraction`` of the examples."""
        if not 0.0 < fraction <= (np.inf if replace else 1.0):
            raise DataError(
                f"resample fraction must be above 0 (and at most 1 without replacement), got "
                f"{fraction} with replace={replace}"
            )
        n = len(self)
        size = max(1, round(fraction * n))
        indices = np.random.default_rng(seed).choice(n, size=size, replace=replace)
        return self.subset(np.sort(indices))

    def head(self, max_examples: int | None) -> LabelledData:
        """The first ``max_examples`` examples (all when None)."""
        if max_examples is None or max_examples >= len(self):
            return self
        if max_examples < 1:
            raise DataError(f"max_examples must be at least 1, got {max_examples}")
        return self.subset(range(max_examples))


def _collate(items: list[tuple[Any, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*items, strict=True)
    return torch.stack([torch.as_tensor(x) for x in xs]), torch.as_tensor(
        [int(y) for y in ys], dtype=torch.long
    )


def load_data(
    data: Any,
    backbone: Any = None,
    *,
    num_classes: int | None = None,
    max_examples: int | None = None,
    name: str = "data",
) -> LabelledData:
    """Turn any supported data input into checked ``LabelledData`` (see the module docstring).

    ``backbone`` (an adapter) gives the expected input shape and the number of classes;
    ``num_classes`` overrides the latter; ``max_examples`` keeps the first N examples.
    """
    if isinstance(data, LabelledData):
        labelled = data
    elif isinstance(data, (str, os.PathLike)):
        labelled = _from_path(Path(data), backbone, name)
    elif isinstance(data, (tuple, list)) and len(data) == 2 and _is_array(data[0]):
        labelled = _from_arrays(data[0], data[1], name)
    elif isinstance(data, DataLoader) and _is_map_style(data.dataset):
        labelled = LabelledData(data.dataset, name)
    elif isinstance(data, Dataset) and _is_map_style(data):
        labelled = LabelledData(data, name)
    elif isinstance(data, Iterable):
        labelled = _from_batches(data, name, max_examples)
    else:
        raise DataError(
            f"{name}: cannot use {type(data).__name__} as data; pass an image folder, a .npz file "
            "with x/y, an (x, y) pair, a Dataset, a DataLoader or an iterable of (inputs, labels)"
        )
    labelled = labelled.head(max_examples)
    if num_classes is None and backbone is not None:
        num_classes = backbone.num_classes
    _check(labelled, backbone, num_classes)
    return labelled


def _is_array(value: Any) -> bool:
    return isinstance(value, (np.ndarray, torch.Tensor))


def _is_map_style(dataset: Any) -> bool:
    return hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")


def _from_arrays(x: Any, y: Any, name: str) -> LabelledData:
    x = torch.as_tensor(np.asarray(x) if isinstance(x, np.ndarray) else x)
    y = torch.as_tensor(np.asarray(y) if isinstance(y, np.ndarray) else y)
    if x.shape[0] != y.shape[0]:
        raise DataError(f"{name}: {x.shape[0]} inputs but {y.shape[0]} labels")
    if y.dim() != 1:
        raise DataError(
            f"{name}: labels must be a 1-D array of class indices, got shape {list(y.shape)}"
        )
    if y.is_floating_point() and not bool((y == y.round()).all()):
        raise DataError(f"{name}: labels must be integer class indices, got fractional values")
    if not x.is_floating_point():
        raise DataError(
            f"{name}: inputs must be float arrays already preprocessed (got {x.dtype}); scale and "
            "normalise images as the backbone expects, or pass an image folder"
        )
    return LabelledData(TensorDataset(x.float(), y.long()), name)


def _from_path(path: Path, backbone: Any, name: str) -> LabelledData:
    if not path.exists():
        raise DataError(f"{name}: {str(path)!r} does not exist")
    if path.is_dir():
        return _from_image_folder(path, backbone, name)
    if path.suffix.lower() == ".npz":
        try:
            with np.load(path) as archive:
                missing = {"x", "y"} - set(archive.files)
                if missing:
                    raise DataError(
                        f"{name}: {str(path)!r} lacks {sorted(missing)} (has {archive.files}); save "
                        "it with np.savez(path, x=inputs, y=labels)"
                    )
                return _from_arrays(archive["x"], archive["y"], name)
        except DataError:
            raise
        except Exception as err:
            raise DataError(f"{name}: cannot read {str(path)!r}: {err}") from err
    raise DataError(f"{name}: {str(path)!r} is neither an image folder nor a .npz file")


class _ImageLoader:
    """Opens one image file as a PIL image in ``mode``; a corrupt file raises DataError naming it."""

    def __init__(self, mode: str, name: str) -> None:
        self.mode = mode
        self.name = name

    def __call__(self, path: str) -> Any:
        from PIL import Image

        try:
            with open(path, "rb") as file:
                return Image.open(file).convert(self.mode)
        except Exception as err:
            raise DataError(
                f"{self.name}: cannot read image {path!r} ({type(err).__name__}: {err}); replace "
                "or remove the file"
            ) from err


def _image_transform(backbone: Any, name: str) -> tuple[str, Any]:
    """(PIL mode, timm eval transform) giving ``[in_chans, *img_size]`` tensors for ``backbone``."""
    import timm.data

    in_chans = int(backbone.in_chans)
    if in_chans not in (1, 3):
        raise DataError(
            f"{name}: image folders need a backbone with 1 (grayscale) or 3 (RGB) input channels, "
            f"this one has {in_chans}; pass preprocessed (x, y) arrays instead"
        )
    config = backbone.data_config()
    transform = timm.data.create_transform(**config, is_training=False)
    return ("L" if in_chans == 1 else "RGB"), transform


def _empty_class_folders(path: Path, classes: list[str]) -> list[str]:
    from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension

    def has_images(folder: Path) -> bool:
        return any(
            has_file_allowed_extension(file, IMG_EXTENSIONS)
            for _, _, files in os.walk(folder, followlinks=True)
            for file in files
        )

    return [cls for cls in classes if not has_images(path / cls)]


def _from_image_folder(path: Path, backbone: Any, name: str) -> LabelledData:
    from torchvision.datasets import ImageFolder
    from torchvision.datasets.folder import IMG_EXTENSIONS

    if backbone is None:
        raise DataError(
            f"{name}: {str(path)!r} is an image folder, which needs the backbone to know the "
            "preprocessing (input size, channels, mean/std); pass the backbone to load_data"
        )
    # The class folders exactly as torchvision's ImageFolder finds them (sorted sub-folder names).
    classes = sorted(entry.name for entry in os.scandir(path) if entry.is_dir())
    if not classes:
        raise DataError(
            f"{name}: {str(path)!r} has no class sub-folders; put each class's images in a "
            "sub-folder named after the class (root/cat/x.png, root/dog/y.jpg)"
        )
    mode, transform = _image_transform(backbone, name)
    try:
        dataset = ImageFolder(str(path), transform=transform, loader=_ImageLoader(mode, name))
    except FileNotFoundError as err:  # some class folder holds no image file
        empty = _empty_class_folders(path, classes)
        if not empty:
            raise DataError(f"{name}: cannot list the images in {str(path)!r}: {err}") from err
        raise DataError(
            f"{name}: class folder(s) {empty} in {str(path)!r} hold no image files (extensions: "
            f"{', '.join(IMG_EXTENSIONS)}); add images or remove the folder(s)"
        ) from err
    except OSError as err:
        raise DataError(f"{name}: cannot list the images in {str(path)!r}: {err}") from err
    return LabelledData(dataset, name, list(dataset.classes))


def _from_batches(batches: Iterable, name: str, max_examples: int | None) -> LabelledData:
    xs, ys, count = [], [], 0
    for index, batch in enumerate(batches):
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise DataError(f"{name}: batch {index} is not an (inputs, labels) pair")
        x, y = (torch.as_tensor(v) for v in batch)
        xs.append(x)
        ys.append(y.reshape(-1))
        count += x.shape[0]
        if max_examples is not None and count >= max_examples:
            break
    if not xs:
        raise DataError(f"{name} is empty: the iterable gave no batches")
    return _from_arrays(torch.cat(xs), torch.cat(ys), name)


def _check(labelled: LabelledData, backbone: Any, num_classes: int | None) -> None:
    if len(labelled) == 0:
        raise DataError(f"{labelled.name} is empty")
    x, _ = labelled.dataset[0]
    x = torch.as_tensor(x)
    if backbone is not None and hasattr(backbone, "img_size"):
        expected = (backbone.in_chans, *backbone.img_size)
        if tuple(x.shape) != expected:
            raise DataError(
                f"{labelled.name}: inputs have shape {list(x.shape)}, the backbone expects "
                f"{list(expected)} per example"
            )
    classes = labelled.classes
    if num_classes is not None and classes is not None and len(classes) > num_classes:
        shown = ", ".join(classes[:8]) + (", ..." if len(classes) > 8 else "")
        raise DataError(
            f"{labelled.name} has {len(classes)} classes ({shown}) but the classifier has "
            f"{num_classes}; remove class folders or build the backbone with "
            f"num_classes={len(classes)}"
        )
    if num_classes is not None:
        labels = _all_labels(labelled)
        bad = labels[(labels < 0) | (labels >= num_classes)]
        if bad.size:
            raise DataError(
                f"{labelled.name}: {bad.size} label(s) outside 0..{num_classes - 1} (e.g. {int(bad[0])}); "
                f"the classifier has {num_classes} classes"
            )


def _all_labels(labelled: LabelledData) -> np.ndarray:
    dataset = labelled.dataset
    indices = None
    while isinstance(dataset, Subset):
        indices = dataset.indices if indices is None else [dataset.indices[i] for i in indices]
        dataset = dataset.dataset
    if isinstance(dataset, TensorDataset):
        labels = dataset.tensors[1].numpy()
    elif hasattr(dataset, "targets"):
        labels = np.asarray(dataset.targets)
    else:
        return np.asarray([int(labelled.dataset[i][1]) for i in range(len(labelled))])
    return labels if indices is None else labels[np.asarray(indices, dtype=np.int64)]
