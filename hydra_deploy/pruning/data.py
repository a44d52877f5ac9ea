"""The data a user has, as one labelled-examples type for importance, selection and fine-tuning.

``load_data`` accepts: a ``LabelledData`` (returned as is), an image folder (one sub-folder per
class, torchvision ``ImageFolder`` layout, preprocessed with the backbone's timm eval transform;
the sorted sub-folder names are classes ``0, 1, ...``, unless the backbone names its classes, as
an OpenCLIP zero-shot classifier does: then each sub-folder is the class of its name), a
``.npz`` file with ``x``/``y``, an ``(x, y)`` pair of arrays/tensors, a map-style torch ``Dataset`` of ``(input, label)`` items, a
``DataLoader`` (its dataset is used when it is map-style), or any iterable of ``(inputs, labels)``
batches (read once into memory). Inputs are checked against the backbone (shape) and labels against
the classifier (integers in ``[0, num_classes)``); empty data is refused.

Text (a backbone with token inputs, family ``bert``) is stored as one int64 tensor per example,
``[2 or 3, L]``: ``input_ids``, ``attention_mask`` (1 = token, 0 = padding) and, when given,
``token_type_ids``, padded to one length ``L`` for the whole set; batches are ``[B, 2|3, L]``, the
stacked form the adapter takes, so batching, subsets and bootstrap resampling work as for images.
Text data can be:

- a ``.npz`` with ``input_ids`` [N, L], ``y`` [N] and optionally ``attention_mask`` (default: all
  ones) and ``token_type_ids``; or with ``x`` already stacked [N, 2|3, L] (int) and ``y``;
- an ``(inputs, y)`` pair: ``inputs`` a dict of int arrays/tensors (``input_ids``,
  ``attention_mask``, ``token_type_ids``, e.g. a tokenizer's output), the stacked [N, 2|3, L] int
  tensor, or bare ``input_ids`` [N, L] (no padding); or one dict that also holds ``labels``/``label``;
- a map-style ``Dataset`` (or a ``DataLoader`` over one) whose items are ``(inputs, label)`` (inputs
  as above, without the batch axis) or dicts with a ``label``/``labels`` entry; a ``DataLoader`` or
  iterable yielding such batches (lengths may differ between batches: all are padded to the longest);
- a labelled text file ``.tsv``: one example per line, ``label<TAB>text`` (or
  ``label<TAB>text<TAB>second text`` for sentence pairs, on every line), blank lines skipped,
  tokenized with ``AutoTokenizer.from_pretrained(backbone.tokenizer_dir)``, truncated to
  ``backbone.seq_len`` tokens and padded to the longest line of the file. A label is a class index
  (``0``..``C-1``) or a class name, mapped by the rule ``hydra-eval`` uses too
  (:func:`hydra_deploy.labels.label_indices`): names are looked up among the model's class names
  (``backbone.class_names``: a BERT checkpoint's ``config.id2label``; a name that is not one of
  them, a header line for instance, is refused); a model without names takes the distinct names
  in sorted order as classes ``0, 1, ...`` (warned) only when there are exactly as many as it has
  classes, and refuses them otherwise. ``LabelledData.classes`` lists the names by index. One file
  uses either indices or names on every line.

Files (``.tsv``, ``.txt``, the class sub-folders of an image folder) are read by
:mod:`hydra_deploy.userdata`, the reader ``hydra-eval``, ``hydra-calibrate``, ``hydra-run`` and
``hydra-score-dataset`` share; this module tokenizes and wraps what it reads as torch datasets.

:func:`load_inputs` reads inputs alone (labels ignored or absent; OOD sets): the same formats, plus
arrays/dicts/tensors without labels and, for text, a ``.txt`` file with one text per line.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from hydra_deploy.arrays import read_array_file
from hydra_deploy.backbones.hf_bert import TEXT_INPUT_NAMES, check_text_keys
from hydra_deploy.errors import DataError, counted, said, spelled
from hydra_deploy.labels import folder_class_indices
from hydra_deploy.optional import lazy_module
from hydra_deploy.userdata import class_folders, read_text_file

transformers = lazy_module("transformers", purpose="tokenizing text data", error=DataError)
timm = lazy_module("timm", purpose="preprocessing images", error=DataError)
torchvision = lazy_module("torchvision", purpose="reading image folders", error=DataError)
pil_image = lazy_module("PIL.Image", purpose="reading images", error=DataError)

logger = logging.getLogger("hydra_deploy")

#: The text inputs, in the order of the stacked [N, 2|3, L] form.
TEXT_KEYS = TEXT_INPUT_NAMES
#: Keys of a dict item/batch that hold its labels (Hugging Face datasets use "label"/"labels").
LABEL_KEYS = ("labels", "label", "y")


class LabelledData:
    """Labelled examples: a map-style dataset of ``(x, y int)`` items.

    ``x`` is a float image ``[C, H, W]`` or, for text, the int64 stack ``[2 or 3, L]`` of
    ``input_ids``, ``attention_mask`` (and ``token_type_ids``), every example padded to one ``L``.
    """

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
            self.dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            generator=generator,
            drop_last=drop_last,
            collate_fn=_collate,
        )

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

    ``backbone`` (an adapter) gives the expected input shape (or, for text, the vocabulary, the
    positions and the tokenizer) and the number of classes; ``num_classes`` overrides the latter;
    ``max_examples`` keeps the first N examples.
    """
    labelled = _load(data, backbone, max_examples, name)
    if num_classes is None and backbone is not None:
        num_classes = backbone.num_classes
    _check(labelled, backbone, num_classes)
    return labelled


