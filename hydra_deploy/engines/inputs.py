"""Which arrays of a ``.npz`` are the model's inputs: one rule for every command that reads them.

``hydra-run``, ``hydra-eval`` and ``hydra-compare`` take preprocessed inputs as ``.npz`` files;
:func:`pick_inputs` decides which arrays feed the model, the same way for all three:

- a model with several inputs (a text model: ``input_ids``, ``attention_mask`` and, optionally,
  ``token_type_ids``): the arrays named after its inputs (``token_type_ids`` may be absent);
- a model with one input: the array named after it (``pixel_values``), else the array ``x``.

numpy only (edge-safe).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from hydra_deploy.errors import RunnerError

__all__ = ["OPTIONAL_INPUTS", "pick_inputs"]

#: inputs a ``.npz`` may leave out (the runner feeds zeros: one segment)
OPTIONAL_INPUTS = ("token_type_ids",)


def pick_inputs(
    arrays: Mapping[str, np.ndarray], input_names: Sequence[str], where: str
) -> np.ndarray | dict[str, np.ndarray]:
    """The model's input(s) among ``arrays`` (a ``.npz``'s contents); ``where`` names the file in
    the error. ``input_names``: the model's inputs in order (empty: an image model whose input name
    is unknown, which takes ``x``)."""
    names, keys = tuple(input_names), list(arrays)
    if len(names) > 1:
        required = [n for n in names if n not in OPTIONAL_INPUTS]
        missing = [n for n in required if n not in keys]
        if missing:
            raise RunnerError(
                f"{where} holds arrays {keys}; the model takes {list(names)}: name the arrays "
                f"{', '.join(required)}"
                + (
                    f" (and optionally {', '.join(OPTIONAL_INPUTS)})"
                    if len(required) < len(names)
                    else ""
                )
            )
        return {n: np.asarray(arrays[n]) for n in names if n in keys}
    for key in (*names, "x"):
        if key in keys:
            return np.asarray(arrays[key])
    wanted = f"'x' or {names[0]!r} (the model's input)" if names else "'x'"
    raise RunnerError(f"{where} holds arrays {keys}; name the input array {wanted}")
