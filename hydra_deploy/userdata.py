"""The one reader of user data files: what a path holds, read by one set of rules for every
command that takes data (fine-tuning and head selection, ``hydra-eval``, ``hydra-calibrate``,
``hydra-run`` and ``hydra-score-dataset``).

numpy only, below every stage (edge-safe). What each consumer then does with what was read stays
with it: :mod:`hydra_deploy.pruning.data` tokenizes with transformers and wraps torch datasets,
:mod:`hydra_deploy.engines` tokenizes with the export's own tokenizer and preprocesses images from
``hydra.json``.

The formats:

- ``.txt``: one text per non-empty line (:func:`read_text_file`; surrounding whitespace dropped);
- ``.tsv``: ``label<TAB>text`` on each non-empty line, or ``label<TAB>text<TAB>second text`` for
  sentence pairs (one form on every line of a file). Readers that need no labels (OOD sets,
  ``hydra-run``) ignore the first column, which may then hold anything. Labels become class
  indices by :func:`hydra_deploy.labels.label_indices` (:meth:`TextFile.label_indices`);
- an image folder: labelled, one sub-folder per class (:func:`class_folders`,
  :func:`labelled_images`); unlabelled, every image under it (:func:`find_images`);
- ``.npy`` / ``.npz`` arrays: :func:`hydra_deploy.arrays.read_array_file`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hydra_deploy.errors import DataError, HydraError, RunnerError
from hydra_deploy.labels import label_indices

__all__ = [
    "IMAGE_SUFFIXES",
    "TEXT_FILE_SUFFIXES",
    "TextFile",
    "class_folders",
    "find_images",
    "labelled_images",
    "read_text_file",
    "text_items",
]

#: image files every reader takes (folders are searched for these)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
#: text files with one example a line: ``.txt`` (text) and ``.tsv`` (label<TAB>text[<TAB>text])
TEXT_FILE_SUFFIXES = (".txt", ".tsv")


def text_items(
    texts: Sequence[str], pairs: Sequence[str] | None
) -> list[str] | list[tuple[str, str]]:
    """What a tokenizer takes for these texts: the texts, or ``(text, second text)`` tuples."""
    if pairs is None:
        return list(texts)
    return list(zip(texts, pairs, strict=True))


@dataclass(frozen=True)
class TextFile:
    """The examples of a ``.txt`` or ``.tsv`` file: ``texts``, the second texts of sentence pairs
    (``pairs``, else None), the first column of a ``.tsv`` as written (``labels``; None for a
    ``.txt``) and the file's line number of each example (``lines``, for messages)."""

    path: Path
    texts: list[str]
    pairs: list[str] | None
    labels: list[str] | None
    lines: list[int]

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def items(self) -> list[str] | list[tuple[str, str]]:
        """The examples as a tokenizer takes them (:func:`text_items`)."""
        return text_items(self.texts, self.pairs)

    def label_indices(
        self,
        class_names: Sequence[str] | None,
        num_classes: int | None,
        *,
        name: str,
        error: type[HydraError] = DataError,
    ) -> tuple[list[int], list[str] | None]:
        """The class index of each example and the class names by index (None for indices), by
        :func:`hydra_deploy.labels.label_indices`; a ``.txt`` has no labels and is refused."""
        if self.labels is None:
            raise error(
                f"{name}: {self.path} holds no labels; labelled text is a .tsv file "
                "(label<TAB>text)"
            )
        return label_indices(
            self.labels,
            class_names,
            num_classes,
            source=f"{name}: {self.path}",
            where=[f"line {n}" for n in self.lines],
            error=error,
        )


def read_text_file(
    path: str | os.PathLike,
    *,
    name: str = "",
    error: type[HydraError] = DataError,
    tsv: bool | None = None,
) -> TextFile:
    """A ``.tsv`` (``label<TAB>text[<TAB>second text]`` per line) or any other file as ``.txt``
    (one text a line); blank lines are skipped. ``tsv`` overrides the suffix's choice. ``name``
    (``"ID data"``) starts each message, raised as ``error``."""
    path = Path(path)
    prefix = f"{name}: " if name else ""
    try:
        content = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise error(f"{prefix}cannot read text from {path}: {err}") from err
    tabbed = path.suffix.lower() == ".tsv" if tsv is None else tsv
    texts: list[str] = []
    pairs: list[str | None] = []
    labels: list[str] = []
    lines: list[int] = []
    for number, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        if not tabbed:
            texts.append(line.strip())
            lines.append(number)
            continue
        fields = line.split("\t", 2)
        if len(fields) < 2:
            raise error(
                f"{prefix}{path} line {number} has no tab; write label<TAB>text on each line"
            )
        labels.append(fields[0].strip())
        texts.append(fields[1].strip())
        pairs.append(fields[2].strip() if len(fields) > 2 else None)
        lines.append(number)
    if not texts:
        raise error(f"{prefix}{path} holds no text lines (every line is empty)")
    if not tabbed:
        return TextFile(path, texts, None, None, lines)
    if any(p is None for p in pairs) and any(p is not None for p in pairs):
        raise error(
            f"{prefix}{path} mixes lines with one text and with a text pair (two tabs); use one "
            "form on every line"
        )
    second = None if pairs[0] is None else [str(p) for p in pairs]
    return TextFile(path, texts, second, labels, lines)


def find_images(
    paths: Iterable[str | os.PathLike], *, error: type[HydraError] = RunnerError
) -> list[Path]:
    """Image files among ``paths``: files as given, folders searched recursively (sorted)."""
    found: list[Path] = []
    for entry in map(Path, paths):
        if entry.is_dir():
            inside = sorted(
                p for p in entry.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
            )
            if not inside:
                raise error(
                    f"the folder {str(entry)!r} holds no images ({', '.join(IMAGE_SUFFIXES)})"
                )
            found += inside
        elif entry.is_file():
            found.append(entry)
        else:
            raise error(f"{str(entry)!r} does not exist")
    return found


def class_folders(
    path: str | os.PathLike, *, name: str, error: type[HydraError] = DataError
) -> list[str]:
    """The class sub-folders of a labelled image folder, sorted by name (torchvision's
    ``ImageFolder`` order); a folder without any is refused."""
    path = Path(path)
    try:
        classes = sorted(entry.name for entry in os.scandir(path) if entry.is_dir())
    except OSError as err:
        raise error(f"{name}: cannot list the images in {str(path)!r}: {err}") from err
    if not classes:
        raise error(
            f"{name}: the image folder {str(path)!r} has no class sub-folders; put each class's "
            "images in a sub-folder named after the class (root/cat/x.png, root/dog/y.jpg)"
        )
    return classes


def labelled_images(
    path: str | os.PathLike, *, name: str, error: type[HydraError] = DataError
) -> tuple[list[Path], list[str], list[str]]:
    """A labelled image folder as ``(image files, the class folder of each, the classes)``: the
    classes by :func:`class_folders`, each one's images searched recursively and sorted."""
    path = Path(path)
    classes = class_folders(path, name=name, error=error)
    images: list[Path] = []
    owners: list[str] = []
    for cls in classes:
        found = sorted(
            p for p in (path / cls).rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
        )
        images += found
        owners += [cls] * len(found)
    if not images:
        raise error(f"{name}: the image folder {str(path)!r} holds no images")
    return images, owners, classes
