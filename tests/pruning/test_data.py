"""load_data and LabelledData: every input kind, seeded loading/resampling, image folders, errors."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import timm
import timm.data
import torch
from helpers.vit import tiny_vit
from PIL import Image
from torch.utils.data import DataLoader, Dataset, TensorDataset

from hydra_deploy.backbones import load_backbone
from hydra_deploy.errors import DataError
from hydra_deploy.pruning import LabelledData, load_data

N = 12
SHAPE = (3, 16, 16)  # the tiny RGB ViT's input
CLASSES = 5  # the tiny RGB ViT's classifier


@pytest.fixture(scope="module")
def rgb_vit():
    """A tiny RGB timm ViT adapter: img_size 16, in_chans 3, 5 classes."""
    return tiny_vit("token")


@pytest.fixture(scope="module")
def gray_vit():
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=16,
        patch_size=4,
        in_chans=1,
        embed_dim=32,
        depth=2,
        num_heads=4,
        num_classes=5,
    )
    return load_backbone(model.eval())


def arrays(n: int = N, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *SHAPE)).astype(np.float32)
    y = (np.arange(n) % CLASSES).astype(np.int64)
    return x, y


def labels_of(data: LabelledData, batch_size: int = 5, **kwargs) -> torch.Tensor:
    ys = [y for _, y in data.loader(batch_size=batch_size, **kwargs)]
    assert all(y.dtype == torch.int64 for y in ys)
    return torch.cat(ys)


def inputs_of(data: LabelledData, **kwargs) -> torch.Tensor:
    return torch.cat([x for x, _ in data.loader(batch_size=5, **kwargs)])


def assert_basic(data: LabelledData, x: np.ndarray, y: np.ndarray) -> None:
    assert isinstance(data, LabelledData)
    assert len(data) == len(y)
    first, label = data.dataset[0]
    first = torch.as_tensor(first)
    assert tuple(first.shape) == x.shape[1:]
    assert first.dtype == torch.float32
    torch.testing.assert_close(first, torch.as_tensor(x[0]))
    assert int(label) == int(y[0])
    loaded = labels_of(data)
    assert loaded.dtype == torch.int64
    assert loaded.tolist() == y.tolist()
    xs = inputs_of(data)
    assert xs.shape == (len(y), *x.shape[1:])
    torch.testing.assert_close(xs, torch.as_tensor(x, dtype=torch.float32))


class MapDataset(Dataset):
    """A plain map-style dataset of (tensor, int) items (no .targets, no TensorDataset)."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int):
        return torch.from_numpy(self.x[index]), int(self.y[index])


# ---------------------------------------------------------------------------------------------------
# input kinds


def test_numpy_pair(rgb_vit):
    x, y = arrays()
    assert_basic(load_data((x, y), rgb_vit), x, y)


def test_torch_pair_and_list_pair(rgb_vit):
    x, y = arrays()
    assert_basic(load_data((torch.from_numpy(x), torch.from_numpy(y)), rgb_vit), x, y)
    assert_basic(load_data([x, y.astype(np.float64)], rgb_vit), x, y)  # whole-valued floats


def test_npz_file(tmp_path, rgb_vit):
    x, y = arrays()
    np.savez(tmp_path / "d.npz", x=x, y=y)
    assert_basic(load_data(tmp_path / "d.npz", rgb_vit), x, y)
    assert_basic(load_data(str(tmp_path / "d.npz"), rgb_vit), x, y)


def test_tensor_dataset_is_used_as_is(rgb_vit):
    x, y = arrays()
    dataset = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    data = load_data(dataset, rgb_vit)
    assert data.dataset is dataset
    assert_basic(data, x, y)


def test_map_style_dataset_and_its_dataloader(rgb_vit):
    x, y = arrays()
    dataset = MapDataset(x, y)
    assert_basic(load_data(dataset, rgb_vit), x, y)
    data = load_data(DataLoader(dataset, batch_size=4, shuffle=True), rgb_vit)
    assert data.dataset is dataset  # the loader's dataset, not its (shuffled) batches
    assert_basic(data, x, y)


def test_generator_of_batches_is_materialised(rgb_vit):
    x, y = arrays()
    batches = (
        (torch.from_numpy(x[i : i + 4]), torch.from_numpy(y[i : i + 4])) for i in range(0, N, 4)
    )
    data = load_data(batches, rgb_vit)
    assert isinstance(data.dataset, TensorDataset)
    assert_basic(data, x, y)
    assert next(batches, None) is None  # read once, fully