def load_inputs(
    data: Any, backbone: Any = None, *, max_examples: int | None = None, name: str = "inputs"
) -> torch.Tensor:
    """Inputs alone as one tensor (labels ignored, and not needed): OOD sets.

    Takes what :func:`load_data` takes, plus an array/tensor (or, for text, a dict of token arrays)
    of inputs without labels, a ``.npz`` without ``y`` and, for a text backbone, a ``.txt`` file
    (one text per line) or a ``.tsv`` whose labels may be any strings. Text comes back stacked
    [N, 2|3, L] int64; images [N, C, H, W] float32. Inputs are checked against ``backbone``.
    """
    text = is_text_backbone(backbone)
    if isinstance(data, (str, os.PathLike)) and Path(data).suffix.lower() in (
        ".npz",
        ".txt",
        ".tsv",
    ):
        path = Path(data)
        if not path.is_file():
            raise DataError(f"{name}: {str(path)!r} does not exist")
        if path.suffix.lower() == ".npz":
            x = _npz_arrays(path, name, text, need_labels=False)[0]
            if isinstance(x, Mapping):  # input_ids, attention_mask, ...
                x = _stack_text(x, name)
            else:
                _refuse_non_numeric(x, "inputs", name)
                x = torch.as_tensor(x)
                x = (
                    _stack_text(x, name, backbone)
                    if text or not x.is_floating_point()
                    else x.float()
                )
        else:
            x = _from_text_file(path, backbone, name, labelled=False).dataset.tensors[0]
    elif isinstance(data, Mapping) and not any(key in data for key in LABEL_KEYS):
        x = _stack_text(data, name)
    elif _is_array(data):
        x = torch.as_tensor(np.asarray(data) if isinstance(data, np.ndarray) else data)
        x = _stack_text(x, name, backbone) if text or not x.is_floating_point() else x.float()
    else:
        x = _tensors_of(_load(data, backbone, max_examples, name))
    x = x[:max_examples] if max_examples else x
    if x.shape[0] == 0:
        raise DataError(f"{name} is empty")
    if x.is_floating_point() and text:
        _refuse_floats_for_text(x, backbone, name)
    if x.is_floating_point():
        _refuse_nonfinite(x, name)
    if not x.is_floating_point():
        _check_text(x, backbone, name)
    return x


def is_text_backbone(backbone: Any) -> bool:
    """Whether ``backbone`` takes token inputs (an adapter with ``text_inputs``: family bert)."""
    return backbone is not None and callable(getattr(backbone, "text_inputs", None))


