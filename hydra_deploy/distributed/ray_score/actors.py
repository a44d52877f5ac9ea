"""The actors: :class:`HydraScorer`, the Ray Data UDF that scores a batch of items.

Ray ships the class to its workers by reference, so it must stay importable by its module
path (``hydra_deploy.distributed.ray_score.actors.HydraScorer``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from hydra_deploy.distributed.ray_score.parts import SCALAR_COLUMNS, decision_columns
from hydra_deploy.distributed.ray_score.shards import batch_items
from hydra_deploy.engines.preprocess import UnreadableImageError, preprocess_image
from hydra_deploy.engines.runner import load_runner
from hydra_deploy.engines.scoring import check_member_logits, score_batch
from hydra_deploy.engines.sources import prepare
from hydra_deploy.errors import RunnerError

if TYPE_CHECKING:
    from hydra_deploy.engines.runner_base import Runner


class HydraScorer:
    """The Ray Data UDF: one runner (one ONNX Runtime session) per actor; a numpy batch of
    ``shard``, ``index``, ``source`` (absolute image path or text; with ``pair``, the second
    text of sentence pairs) in, score columns out.

    ``decisions``: the decision columns the driver planned (from the export's record; empty:
    raw scores only, the record not loaded); the runner's record must give the same.
    ``skip_unreadable``: an image that cannot be decoded gets its reason in the ``unreadable``
    column (its scores are masked when the part is written) instead of failing the batch."""

    def __init__(
        self,
        export_dir: str,
        kind: str,
        *,
        threads: int = 1,
        batch_size: int | None = None,
        member_logits: bool = False,
        providers: Sequence[Any] | None = None,
        delay_s: float = 0.0,
        decisions: Sequence[str] = (),
        allow_decisions_mismatch: bool = False,
        skip_unreadable: bool = False,
    ) -> None:

        self.runner: Runner = load_runner(
            export_dir,
            providers=providers,
            threads=threads,
            decisions=bool(decisions),
            allow_decisions_mismatch=allow_decisions_mismatch,
        )
        got = decision_columns(self.runner.decisions)
        if got != list(decisions):  # hydra.json changed since the driver read it
            raise RunnerError(
                f"{export_dir}: the decisions in hydra.json give the columns {got}, the run "
                f"writes {list(decisions)}: it was calibrated again during the run; rerun with "
                "--overwrite"
            )
        self.decisions = list(decisions)
        check_member_logits(self.runner, self.runner.output_names)
        if kind == "images" and not self.runner.preprocessing:
            raise RunnerError(
                f"{export_dir}: hydra.json has no preprocessing config; re-export the model"
            )
        self.kind = kind
        self.encoder = self.runner.text_encoder() if kind == "text" else None
        self.batch_size = batch_size
        self.member_logits = member_logits
        self.delay_s = float(delay_s)
        self.skip_unreadable = skip_unreadable and kind == "images"

    def _inputs(self, items: list[Any]) -> tuple[Any, list[str]]:
        """The model's inputs for ``items`` and, per item, why it could not be read ("": it
        was). A skipped image is fed as zeros (its scores are masked when the part is written)."""
        if not self.skip_unreadable:
            return prepare(self.runner, self.kind, items, self.encoder), [""] * len(items)
        config = self.runner.preprocessing
        arrays, reasons = [], []
        for path in items:
            try:
                arrays.append(preprocess_image(path, config))
                reasons.append("")
            except UnreadableImageError as err:
                arrays.append(None)
                reasons.append(err.reason)
        blank = np.zeros(tuple(config["input_size"]), np.float32)
        return np.stack([blank if a is None else a for a in arrays]), reasons

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        inputs, unreadable = self._inputs(batch_items(batch))
        scores = score_batch(self.runner, inputs, batch_size=self.batch_size)
        logits = scores["member_logits"]
        columns = {
            "shard": np.asarray(batch["shard"], dtype=np.int64),
            "index": np.asarray(batch["index"], dtype=np.int64),
            "prediction": scores["prediction"].astype(np.int64),
            **{name: scores[name].astype(np.float32) for name in SCALAR_COLUMNS},
            "probs": scores["probs"].astype(np.float32),
            **{name: scores[name] for name in self.decisions},
            "unreadable": np.asarray(unreadable, dtype=str),
        }
        if self.member_logits:
            columns["member_logits"] = np.asarray(logits, dtype=np.float32)
        if self.delay_s:
            time.sleep(self.delay_s)
        return columns