def test_generator_stops_at_max_examples(rgb_vit):
    x, y = arrays()
    read = []

    def batches():
        for i in range(0, N, 4):
            read.append(i)
            yield x[i : i + 4], y[i : i + 4]

    gen = batches()
    data = load_data(gen, rgb_vit, max_examples=6)
    assert len(data) == 6
    assert labels_of(data).tolist() == y[:6].tolist()
    assert read == [0, 4]  # stopped after the batch that reached 6 examples
    rest = next(gen)  # not exhausted: the third batch is still there
    np.testing.assert_array_equal(rest[1], y[8:12])


def test_max_examples_on_arrays(rgb_vit):
    x, y = arrays()
    data = load_data((x, y), rgb_vit, max_examples=5)
    assert len(data) == 5
    assert labels_of(data).tolist() == y[:5].tolist()
    assert len(load_data((x, y), rgb_vit, max_examples=100)) == N


def test_labelled_data_passes_through(rgb_vit):
    x, y = arrays()
    data = LabelledData(TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), "mine", ["a"] * 5)
    assert load_data(data, rgb_vit) is data
    assert data.name == "mine" and data.classes == ["a"] * 5
    assert "mine" in repr(data) and str(N) in repr(data)


def test_without_backbone_only_labels_against_num_classes():
    x, y = arrays()
    x = x[:, :1, :4, :4]  # any shape goes without a backbone
    assert len(load_data((x, y))) == N
    assert len(load_data((x, y), num_classes=CLASSES)) == N
    with pytest.raises(DataError, match="classifier has 3 classes"):
        load_data((x, y), num_classes=3)


# ---------------------------------------------------------------------------------------------------
# loader / resample / subset / head


@pytest.fixture()
def data(rgb_vit):
    x, _ = arrays(n=40)
    y = np.arange(40) % CLASSES
    # a label-free identity: example i carries i in its first pixel
    x[:, 0, 0, 0] = np.arange(40)
    return load_data((x, y), rgb_vit)


def order(data: LabelledData, **kwargs) -> list[int]:
    return inputs_of(data, **kwargs)[:, 0, 0, 0].round().long().tolist()


def test_loader_order(data):
    assert order(data) == list(range(40))
    assert order(data, shuffle=True, seed=3) == order(data, shuffle=True, seed=3)
    shuffled = order(data, shuffle=True, seed=3)
    assert shuffled != list(range(40)) and sorted(shuffled) == list(range(40))
    assert order(data, shuffle=True, seed=4) != shuffled


def test_loader_batches(data):
    sizes = [len(y) for _, y in data.loader(batch_size=16)]
    assert sizes == [16, 16, 8]
    assert [len(y) for _, y in data.loader(batch_size=16, drop_last=True)] == [16, 16]
    x, y = next(iter(data.loader(batch_size=7)))
    assert x.shape == (7, *SHAPE) and x.dtype == torch.float32 and y.dtype == torch.int64
    with pytest.raises(DataError, match="batch_size must be at least 1, got 0"):
        data.loader(batch_size=0)


def test_resample_bootstrap(data):
    a, b = data.resample(seed=1), data.resample(seed=1)
    assert order(a) == order(b)
    assert order(data.resample(seed=2)) != order(a)
    assert len(a) == 40
    assert len(set(order(a))) < 40  # 40 draws with replacement from 40 repeat some (p ~ 1 - 1e-16)
    assert len(data.resample(seed=1, fraction=0.25)) == 10
    assert len(data.resample(seed=1, fraction=2.0)) == 80  # with replacement: more than n is fine
    assert a.name == data.name


def test_resample_without_replacement(data):
    sub = data.resample(seed=5, fraction=0.5, replace=False)
    picked = order(sub)
    assert len(picked) == 20 and len(set(picked)) == 20
    assert set(picked) <= set(range(40)) and picked == sorted(picked)
    assert order(data.resample(seed=5, fraction=0.5, replace=False)) == picked
    assert order(data.resample(seed=6, fraction=0.5, replace=False)) != picked
    assert sorted(order(data.resample(seed=5, fraction=1.0, replace=False))) == list(range(40))
    # labels follow their examples
    assert labels_of(sub).tolist() == [i % CLASSES for i in picked]