def _load(data: Any, backbone: Any, max_examples: int | None, name: str) -> LabelledData:
    """``data`` as LabelledData (first ``max_examples``), before the checks against the backbone."""
    text = is_text_backbone(backbone)
    if isinstance(data, LabelledData):
        labelled = data
    elif isinstance(data, (str, os.PathLike)):
        labelled = _from_path(Path(data), backbone, name)
    elif (
        isinstance(data, (tuple, list))
        and len(data) == 2
        and (_is_array(data[0]) or isinstance(data[0], Mapping))
    ):
        labelled = _from_arrays(data[0], data[1], name, backbone)
    elif isinstance(data, Mapping):
        inputs, labels = _split_labels(data, name, "the dict")
        labelled = _from_arrays(inputs, labels, name, backbone)
    elif text and isinstance(data, DataLoader):
        labelled = _text_from_loader(data, name, max_examples)
    elif text and isinstance(data, Dataset) and _is_map_style(data):
        labelled = _text_from_dataset(data, name, max_examples)
    elif isinstance(data, DataLoader) and _is_map_style(data.dataset):
        labelled = LabelledData(data.dataset, name)
    elif isinstance(data, Dataset) and _is_map_style(data):
        labelled = LabelledData(data, name)
    elif isinstance(data, Iterable):
        labelled = _from_batches(data, name, max_examples, backbone)
    else:
        raise DataError(
            f"{name}: cannot use {type(data).__name__} as data; pass an image folder, a .npz file "
            "with x/y, an (x, y) pair, a Dataset, a DataLoader or an iterable of (inputs, labels)"
            + (
                "; for text also a .tsv file (label<TAB>text per line) or (dict of token arrays, y)"
                if text
                else ""
            )
        )
    return labelled.head(max_examples)


def _is_array(value: Any) -> bool:
    return isinstance(value, (np.ndarray, torch.Tensor))


def _is_map_style(dataset: Any) -> bool:
    return hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")


def _refuse_non_numeric(value: Any, what: str, name: str) -> None:
    """DataError for a numpy array torch cannot hold (strings, objects): a traceback otherwise."""
    if isinstance(value, np.ndarray) and value.dtype.kind not in "biufc":
        hint = (
            "map class names to indices 0..C-1 first"
            if what == "labels"
            else "save preprocessed float inputs (text models: integer token ids)"
        )
        raise DataError(
            f"{name}: {what} must be numbers, got an array of dtype {value.dtype}; {hint}"
        )


def _labels_tensor(y: Any, count: int, name: str) -> torch.Tensor:
    _refuse_non_numeric(y, "labels", name)
    y = torch.as_tensor(np.asarray(y) if isinstance(y, (np.ndarray, list, tuple)) else y)
    if count != (y.shape[0] if y.dim() else 1):
        given = y.shape[0] if y.dim() else 1
        raise DataError(f"{name}: {counted(count, 'input')} but {counted(given, 'label')}")
    if y.dim() != 1:
        raise DataError(
            f"{name}: labels must be a 1-D array of class indices, got shape {list(y.shape)}"
        )
    if y.is_floating_point() and not bool((y == y.round()).all()):
        raise DataError(f"{name}: labels must be integer class indices, got fractional values")
    return y.long()


def _from_arrays(x: Any, y: Any, name: str, backbone: Any = None) -> LabelledData:
    text = is_text_backbone(backbone)
    _refuse_non_numeric(x, "inputs", name)
    _refuse_non_numeric(y, "labels", name)
    if isinstance(x, Mapping) and backbone is not None and not text:
        given_as = spelled("load_backbone('hf:<folder>')", "--backbone hf:<folder>")
        raise DataError(
            f"{name}: text inputs (a dict with keys {sorted(x)}) were given to a "
            f"{getattr(backbone, 'family', '?')} backbone, which takes images; use a bert backbone "
            f"({given_as})"
        )
    if isinstance(x, Mapping):
        return LabelledData(
            TensorDataset(_stack_text(x, name), _labels_tensor(y, _rows(x), name)), name
        )
    x = torch.as_tensor(np.asarray(x) if isinstance(x, np.ndarray) else x)
    if text or (backbone is None and _looks_like_tokens(x)):
        if x.is_floating_point():
            _refuse_floats_for_text(x, backbone, name)
        x = _stack_text(x, name, backbone)
        return LabelledData(TensorDataset(x, _labels_tensor(y, x.shape[0], name)), name)
    y = _labels_tensor(y, x.shape[0], name)
    _refuse_unpreprocessed(x, name, backbone)
    return LabelledData(TensorDataset(x.float(), y), name)


def _refuse_unpreprocessed(x: torch.Tensor, name: str, backbone: Any = None) -> None:
    """DataError for integer (raw pixel, token) inputs where preprocessed float images belong."""
    if not x.is_floating_point():
        raise DataError(
            f"{name}: inputs must be float arrays already preprocessed (got {x.dtype}); scale and "
            "normalise images as the backbone expects, or pass an image folder"
            + (
                "; integer token inputs (input_ids, attention_mask) need a text backbone "
                "(family bert)"
                if backbone is not None
                else ""
            )
        )


