"""Class names and the one rule that turns the labels of a data file into class indices.

Used by fine-tuning / head selection (``hydra_deploy.pruning.data``: ``.tsv`` text files) and by
``hydra-eval`` (``hydra_deploy.evaluation.evaluate``: ``.tsv`` files and labelled image folders),
so that training and evaluation map a name to the same index. Needs neither torch nor numpy.

The rule (:func:`label_indices`), given the labels of a file and the model's class names:

- every label an integer (``0``, ``12``): class indices, taken as they are;
- class names, and the model names its classes (a BERT checkpoint's ``config.id2label``, an
  export's ``class_names``): each name is the index of that name among the model's classes; a name
  that is not one of them (a typo, a header line, a class the model lacks) is refused, naming it;
- class names, and the model names none: the distinct names in sorted order are classes ``0, 1,
  ...`` (torchvision's ``ImageFolder`` rule), with a warning, **only when there are as many names
  as the model has classes**; with fewer or more the order cannot be known (a file lacking a class
  would shift every index after it) and the file is refused: label it with indices, or name the
  classes in the model (``config.id2label``);
- integers and names mixed in one file are refused.

Image folders (:func:`folder_class_indices`; ``hydra-eval``, ``hydra-calibrate``, fine-tuning and
head selection) name a class by their class sub-folders' names:

- with a class-names file (``--labels FILE``, :func:`read_class_names`: one name per line, the
  first line class 0): each sub-folder is the index of its name in the file. The file must name
  as many classes as the model has, and agree with the names the model records, if any;
- the model records class names and every sub-folder is one of them: the index of that name;
- every sub-folder named by a non-negative integer (``0/ 1/ ... 9/``): class indices, taken as they
  are (folder ``10`` is class 10, whatever the sorted order of the names), each below the model's
  class count. This holds also when the model records names that these are not (a folder
  ``3`` is class 3, not a class named ``3``): integer names that are not the model's names can only
  mean indices;
- other names, and the model records none: the sorted rule above (as many names as classes, with a
  warning), else refused, naming both fixes: sub-folders named by class index, or ``--labels FILE``.
  Fine-tuning and head selection (``load_data``) keep torchvision's ``ImageFolder`` rule here:
  the sorted names are classes 0, 1, ... whatever their count.

:class:`NamedClasses` carries a data path with the names of a ``--labels`` file to
``load_eval_data`` (``hydra-eval``, ``hydra-calibrate``), which takes it where it takes a path.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra_deploy.errors import DataError, HydraError, counted

logger = logging.getLogger("hydra_deploy")

_SHOWN = 12  # class names listed in a message


def class_names_from_id2label(
    id2label: Mapping[Any, Any] | None, num_classes: int
) -> list[str] | None:
    """The class names a transformers ``config.id2label`` gives, by index; None when it names none.

    transformers fills ``id2label`` with ``LABEL_0, LABEL_1, ...`` when a model is built without
    names: those (and a mapping that does not cover exactly ``0..num_classes-1``, or that repeats a
    name) count as no names.
    """
    if not id2label:
        return None
    try:
        by_index = {int(k): str(v) for k, v in id2label.items()}
    except (TypeError, ValueError):
        return None
    if sorted(by_index) != list(range(num_classes)):
        return None
    names = [by_index[i] for i in range(num_classes)]
    if all(name == f"LABEL_{i}" for i, name in enumerate(names)) or len(set(names)) != len(names):
        return None
    return names


def is_index_label(label: str) -> bool:
    """Whether a label read from a file is a class index (an optionally signed integer)."""
    return label.strip().lstrip("+-").isdigit()


def _shown(names: Sequence[str]) -> str:
    return ", ".join(names[:_SHOWN]) + (", ..." if len(names) > _SHOWN else "")


def label_indices(
    labels: Sequence[str],
    class_names: Sequence[str] | None,
    num_classes: int | None,
    *,
    source: str,
    where: Sequence[str] | None = None,
    index_labels: bool = True,
    error: type[Exception] = DataError,
) -> tuple[list[int], list[str] | None]:
    """The class index of every label of ``source`` (a file or folder), by the module's rule.

    ``class_names``: the model's, by index (None: it names none); ``num_classes``: its class count
    (None: unknown, then names without model names are refused). ``where[i]`` says where label i
    was read (``"line 3"``), for messages. Returns (indices, the class names by index, or None for
    integer labels). Raises ``error`` (a :class:`~hydra_deploy.errors.HydraError`) with a one-line
    message naming the offending label. ``index_labels=False`` reads integers as names too (image
    folders: a folder ``3`` is the class named ``3``, as for torchvision's ``ImageFolder``).
    """
    labels = [str(label).strip() for label in labels]
    where = list(where) if where is not None else [f"item {i + 1}" for i in range(len(labels))]
    numeric = [index_labels and is_index_label(label) for label in labels]
    if all(numeric):
        return [int(label) for label in labels], None
    if any(numeric):
        first_name = numeric.index(False)
        first_index = numeric.index(True)
        header = " (a header line? remove it)" if first_name == 0 else ""
        raise error(
            f"{source} mixes class indices ({where[first_index]}: {labels[first_index]!r}) and "
            f"class names ({where[first_name]}: {labels[first_name]!r}){header}; use one or the "
            "other on every line"
        )
    if class_names:
        known = [str(name) for name in class_names]
        index = {name: i for i, name in enumerate(known)}
        for position, label in enumerate(labels):
            if label not in index:
                header = " (a header line? remove it)" if index_labels and position == 0 else ""
                fix = (
                    f"those names or class indices 0..{len(known) - 1}"
                    if index_labels
                    else ("those names")
                )
                raise error(
                    f"{source} {where[position]}: label {label!r} is not one of the model's "
                    f"classes: {_shown(known)}{header}; use {fix}"
                )
        return [index[label] for label in labels], known
    order = sorted(set(labels))
    if num_classes is None or len(order) != num_classes:
        count = "an unknown number of" if num_classes is None else str(num_classes)
        raise error(
            f"{source} names {counted(len(order), 'class')} ({_shown(order)}) but the model has {count} "
            "classes and records no class names, so the names cannot be mapped to its classes; "
            "label the examples with class indices 0..C-1, or name the model's classes "
            "(config.id2label in the checkpoint's config.json)"
        )
    logger.warning(
        "%s: the model records no class names; the %d names found, in sorted order, are taken "
        "as classes 0..%d: %s",
        source,
        len(order),
        len(order) - 1,
        _shown(order),
    )
    index = {name: i for i, name in enumerate(order)}
    return [index[label] for label in labels], order


# --- image folders and class-names files ---------------------------------------------------------
#: the help of ``--labels`` (hydra-calibrate, hydra-eval)
LABELS_HELP = (
    "a text file of the model's class names, one per line, the first line class 0: maps labelled "
    "data's class sub-folder names (or .tsv label names) to class indices"
)


@dataclass(frozen=True)
class NamedClasses:
    """Labelled data (``data``: a path) whose class names, by index, come from a class-names file
    (``source``, for messages): what ``--labels FILE`` adds to ``--data``/``--id``.
    ``load_eval_data`` takes it where it takes the path alone."""

    data: Any
    class_names: tuple[str, ...]
    source: str


def read_class_names(path: str | os.PathLike, *, error: type[HydraError] = DataError) -> list[str]:
    """A class-names file: one name per line, the first line class 0; surrounding spaces
    dropped; a blank line (but trailing ones) or a repeated name is refused with its line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise error(f"--labels: cannot read class names from {str(path)!r}: {err}") from err
    while lines and not lines[-1].strip():
        lines.pop()
    names = [line.strip() for line in lines]
    if not names:
        raise error(f"--labels: {path} holds no class names; write one name per line")
    seen: dict[str, int] = {}
    for number, name in enumerate(names, start=1):
        if not name:
            raise error(
                f"--labels: {path} line {number} is blank; write one class name on every line "
                f"(the first line is class 0), so that no class is skipped"
            )
        if name in seen:
            raise error(
                f"--labels: {path} line {number} repeats {name!r} (line {seen[name]}); every "
                "class needs its own name"
            )
        seen[name] = number
    return names


def with_class_names(data: Any, labels: str | os.PathLike | None) -> Any:
    """``data`` with the class names of the file ``labels`` (a :class:`NamedClasses`), or
    ``data`` itself when ``labels`` is None."""
    if labels is None:
        return data
    return NamedClasses(data, tuple(read_class_names(labels)), f"--labels {labels}")


def split_class_names(data: Any) -> tuple[Any, NamedClasses | None]:
    """``(the data path, its NamedClasses)`` for a :class:`NamedClasses`, else ``(data, None)``."""
    if isinstance(data, NamedClasses):
        return data.data, data
    return data, None


def class_names_to_use(
    recorded: Sequence[str] | None,
    given: NamedClasses | None,
    num_classes: int | None,
    *,
    error: type[Exception] = DataError,
) -> list[str] | None:
    """The class names labels are read through: a ``--labels`` file's (checked against the
    model's class count and the names it records), else the names the model records."""
    if given is None:
        return list(recorded) if recorded else None
    names = list(given.class_names)
    if num_classes is not None and len(names) != num_classes:
        raise error(
            f"{given.source} names {len(names)} classes but the model has {num_classes}; give "
            f"one name per class, {num_classes} lines"
        )
    if recorded and list(recorded) != names:
        line = next(
            (i for i, (a, b) in enumerate(zip(recorded, names, strict=False)) if a != b),
            min(len(recorded), len(names)),
        )
        said = repr(names[line]) if line < len(names) else "nothing"
        model = repr(str(recorded[line])) if line < len(recorded) else "nothing"
        raise error(
            f"{given.source} line {line + 1} says {said} but the model names class {line} "
            f"{model}; the model records its class names, so leave out --labels (or give the "
            "model's names)"
        )
    return names


def _is_folder_index(name: str) -> bool:
    return name.isascii() and name.isdigit()


def folder_class_indices(
    folders: Sequence[str],
    class_names: Sequence[str] | None,
    num_classes: int | None,
    *,
    source: str,
    given: NamedClasses | None = None,
    any_count: bool = False,
    error: type[Exception] = DataError,
) -> tuple[list[int], list[str] | None]:
    """The class index of each class sub-folder of a labelled image folder (the module's rule)
    and the class names by index (None when the folders are indices and nothing names them).

    ``class_names``: the names the model records (None: none); ``num_classes``: its class count
    (None: unknown); ``given``: a ``--labels`` file's names (:func:`with_class_names`).
    ``any_count``: sorted names without model names are classes 0, 1, ... whatever their count
    (torchvision's ``ImageFolder``, as fine-tuning and head selection have always read them)."""
    folders = [str(folder) for folder in folders]
    names = class_names_to_use(class_names, given, num_classes, error=error)
    where = [f"sub-folder {folder!r}" for folder in folders]
    if names and (given is not None or all(folder in names for folder in folders)):
        return label_indices(
            folders, names, len(names), source=source, where=where, index_labels=False, error=error
        )
    if all(_is_folder_index(folder) for folder in folders):
        indices = [int(folder) for folder in folders]
        too_large = [
            f for f, i in zip(folders, indices, strict=True) if i >= (num_classes or i + 1)
        ]
        if too_large:
            raise error(
                f"{source}: sub-folder {too_large[0]!r} is no class index of the model, which has "
                f"{num_classes} classes (0..{num_classes - 1}); remove it or rename it"
            )
        return indices, names
    if names:
        return label_indices(
            folders, names, len(names), source=source, where=where, index_labels=False, error=error
        )
    order = sorted(set(folders))
    if any_count:
        return [order.index(folder) for folder in folders], order
    if num_classes is None or len(order) != num_classes:
        count = "an unknown number of" if num_classes is None else str(num_classes)
        last = "C-1" if num_classes is None else str(num_classes - 1)
        raise error(
            f"{source} names {counted(len(order), 'class')} ({_shown(order)}) by its sub-folders but the "
            f"model has {count} classes and records no class names, so the folder names cannot "
            f"be mapped to its classes; name the sub-folders 0..{last} by class index, or pass "
            "--labels FILE with the model's class names, one per line"
        )
    return label_indices(
        folders, None, num_classes, source=source, where=where, index_labels=False, error=error
    )