@pytest.mark.parametrize(("fraction", "replace"), [(0.0, True), (-0.5, True), (1.5, False)])
def test_resample_bad_fraction(data, fraction, replace):
    with pytest.raises(DataError, match="resample fraction"):
        data.resample(seed=0, fraction=fraction, replace=replace)


def test_subset_and_head(data):
    sub = data.subset([3, 1, 7])
    assert order(sub) == [3, 1, 7]
    assert labels_of(sub).tolist() == [3, 1, 2]
    assert order(data.subset(np.array([5, 6]))) == [5, 6]
    assert order(data.head(4)) == [0, 1, 2, 3]
    assert data.head(None) is data and data.head(40) is data and data.head(1000) is data
    assert order(data.head(10).head(3)) == [0, 1, 2]
    with pytest.raises(DataError, match="max_examples must be at least 1"):
        data.head(0)


def test_subsets_keep_name_and_classes():
    dataset = TensorDataset(torch.zeros(6, 1, 2, 2), torch.arange(6) % 3)
    data = LabelledData(dataset, "named", ["a", "b", "c"])
    for derived in (data.subset([0, 1]), data.head(2), data.resample(seed=0, fraction=0.5)):
        assert derived.name == "named" and derived.classes == ["a", "b", "c"]
    assert LabelledData(dataset).classes is None


# ---------------------------------------------------------------------------------------------------
# image folders

FOLDER_CLASSES = ["ant", "bee", "cat"]


def write_images(root: Path, classes=FOLDER_CLASSES, per_class: int = 2, size=(20, 24), seed=0):
    """``per_class`` random RGB PNGs (width x height = ``size``) in ``root/<class>/``."""
    rng = np.random.default_rng(seed)
    for cls in classes:
        (root / cls).mkdir(parents=True)
        for index in range(per_class):
            pixels = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
            Image.fromarray(pixels, "RGB").save(root / cls / f"{index}.png")
    return root


def test_image_folder_rgb(tmp_path, rgb_vit):
    # created out of sorted order: labels must still follow the sorted class names
    root = write_images(tmp_path / "imgs", classes=["cat", "ant", "bee"])
    data = load_data(root, rgb_vit, name="folder")
    assert len(data) == 6
    assert data.classes == FOLDER_CLASSES
    assert data.name == "folder"
    x, _ = data.dataset[0]
    assert tuple(x.shape) == (3, 16, 16) and x.dtype == torch.float32
    assert labels_of(data).tolist() == [0, 0, 1, 1, 2, 2]
    xs = inputs_of(data)
    assert xs.shape == (6, 3, 16, 16)
    # the pixels are exactly timm's eval transform for this model at its own input size
    transform = timm.data.create_transform(
        input_size=(3, 16, 16),
        interpolation="bicubic",
        mean=(0.5, 0.5, 0.5),
        std=(0.5, 0.5, 0.5),
        crop_pct=0.9,
        crop_mode="center",
        is_training=False,
    )
    pretrained = rgb_vit.module.pretrained_cfg
    assert (pretrained["interpolation"], pretrained["crop_pct"]) == ("bicubic", 0.9)
    assert tuple(pretrained["mean"]) == (0.5, 0.5, 0.5)
    image = Image.open(root / "bee" / "1.png").convert("RGB")
    expected = transform(image)
    assert expected.shape == (3, 16, 16)
    torch.testing.assert_close(xs[3], expected)
    torch.testing.assert_close(data.dataset[3][0], expected)
    assert not torch.allclose(xs[3], xs[2])  # different files, different pixels


def test_image_folder_is_lazy_and_reads_targets(tmp_path, rgb_vit, monkeypatch):
    from hydra_deploy.pruning import data as data_module

    root = write_images(tmp_path / "imgs")
    reads = []
    original = data_module._ImageLoader.__call__

    def counting(self, path):
        reads.append(path)
        return original(self, path)

    monkeypatch.setattr(data_module._ImageLoader, "__call__", counting)
    data = load_data(root, rgb_vit)
    assert len(reads) == 1  # only the first image, to check the input shape
    assert data.dataset.targets == [0, 0, 1, 1, 2, 2]
    head = load_data(root, rgb_vit, max_examples=3)
    assert labels_of(head).tolist() == [0, 0, 1]