def _from_path(path: Path, backbone: Any, name: str) -> LabelledData:
    if not path.exists():
        raise DataError(f"{name}: {str(path)!r} does not exist")
    text = is_text_backbone(backbone)
    if path.is_dir():
        if text:
            raise DataError(
                f"{name}: {str(path)!r} is a folder (image data) but the backbone is a text model "
                "(family bert); pass a .tsv file (label<TAB>text per line) or a .npz with "
                "input_ids, attention_mask and y"
            )
        return _from_image_folder(path, backbone, name)
    suffix = path.suffix.lower()
    if suffix == ".npz":
        x, y = _npz_arrays(path, name, text, need_labels=True)
        return _from_arrays(x, y, name, backbone)
    if suffix == ".tsv":
        return _from_text_file(path, backbone, name, labelled=True)
    if suffix == ".txt" and text:
        raise DataError(
            f"{name}: {str(path)!r} is a .txt file without labels; labelled text is a .tsv file "
            "with label<TAB>text on each line"
        )
    raise DataError(
        f"{name}: {str(path)!r} is neither an image folder nor a .npz file"
        + (" (text data: a .tsv file of label<TAB>text lines)" if text else "")
    )


def _npz_arrays(path: Path, name: str, text: bool, need_labels: bool) -> tuple[Any, Any]:
    """(inputs, labels or None) of a .npz: ``x`` (any backbone) or the text keys (text)."""
    archive = read_array_file(
        path,
        error=DataError,
        prefix=f"{name}: ",
        what="",
        hint="is it a complete .npz written by np.savez(path, x=inputs, y=labels)?",
    )
    if not isinstance(archive, dict):
        raise DataError(f"{name}: {str(path)!r} is not a .npz archive; save it with np.savez")
    files = set(archive)
    labels = archive.get("y")
    if text and "input_ids" in files:
        x: Any = {key: archive[key] for key in TEXT_KEYS if key in files}
    elif "x" in files:
        x = archive["x"]
    else:
        wanted = ["input_ids", "y"] if text else ["x", "y"]
        missing = sorted(set(wanted if need_labels else wanted[:1]) - files)
        hint = (
            "np.savez(path, input_ids=..., attention_mask=..., y=labels)"
            if text
            else "np.savez(path, x=inputs, y=labels)"
        )
        raise DataError(
            f"{name}: {str(path)!r} lacks {missing} (has {sorted(files)}); save it with {hint}"
        )
    if need_labels and labels is None:
        raise DataError(
            f"{name}: {str(path)!r} lacks ['y'] (has {sorted(files)}); save it with "
            "np.savez(path, x=inputs, y=labels)"
        )
    return x, labels


# --- text -----------------------------------------------------------------------------------------
def _looks_like_tokens(x: torch.Tensor) -> bool:
    """Integer [N, L] ids or [N, 2|3, L] stacked tokens (with no backbone to ask)."""
    return not x.is_floating_point() and (x.dim() == 2 or (x.dim() == 3 and x.shape[1] in (2, 3)))


def _rows(inputs: Mapping[str, Any]) -> int:
    ids = inputs.get("input_ids")
    return int(np.shape(ids)[0]) if ids is not None and np.ndim(ids) >= 1 else 0


def _refuse_floats_for_text(x: torch.Tensor, backbone: Any, name: str) -> None:
    raise DataError(
        f"{name}: float inputs {list(x.shape)} ({x.dtype}) were given to a text backbone "
        f"({getattr(backbone, 'family', 'bert')}), which takes integer token ids: pass "
        "input_ids/attention_mask (int) or the stacked [N, 2|3, L] int64 tensor, or a .tsv file"
    )


def _int_tensor(value: Any, key: str, name: str) -> torch.Tensor:
    tensor = torch.as_tensor(np.asarray(value) if not isinstance(value, torch.Tensor) else value)
    if tensor.is_floating_point():
        raise DataError(f"{name}: {key} must be integers, got {tensor.dtype}")
    return tensor.long()


