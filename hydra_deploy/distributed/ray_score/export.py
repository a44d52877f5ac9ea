"""The export, as the driver sees it: hydra.json only (the driver opens no session), its
decisions (hydra-calibrate) checked against model.onnx before Ray starts."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from hydra_deploy.errors import RunnerError
from hydra_deploy.export_folder import MODEL_FILE, DecisionRecord, file_sha256, read_info
from hydra_deploy.families import get_family

DEFAULT_BATCH_SIZE = 32  # an export without a batch profile


@dataclass(frozen=True)
class DriverExport:
    """What the driver needs of an export folder: read from hydra.json, model.onnx hashed."""

    path: Path
    onnx_sha256: str
    family: str
    class_names: list[str] | None
    batch_opt: int | None
    batch_max: int | None
    has_preprocessing: bool
    decisions: DecisionRecord | None = None  # hydra-calibrate's record, checked against the model

    @classmethod
    def read(
        cls,
        export_dir: str | os.PathLike,
        *,
        decisions: bool = True,
        allow_decisions_mismatch: bool = False,
    ) -> DriverExport:
        """``decisions``: keep the export's decisions (refused when fitted on another
        model.onnx, or on other numbers than ONNX Runtime's, which the actors run, as a runner
        refuses them; ``allow_decisions_mismatch``: applied anyway, with a warning); False: leave
        them out (raw scores only)."""
        folder = Path(export_dir)
        if not folder.exists():
            raise RunnerError(
                f"the export folder {str(folder)!r} does not exist; give a folder written by "
                "hydra-export --out"
            )
        onnx_path = folder / MODEL_FILE
        if not folder.is_dir() or not onnx_path.is_file():
            raise RunnerError(
                f"{str(folder)!r} is not an export folder: {MODEL_FILE} is missing (make one with "
                "hydra-export --out DIR)"
            )
        info = read_info(folder)  # preprocessing, batch profile, class names: the one reader
        try:
            digest = file_sha256(onnx_path)
        except OSError as err:
            raise RunnerError(f"cannot read {onnx_path}: {err}") from err
        profile = info.batch_profile
        record = info.decisions if decisions else None
        if record is not None:
            record.check_fitted_on(digest, str(folder))
            warning = record.check_numbers(
                "onnxruntime",
                info.precision,
                folder=str(folder),
                folder_precision=info.precision,
                allow_mismatch=allow_decisions_mismatch,
            )
            if warning:
                logging.getLogger("hydra_deploy").warning("%s", warning)
        return cls(
            path=folder.absolute(),
            onnx_sha256=digest,
            family=info.family or "vit",
            class_names=None if info.class_names is None else list(info.class_names),
            batch_opt=None if profile is None else profile[1],
            batch_max=None if profile is None else profile[2],
            has_preprocessing=bool(info.preprocessing),
            decisions=record,
        )

    @property
    def decisions_sha256(self) -> str | None:
        """A hash of the decisions record applied (None: none), for the manifest."""
        if self.decisions is None:
            return None
        text = json.dumps(self.decisions.to_dict(), sort_keys=True)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    @property
    def kind(self) -> str:
        """``"text"`` or ``"images"``: what the export's family takes."""
        return get_family(self.family).input_kind

    def default_batch_size(self) -> int:
        """The batch profile's opt, capped at its max (no profile: 32)."""
        size = self.batch_opt or self.batch_max or DEFAULT_BATCH_SIZE
        return min(size, self.batch_max) if self.batch_max else size
