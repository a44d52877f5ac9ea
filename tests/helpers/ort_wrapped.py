"""A runtime backend defined outside the package: ONNX Runtime wrapped as ``"ort-wrapped"``.

The whole of a backend: its runner (a :class:`~hydra_deploy.engines.runner_base.BaseRunner` that
opens the model, gives its tensors and runs one checked feed), the functions that open the kinds of
path it takes, and one row (:data:`WRAPPED_ORT`) for
:func:`~hydra_deploy.engines.backends.register_backend`. Its numbers are ONNX Runtime's, so the
row names them ``"onnxruntime"`` in a decisions record: decisions fitted in ONNX Runtime apply.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hydra_deploy.engines.backends import (
    RUNS_ONNX_FILE,
    Backend,
    RunRequest,
    export_beside_onnx,
    folder_model,
)
from hydra_deploy.engines.runner_base import BaseRunner, TensorSpec
from hydra_deploy.errors import RunnerError
from hydra_deploy.export_folder import INFO_FILE, ExportInfo, read_info
from hydra_deploy.optional import lazy_module

ort = lazy_module("onnxruntime", purpose="the wrapped ONNX Runtime backend", error=RunnerError)

_DTYPES = {"tensor(float)": "float32", "tensor(int64)": "int64", "tensor(bool)": "bool"}


class WrappedOrtRunner(BaseRunner):
    """An ONNX Runtime CPU session behind the runner template."""

    backend = "ort-wrapped"

    def __init__(self, onnx_path: Path, *, export: ExportInfo | None = None) -> None:
        self.session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])

        def specs(args: list) -> list[TensorSpec]:
            return [TensorSpec(a.name, tuple(a.shape), _DTYPES[a.type]) for a in args]

        profile = None if export is None else export.batch_profile
        super().__init__(
            onnx_path,
            specs(self.session.get_inputs()),
            specs(self.session.get_outputs()),
            providers=("CPUExecutionProvider",),
            max_batch=None if profile is None else profile[2],
            export=export,
        )

    def _run(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self.output_names, self.session.run(None, feed), strict=True))

    def close(self) -> None:
        self.session = None


def _open_folder(target: Path, asked: RunRequest) -> WrappedOrtRunner:
    export = read_info(target / INFO_FILE, required=False)
    return WrappedOrtRunner(folder_model(target), export=export)


def _open_onnx(target: Path, asked: RunRequest) -> WrappedOrtRunner:
    return WrappedOrtRunner(target, export=export_beside_onnx(target, asked.decisions))


#: The backend's row: register it with ``register_backend(WRAPPED_ORT)``.
WRAPPED_ORT = Backend(
    "ort-wrapped",
    runner=WrappedOrtRunner,
    opens={"export folder": _open_folder, ".onnx file": _open_onnx},
    aliases=("wrapped",),
    dependency="onnxruntime",
    proof=RUNS_ONNX_FILE,
    record_name="onnxruntime",
)