def _stack_text(inputs: Any, name: str, backbone: Any = None) -> torch.Tensor:
    """Any text input form with a batch axis -> the stacked int64 tensor [N, 2|3, L]."""
    if isinstance(inputs, Mapping):
        check_text_keys(inputs, DataError, f"{name}: ")
        ids = _int_tensor(inputs["input_ids"], "input_ids", name)
        if ids.dim() != 2:
            raise DataError(f"{name}: input_ids must be [examples, tokens], got {list(ids.shape)}")
        channels = [ids]
        for key in TEXT_KEYS[1:]:
            value = inputs.get(key)
            if value is None:
                if key == "attention_mask":
                    channels.append(torch.ones_like(ids))
                continue
            value = _int_tensor(value, key, name)
            if tuple(value.shape) != tuple(ids.shape):
                raise DataError(
                    f"{name}: {key} has shape {list(value.shape)}, input_ids {list(ids.shape)}; "
                    "they must match"
                )
            channels.append(value)
        return torch.stack(channels, dim=1)
    x = torch.as_tensor(np.asarray(inputs) if isinstance(inputs, np.ndarray) else inputs)
    if x.is_floating_point():
        _refuse_floats_for_text(x, backbone, name)
    if x.dim() == 2:  # bare input_ids: no padding
        return torch.stack([x.long(), torch.ones_like(x, dtype=torch.long)], dim=1)
    if x.dim() == 3 and x.shape[1] in (2, 3):
        return x.long()
    raise DataError(
        f"{name}: text inputs have shape {list(x.shape)}; expected input_ids [N, L] or the stacked "
        "[N, 2 or 3, L] (input_ids, attention_mask[, token_type_ids])"
    )


def _pad_cat(parts: list[torch.Tensor], name: str) -> torch.Tensor:
    """Concatenate stacked text batches [B, C, L_b], padding every one to the longest L."""
    channels = {p.shape[1] for p in parts}
    if len(channels) > 1:
        raise DataError(
            f"{name}: some batches have token_type_ids and some do not ({sorted(channels)} "
            "channels); give them in every batch or in none"
        )
    length = max(p.shape[2] for p in parts)
    # pad value 0 everywhere: attention_mask 0 marks padding; ids and types there never matter
    return torch.cat([F.pad(p, (0, length - p.shape[2])) for p in parts])


def _split_labels(item: Mapping[str, Any], name: str, what: str) -> tuple[dict[str, Any], Any]:
    keys = [key for key in LABEL_KEYS if key in item]
    if not keys:
        raise DataError(
            f"{name}: {what} has no labels (keys {sorted(item)}); add 'labels' or pass "
            "(inputs, labels)"
        )
    return {k: v for k, v in item.items() if k not in LABEL_KEYS}, item[keys[0]]


def _text_example(item: Any, name: str, index: int) -> tuple[torch.Tensor, int]:
    """One dataset item -> (stacked tokens [C, L], label)."""
    if isinstance(item, Mapping):
        inputs, label = _split_labels(item, name, f"item {index}")
    elif isinstance(item, (tuple, list)) and len(item) == 2:
        inputs, label = item
    else:
        raise DataError(
            f"{name}: item {index} is not an (inputs, label) pair or a dict with labels"
        )
    if isinstance(inputs, Mapping):
        batched = {k: torch.as_tensor(np.asarray(v)).unsqueeze(0) for k, v in inputs.items()}
    else:
        batched = torch.as_tensor(np.asarray(inputs) if not _is_array(inputs) else inputs)
        batched = batched.unsqueeze(0)
    label_tensor = torch.as_tensor(label)
    if label_tensor.numel() != 1:
        raise DataError(f"{name}: item {index} has {label_tensor.numel()} labels, expected one")
    return _stack_text(batched, name)[0], int(label_tensor.reshape(()).item())


def _text_from_dataset(dataset: Dataset, name: str, max_examples: int | None) -> LabelledData:
    """A map-style dataset of text items, read into the stacked form (padded to the longest)."""
    count = len(dataset) if max_examples is None else min(len(dataset), max_examples)
    if count == 0:
        raise DataError(f"{name} is empty")
    examples = [_text_example(dataset[i], name, i) for i in range(count)]
    x = _pad_cat([e[0].unsqueeze(0) for e in examples], name)
    y = torch.tensor([e[1] for e in examples], dtype=torch.long)
    return LabelledData(TensorDataset(x, y), name)


def _text_from_loader(loader: DataLoader, name: str, max_examples: int | None) -> LabelledData:
    """A DataLoader of text: its map-style dataset's items when they are examples (stable order),
    else its batches (e.g. a collate_fn that tokenizes)."""
    dataset = loader.dataset
    if _is_map_style(dataset) and len(dataset) > 0:
        try:
            _text_example(dataset[0], name, 0)
        except (DataError, TypeError, ValueError, RuntimeError):
            pass
        else:
            return _text_from_dataset(dataset, name, max_examples)
    return _from_batches(loader, name, max_examples, text=True)