def test_image_folder_grayscale(tmp_path, gray_vit):
    root = write_images(tmp_path / "imgs", size=(24, 20))
    data = load_data(root, gray_vit)
    x, _ = data.dataset[0]
    assert tuple(x.shape) == (1, 16, 16)
    assert inputs_of(data).shape == (6, 1, 16, 16)
    assert data.classes == FOLDER_CLASSES
    transform = timm.data.create_transform(
        input_size=(1, 16, 16),
        interpolation="bicubic",
        mean=(0.5,),
        std=(0.5,),
        crop_pct=0.9,
        crop_mode="center",
        is_training=False,
    )
    expected = transform(Image.open(root / "ant" / "0.png").convert("L"))
    torch.testing.assert_close(x, expected)


def test_image_folder_non_square_backbone(tmp_path):
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=(8, 16),
        patch_size=4,
        embed_dim=32,
        depth=1,
        num_heads=4,
        num_classes=3,
    )
    data = load_data(write_images(tmp_path / "imgs"), load_backbone(model.eval()))
    assert tuple(data.dataset[0][0].shape) == (3, 8, 16)


def test_image_folder_needs_backbone(tmp_path):
    root = write_images(tmp_path / "imgs")
    with pytest.raises(DataError, match="needs the backbone to know the preprocessing"):
        load_data(root)


def test_image_folder_without_class_folders(tmp_path, rgb_vit):
    (tmp_path / "flat").mkdir()
    Image.new("RGB", (20, 24)).save(tmp_path / "flat" / "loose.png")
    with pytest.raises(DataError, match="no class sub-folders"):
        load_data(tmp_path / "flat", rgb_vit)


def test_image_folder_with_empty_class_folder(tmp_path, rgb_vit):
    root = write_images(tmp_path / "imgs")
    (root / "dog").mkdir()
    (root / "dog" / "notes.txt").write_text("not an image")
    with pytest.raises(DataError, match=r"\['dog'\].*hold no image files"):
        load_data(root, rgb_vit)


def test_image_folder_with_more_classes_than_classifier(tmp_path, rgb_vit):
    root = write_images(tmp_path / "imgs", classes=[f"c{i}" for i in range(7)], per_class=1)
    with pytest.raises(DataError, match=r"has 7 classes .* but the classifier has 5"):
        load_data(root, rgb_vit)
    # fine with a classifier as wide as the folder
    assert load_data(root, rgb_vit, num_classes=7).classes == [f"c{i}" for i in range(7)]


def test_corrupt_image_raises_when_read(tmp_path, rgb_vit):
    root = write_images(tmp_path / "imgs")
    bad = root / "cat" / "9.png"  # sorted last: load_data itself reads only the first image
    bad.write_bytes(b"this is not a png")
    data = load_data(root, rgb_vit)
    assert len(data) == 7
    assert data.dataset[0][0].shape == (3, 16, 16)  # the good ones read
    with pytest.raises(DataError, match=re.escape(str(bad))):
        data.dataset[6]
    with pytest.raises(DataError, match="cannot read image"):
        inputs_of(data)
    (root / "ant" / "0.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")  # the first image
    with pytest.raises(DataError, match=re.escape(str(root / "ant" / "0.png"))):
        load_data(root, rgb_vit)


# ---------------------------------------------------------------------------------------------------
# errors


def test_empty_arrays(rgb_vit):
    with pytest.raises(DataError, match="is empty"):
        load_data((np.zeros((0, *SHAPE), np.float32), np.zeros(0, np.int64)), rgb_vit)


def test_length_mismatch(rgb_vit):
    x, y = arrays()
    with pytest.raises(DataError, match=f"{N} inputs but {N - 1} labels"):
        load_data((x, y[:-1]), rgb_vit)


def test_two_dimensional_labels(rgb_vit):
    x, y = arrays()
    with pytest.raises(DataError, match=r"1-D array of class indices, got shape \[12, 1\]"):
        load_data((x, y[:, None]), rgb_vit)


def test_fractional_labels(rgb_vit):
    x, y = arrays()
    with pytest.raises(DataError, match="fractional"):
        load_data((x, y + 0.5), rgb_vit)


def test_integer_inputs(rgb_vit):
    x, y = arrays()
    with pytest.raises(DataError, match=r"float arrays already preprocessed.*uint8"):
        load_data((x.astype(np.uint8), y), rgb_vit)


