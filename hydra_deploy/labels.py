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
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from hydra_deploy.errors import DataError

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
            f"{source} names {len(order)} classes ({_shown(order)}) but the model has {count} "
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