def _load_tokenizer(backbone: Any, name: str, source: str) -> Any:
    tokenizer_dir = getattr(backbone, "tokenizer_dir", None)
    if tokenizer_dir is None:
        raise DataError(
            f"{name}: {source} holds text, but the backbone has no tokenizer (tokenizer_dir is "
            "None); load the model from a folder that holds its tokenizer files "
            "(tokenizer.json / vocab.txt) or pass tokenizer_dir=... to load_backbone, or give "
            "token ids (a .npz with input_ids, attention_mask and y)"
        )
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            str(tokenizer_dir), local_files_only=True
        )
    except Exception as err:  # missing files, unknown tokenizer class, ...
        raise DataError(
            f"{name}: cannot load the tokenizer in {str(tokenizer_dir)!r} "
            f"({type(err).__name__}: {str(err)[:200]})"
        ) from err
    vocab_size = getattr(backbone, "vocab_size", None)
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise DataError(
            f"{name}: the tokenizer in {str(tokenizer_dir)!r} has {len(tokenizer)} tokens but the "
            f"model's vocabulary has {vocab_size}: the tokenizer does not match the model"
        )
    return tokenizer


def _from_text_file(path: Path, backbone: Any, name: str, labelled: bool) -> LabelledData:
    """A ``.tsv`` (label<TAB>text[<TAB>text pair]) or, unlabelled, ``.txt`` (text), read by
    :func:`hydra_deploy.userdata.read_text_file` and tokenized."""
    source = repr(str(path))
    if not is_text_backbone(backbone):
        family = "no backbone" if backbone is None else f"a {backbone.family} backbone"
        raise DataError(
            f"{name}: {source} is a text file, which needs a text backbone with a tokenizer "
            f"(family bert), got {family}"
        )
    table = read_text_file(path, name=name, error=DataError)
    texts, pairs = table.texts, table.pairs
    tokenizer = _load_tokenizer(backbone, name, source)
    try:
        encoded = tokenizer(
            texts,
            pairs,
            padding="longest",
            truncation=True,
            max_length=int(backbone.seq_len),
            return_tensors="pt",
        )
    except Exception as err:
        raise DataError(f"{name}: tokenizing {source} failed: {err}") from err
    inputs = {k: encoded[k] for k in TEXT_KEYS if k in encoded}
    if "token_type_ids" in inputs and "token_type_ids" not in getattr(backbone, "input_names", ()):
        del inputs["token_type_ids"]  # one-segment model: all zeros, nothing to carry
    x = _stack_text(inputs, name)
    classes = None
    if not labelled:
        y = torch.zeros(len(texts), dtype=torch.long)
    else:
        indices, classes = table.label_indices(
            getattr(backbone, "class_names", None),
            getattr(backbone, "num_classes", None),
            name=name,
        )
        y = torch.tensor(indices, dtype=torch.long)
    return LabelledData(TensorDataset(x, y), name, classes)


def _check_text(x: torch.Tensor, backbone: Any, name: str) -> None:
    """Stacked tokens [N, 2|3, L] (or one example [2|3, L]): shape, ids, mask, types, length."""
    x = x.unsqueeze(0) if x.dim() == 2 else x
    if x.dim() != 3 or x.shape[1] not in (2, 3) or x.is_floating_point():
        raise DataError(
            f"{name}: text examples must be int64 [2 or 3, L] (input_ids, attention_mask"
            f"[, token_type_ids]), got {x.dtype} {list(x.shape[1:])}"
        )
    if backbone is not None and not is_text_backbone(backbone):
        raise DataError(
            f"{name}: integer token inputs were given to a {getattr(backbone, 'family', '?')} "
            "backbone, which takes float images; use a text backbone (family bert)"
        )
    ids, mask = x[:, 0], x[:, 1]
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise DataError(f"{name}: attention_mask must hold only 0 (padding) and 1 (token)")
    empty = torch.nonzero(mask.sum(1) == 0).flatten()
    if empty.numel():
        raise DataError(
            f"{name}: {counted(empty.numel(), 'example')} "
            f"{'has' if empty.numel() == 1 else 'have'} no real token (attention_mask all 0, e.g. "
            f"example {int(empty[0])})"
        )
    if backbone is None:
        return
    max_position = getattr(backbone, "max_position", None)
    if max_position is not None and x.shape[2] > max_position:
        raise DataError(
            f"{name}: sequences of {x.shape[2]} tokens exceed the model's {max_position} positions; "
            "truncate them"
        )
    vocab_size = getattr(backbone, "vocab_size", None)
    real = ids[mask.bool()]
    if vocab_size is not None and real.numel() and (real.min() < 0 or real.max() >= vocab_size):
        bad = int(real.max()) if real.max() >= vocab_size else int(real.min())
        raise DataError(
            f"{name}: token id {bad} is outside the model's vocabulary 0..{vocab_size - 1}; "
            "tokenize with the checkpoint's own tokenizer"
        )
    type_vocab = getattr(backbone, "type_vocab_size", None)
    if x.shape[1] == 3 and type_vocab is not None:
        types = x[:, 2][mask.bool()]
        if types.numel() and (types.min() < 0 or types.max() >= type_vocab):
            raise DataError(
                f"{name}: token_type_ids hold {int(types.max())}, the model has {type_vocab} "
                "segment type(s)"
            )