@pytest.mark.parametrize("bad", [-1, CLASSES, 17])
def test_label_out_of_range(rgb_vit, bad):
    x, y = arrays()
    y[4] = bad
    with pytest.raises(DataError, match=rf"outside 0\.\.4 \(e\.g\. {bad}\).*has 5 classes"):
        load_data((x, y), rgb_vit)


def test_num_classes_overrides_backbone(rgb_vit):
    x, y = arrays()
    with pytest.raises(DataError, match="has 3 classes"):
        load_data((x, y), rgb_vit, num_classes=3)
    y[0] = 7
    assert len(load_data((x, y), rgb_vit, num_classes=8)) == N


def test_input_shape_differs_from_backbone(rgb_vit, gray_vit):
    x, y = arrays()
    with pytest.raises(DataError, match=r"shape \[3, 8, 8\], the backbone expects \[3, 16, 16\]"):
        load_data((x[:, :, :8, :8], y), rgb_vit)
    with pytest.raises(DataError, match=r"expects \[1, 16, 16\]"):
        load_data((x, y), gray_vit)


def test_missing_path(tmp_path, rgb_vit):
    with pytest.raises(DataError, match="does not exist"):
        load_data(tmp_path / "nope.npz", rgb_vit)


def test_file_neither_folder_nor_npz(tmp_path, rgb_vit):
    (tmp_path / "d.csv").write_text("1,2,3\n")
    with pytest.raises(DataError, match=r"neither an image folder nor a \.npz file"):
        load_data(tmp_path / "d.csv", rgb_vit)


def test_npz_without_y(tmp_path, rgb_vit):
    x, _ = arrays()
    np.savez(tmp_path / "d.npz", x=x, labels=np.zeros(N))
    with pytest.raises(DataError, match=r"lacks \['y'\].*np\.savez"):
        load_data(tmp_path / "d.npz", rgb_vit)


def test_corrupt_npz(tmp_path, rgb_vit):
    (tmp_path / "d.npz").write_bytes(b"PK\x03\x04 definitely not a zip archive")
    with pytest.raises(DataError, match="cannot read"):
        load_data(tmp_path / "d.npz", rgb_vit)


def test_npz_errors_inside_are_data_errors(tmp_path, rgb_vit):
    x, y = arrays()
    np.savez(tmp_path / "d.npz", x=x, y=y[:3])
    with pytest.raises(DataError, match=f"{N} inputs but 3 labels"):
        load_data(tmp_path / "d.npz", rgb_vit)


@pytest.mark.parametrize("batch", [np.zeros((2, *SHAPE), np.float32), (1, 2, 3)])
def test_iterable_of_non_pairs(rgb_vit, batch):
    with pytest.raises(DataError, match="batch 0 is not an \\(inputs, labels\\) pair"):
        load_data(iter([batch]), rgb_vit)


def test_empty_iterable(rgb_vit):
    with pytest.raises(DataError, match="the iterable gave no batches"):
        load_data(iter([]), rgb_vit)


@pytest.mark.parametrize("value", [3, 2.5, None, object()])
def test_unsupported_object(rgb_vit, value):
    with pytest.raises(DataError, match=f"cannot use {type(value).__name__} as data"):
        load_data(value, rgb_vit)


def test_errors_name_the_data(rgb_vit):
    x, y = arrays()
    with pytest.raises(DataError, match=r"^calib: "):
        load_data((x, y[:-1]), rgb_vit, name="calib")


def test_image_folder_of_a_model_with_class_names(tmp_path):
    """A backbone that names its classes (OpenCLIP zero-shot) maps each sub-folder by its name,
    not by sorted position (the rule hydra-eval uses, hydra_deploy.labels)."""
    backbone = tiny_vit("token")
    backbone.class_names = ["dog", "cat", "eel", "bee", "ant"]  # as OpenClipAdapter has them
    root = write_images(tmp_path / "imgs")  # ant, bee, cat
    data = load_data(root, backbone)
    assert labels_of(data).tolist() == [4, 4, 3, 3, 1, 1] and data.classes == backbone.class_names
    write_images(tmp_path / "imgs", classes=["owl"], seed=1)
    with pytest.raises(
        DataError,
        match=r"sub-folder 'owl': label 'owl' is not one of the model's classes: dog, cat",
    ):
        load_data(root, backbone)
