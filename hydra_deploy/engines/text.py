"""Text inputs for exported BERT-style models: the export's own tokenizer, no torch, no transformers.

An export of a text model copies the checkpoint's tokenizer files into ``<export>/tokenizer/`` and
records them in ``hydra.json`` (``tokenizer``: folder, max length, the model's vocabulary size).
:class:`TextEncoder` reads ``tokenizer.json`` with the ``tokenizers`` library (Rust, small, what
transformers' fast tokenizers run on) and turns lines of text into the model's int64 inputs,
padded to the longest line of the batch and truncated at the model's maximum length.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hydra_deploy.errors import RunnerError
from hydra_deploy.export_folder import INFO_FILE, TOKENIZER_DIR, TOKENIZER_FILE, ExportInfo
from hydra_deploy.optional import require
from hydra_deploy.userdata import read_text_file

#: The inputs a text export may take, in the order of its graph.
TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
RESTORE = (
    f"restore the export's {TOKENIZER_DIR}/ folder and {INFO_FILE}, or re-export the model with "
    "hydra-export"
)


class TextEncoder:
    """Lines of text -> ``{"input_ids", "attention_mask"[, "token_type_ids"]}`` int64 arrays."""

    def __init__(
        self,
        tokenizer_json: str | os.PathLike,
        *,
        max_length: int,
        vocab_size: int | None = None,
        input_names: Sequence[str] = ("input_ids", "attention_mask"),
    ) -> None:
        Tokenizer = require("tokenizers", purpose="reading text", error=RunnerError).Tokenizer
        path = Path(tokenizer_json)
        if not path.is_file():
            raise RunnerError(
                f"no tokenizer at {path}; export a text model with hydra-export, "
                "which copies its tokenizer into the export folder"
            )
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as err:  # the tokenizers library raises its own Exception types
            raise RunnerError(
                f"{path} is not a tokenizers file ({str(err)[:200]}); restore the export's "
                f"tokenizer/ folder or re-export the model with hydra-export"
            ) from err
        if vocab_size is not None and self.tokenizer.get_vocab_size() > vocab_size:
            raise RunnerError(
                f"the tokenizer in {path.parent} has {self.tokenizer.get_vocab_size()} tokens but "
                f"the model's vocabulary has {vocab_size}: the tokenizer does not match the model; "
                "export with the checkpoint's own tokenizer"
            )
        self.max_length = int(max_length)
        self.input_names = tuple(input_names)
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length=self.max_length)
        pad = _pad_token(self.tokenizer)
        self.tokenizer.enable_padding(pad_id=pad[1], pad_token=pad[0])  # to the longest line

    @classmethod
    def from_export(cls, export: ExportInfo) -> TextEncoder:
        """The encoder an export folder's ``hydra.json`` (its checked record) describes."""
        folder = export.folder
        entry = export.tokenizer
        if not entry:
            raise RunnerError(
                f"{folder} holds no tokenizer ({INFO_FILE} has no 'tokenizer' entry); pass token "
                "ids as a .npz with input_ids and attention_mask instead of text"
            )
        where, fix = export.path, RESTORE
        if not isinstance(entry, dict):
            raise RunnerError(
                f"{where}: its 'tokenizer' entry is a {type(entry).__name__}, not an object; {fix}"
            )
        missing = [key for key in ("dir", "max_length") if key not in entry]
        if missing:
            raise RunnerError(f"{where}: its 'tokenizer' entry lacks {missing}; {fix}")
        directory, max_length = entry["dir"], entry["max_length"]
        vocab_size = entry.get("vocab_size")
        if not isinstance(directory, str) or not directory:
            raise RunnerError(
                f"{where}: tokenizer 'dir' must be a folder name, got {directory!r}; {fix}"
            )
        for key, value in (("max_length", max_length), ("vocab_size", vocab_size)):
            if value is not None and not _is_count(value):
                raise RunnerError(
                    f"{where}: tokenizer {key!r} must be a positive integer, got {value!r}; {fix}"
                )
        names = export.tensor_names("inputs")
        if not all(isinstance(n, str) and n in TEXT_INPUTS for n in names):
            raise RunnerError(
                f"{where}: its 'inputs' ({names!r}) are not the text inputs "
                f"{list(TEXT_INPUTS)}; restore {INFO_FILE} or re-export the model with hydra-export"
            )
        tokenizer_dir = folder / directory
        if not tokenizer_dir.is_dir():
            raise RunnerError(
                f"the tokenizer folder {tokenizer_dir} ({INFO_FILE}'s 'tokenizer' entry) is "
                f"missing; {fix}"
            )
        if not (tokenizer_dir / TOKENIZER_FILE).is_file():
            raise RunnerError(f"{tokenizer_dir} lacks {TOKENIZER_FILE}; {fix}")
        return cls(
            tokenizer_dir / TOKENIZER_FILE,
            max_length=max_length,
            vocab_size=vocab_size,
            input_names=names or ["input_ids", "attention_mask"],
        )

    def __call__(self, lines: Sequence[str]) -> dict[str, np.ndarray]:
        if isinstance(lines, str):
            lines = [lines]
        if not lines:
            raise RunnerError("no text to encode: give at least one line")
        encodings = self.tokenizer.encode_batch(list(lines))
        arrays = {
            "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
        }
        return {name: arrays[name] for name in self.input_names}


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _pad_token(tokenizer) -> tuple[str, int]:
    """The padding token of a tokenizer: its padding config, else [PAD] / <pad>."""
    padding = tokenizer.padding
    if padding:
        return padding["pad_token"], padding["pad_id"]
    for token in ("[PAD]", "<pad>"):
        index = tokenizer.token_to_id(token)
        if index is not None:
            return token, index
    raise RunnerError(
        "the tokenizer has no padding token ([PAD] or <pad>); set one in tokenizer.json"
    )


def read_lines(path: str | os.PathLike) -> list[str]:
    """The non-empty lines of a UTF-8 text file (one input per line), as
    :func:`hydra_deploy.userdata.read_text_file` reads a ``.txt``."""
    return read_text_file(path, error=RunnerError, tsv=False).texts