class _ImageLoader:
    """Opens one image file as a PIL image in ``mode``; a corrupt file raises DataError naming it."""

    def __init__(self, mode: str, name: str) -> None:
        self.mode = mode
        self.name = name

    def __call__(self, path: str) -> Any:
        try:
            with open(path, "rb") as file:
                return pil_image.open(file).convert(self.mode)
        except Exception as err:
            raise DataError(
                f"{self.name}: cannot read image {path!r} ({type(err).__name__}: {err}); replace "
                "or remove the file"
            ) from err


def _image_transform(backbone: Any, name: str) -> tuple[str, Any]:
    """(PIL mode, timm eval transform) giving ``[in_chans, *img_size]`` tensors for ``backbone``."""
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
    folder_module = torchvision.datasets.folder

    def has_images(folder: Path) -> bool:
        return any(
            folder_module.has_file_allowed_extension(file, folder_module.IMG_EXTENSIONS)
            for _, _, files in os.walk(folder, followlinks=True)
            for file in files
        )

    return [cls for cls in classes if not has_images(path / cls)]


def _from_image_folder(path: Path, backbone: Any, name: str) -> LabelledData:
    if backbone is None:
        raise DataError(
            f"{name}: {str(path)!r} is an image folder, which needs the backbone to know the "
            "preprocessing (input size, channels, mean/std); pass the backbone to load_data"
        )
    # The class folders exactly as torchvision's ImageFolder finds them (sorted sub-folder names).
    classes = class_folders(path, name=name, error=DataError)
    mode, transform = _image_transform(backbone, name)
    try:
        dataset = torchvision.datasets.ImageFolder(
            str(path), transform=transform, loader=_ImageLoader(mode, name)
        )
    except FileNotFoundError as err:  # some class folder holds no image file
        empty = _empty_class_folders(path, classes)
        if not empty:
            raise DataError(f"{name}: cannot list the images in {str(path)!r}: {err}") from err
        raise DataError(
            f"{name}: class folder(s) {empty} in {str(path)!r} hold no image files (extensions: "
            f"{', '.join(torchvision.datasets.folder.IMG_EXTENSIONS)}); add images or remove the folder(s)"
        ) from err
    except OSError as err:
        raise DataError(f"{name}: cannot list the images in {str(path)!r}: {err}") from err
    # sub-folders are the model's class names, class indices, or sorted names (the one rule)
    indices, known = folder_class_indices(
        dataset.classes,
        getattr(backbone, "class_names", None),
        getattr(backbone, "num_classes", None),
        source=f"{name}: {path}",
        any_count=True,
    )
    if known is None and indices == list(range(len(indices))):
        known = list(dataset.classes)  # 0..C-1 in order, as torchvision reads them
    dataset.class_to_idx = dict(zip(dataset.classes, indices, strict=True))
    dataset.samples = [(file, indices[target]) for file, target in dataset.samples]
    dataset.imgs = dataset.samples
    dataset.targets = [target for _, target in dataset.samples]
    return LabelledData(dataset, name, known)


def _from_batches(
    batches: Iterable, name: str, max_examples: int | None, backbone: Any = None, text: bool = False
) -> LabelledData:
    text = text or is_text_backbone(backbone)
    xs, ys, count = [], [], 0
    for index, batch in enumerate(batches):
        if text and isinstance(batch, Mapping):
            batch = _split_labels(batch, name, f"batch {index}")
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise DataError(f"{name}: batch {index} is not an (inputs, labels) pair")
        if text or isinstance(batch[0], Mapping):
            x = _stack_text(batch[0], name, backbone)
            y = torch.as_tensor(np.asarray(batch[1]) if not _is_array(batch[1]) else batch[1])
        else:
            x, y = (torch.as_tensor(v) for v in batch)
        xs.append(x)
        ys.append(y.reshape(-1))
        count += x.shape[0]
        if max_examples is not None and count >= max_examples:
            break
    if not xs:
        raise DataError(f"{name} is empty: the iterable gave no batches")
    if xs[0].dim() == 3 and not xs[0].is_floating_point() and (text or backbone is None):
        x_all = _pad_cat(xs, name)
        return LabelledData(
            TensorDataset(x_all, _labels_tensor(torch.cat(ys), len(x_all), name)), name
        )
    return _from_arrays(torch.cat(xs), torch.cat(ys), name, backbone)


def _check(labelled: LabelledData, backbone: Any, num_classes: int | None) -> None:
    if len(labelled) == 0:
        raise DataError(
            f"{labelled.name} is empty (0 examples); give at least one labelled example"
        )
    x, _ = labelled.dataset[0]
    x = torch.as_tensor(x)
    if is_text_backbone(backbone) and x.is_floating_point():
        _refuse_floats_for_text(x, backbone, labelled.name)
    if not x.is_floating_point():
        _check_text(_all_inputs(labelled), backbone, labelled.name)
    if backbone is not None and hasattr(backbone, "img_size"):
        expected = (backbone.in_chans, *backbone.img_size)
        if tuple(x.shape) != expected:
            raise DataError(
                f"{labelled.name}: inputs have shape {list(x.shape)}, the backbone expects "
                f"{list(expected)} per example; preprocess them to the backbone's input size (or "
                "pass an image folder)"
            )
    if x.is_floating_point() and isinstance(_unwrap(labelled)[0], TensorDataset):
        _refuse_nonfinite(_all_inputs(labelled), labelled.name)
    classes = labelled.classes
    if num_classes is not None and classes is not None and len(classes) > num_classes:
        shown = ", ".join(classes[:8]) + (", ..." if len(classes) > 8 else "")
        raise DataError(
            f"{labelled.name} has {counted(len(classes), 'class')} ({shown}) but the classifier "
            f"has {num_classes}; remove class folders or build the backbone with "
            + spelled(f"num_classes={len(classes)}", f"--num-classes {len(classes)}")
        )
    if num_classes is not None:
        labels = _all_labels(labelled)
        bad = labels[(labels < 0) | (labels >= num_classes)]
        if bad.size:
            raise DataError(
                f"{labelled.name}: {counted(bad.size, 'label')} outside 0..{num_classes - 1} (e.g. "
                f"{int(bad[0])}); the classifier has {counted(num_classes, 'class')}: relabel the "
                + said("data, or size the classifier to it (`num_classes`)")
            )


def _refuse_nonfinite(x: torch.Tensor, name: str) -> None:
    finite = torch.isfinite(x.reshape(len(x), -1)).all(dim=1)
    if not bool(finite.all()):
        raise DataError(
            f"{name}: {int((~finite).sum())} of {counted(len(x), 'input')} "
            f"{'holds' if int((~finite).sum()) == 1 else 'hold'} NaN or infinite values; "
            "fix or drop them"
        )


def _unwrap(labelled: LabelledData) -> tuple[Dataset, list[int] | None]:
    """The dataset under any Subsets, and the indices into it (None: all, in order)."""
    dataset = labelled.dataset
    indices = None
    while isinstance(dataset, Subset):
        indices = dataset.indices if indices is None else [dataset.indices[i] for i in indices]
        dataset = dataset.dataset
    return dataset, indices


def _all_inputs(labelled: LabelledData) -> torch.Tensor:
    """Every input, stacked (text checks; read from the tensor when there is one)."""
    dataset, indices = _unwrap(labelled)
    if isinstance(dataset, TensorDataset):
        x = dataset.tensors[0]
        return x if indices is None else x[torch.as_tensor(indices, dtype=torch.long)]
    return torch.stack([torch.as_tensor(labelled.dataset[i][0]) for i in range(len(labelled))])


def _tensors_of(labelled: LabelledData) -> torch.Tensor:
    return torch.cat([x for x, _ in labelled.loader(256)])


def _all_labels(labelled: LabelledData) -> np.ndarray:
    dataset, indices = _unwrap(labelled)
    if isinstance(dataset, TensorDataset):
        labels = dataset.tensors[1].numpy()
    elif hasattr(dataset, "targets"):
        labels = np.asarray(dataset.targets)
    else:
        return np.asarray([int(labelled.dataset[i][1]) for i in range(len(labelled))])
    return labels if indices is None else labels[np.asarray(indices, dtype=np.int64)]
