"""torch -> ONNX, with the exporter's version traps handled in this one place.

- torch >= 2.9 exports with the dynamo exporter by default; it needs ``onnxscript``. The TorchScript
  exporter (``dynamo=False``) is the fallback and can be asked for.
- A dynamic batch axis is traced with batch >= 2 (a batch of 1 invites specialisation), declared
  explicitly, and checked in the written file: an axis that came out fixed is re-pinned to a
  symbolic ``batch`` dimension.
- Weights go into the single ``.onnx`` file (``external_data=False``) unless the model is too big
  for one protobuf (2 GiB), where external data is unavoidable.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import warnings
from pathlib import Path

import torch

from hydra_deploy.errors import ExportError

logger = logging.getLogger("hydra_deploy")

EXPORTERS = ("auto", "dynamo", "torchscript")
PROTOBUF_LIMIT = 2**31 - 1


def resolve_exporter(exporter: str) -> str:
    if exporter not in EXPORTERS:
        raise ExportError(f"unknown exporter {exporter!r}; choose one of {EXPORTERS}")
    has_onnxscript = importlib.util.find_spec("onnxscript") is not None
    if exporter == "auto":
        return "dynamo" if has_onnxscript else "torchscript"
    if exporter == "dynamo" and not has_onnxscript:
        raise ExportError("the dynamo exporter needs onnxscript: pip install onnxscript")
    return exporter


def export_module(
    module: torch.nn.Module,
    example: torch.Tensor,
    path: Path,
    *,
    input_name: str,
    output_names: list[str],
    opset: int,
    max_batch: int,
    exporter: str = "auto",
) -> str:
    """Write ``module`` to ``path`` with a dynamic batch; returns the exporter used.

    With ``exporter="auto"`` a dynamo export that fails, or that cannot be brought down to the
    requested opset (the exporter implements opset 18 and converts), is retried with TorchScript.
    """
    chosen = resolve_exporter(exporter)
    try:
        return _export_with(
            chosen, module, example, path, input_name, output_names, opset, max_batch
        )
    except ExportError as err:
        if exporter != "auto" or chosen != "dynamo":
            raise
        logger.info("dynamo export unusable (%s); retrying with the TorchScript exporter", err)
        return _export_with("torchscript", module, example, path, input_name, output_names, opset,
                            max_batch)  # fmt: skip


def _export_with(exporter, module, example, path, input_name, output_names, opset, max_batch):
    import onnx

    if example.shape[0] < 2:
        raise ExportError("trace the export with a batch of at least 2 (a batch of 1 specialises)")
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    external = params > PROTOBUF_LIMIT
    module = module.eval()
    with torch.no_grad(), warnings.catch_warnings(), _quiet_loggers("torch.onnx", "onnxscript"):
        warnings.simplefilter("ignore")  # tracer and exporter chatter; the file is validated after
        try:
            if exporter == "dynamo":
                batch = torch.export.Dim("batch", min=1, max=max(max_batch, 2))
                torch.onnx.export(
                    module, (example,), str(path), dynamo=True, opset_version=opset,
                    input_names=[input_name], output_names=output_names,
                    dynamic_shapes={input_name: {0: batch}}, external_data=external,
                    verbose=False,
                )  # fmt: skip
            else:
                axes = {name: {0: "batch"} for name in [input_name, *output_names]}
                torch.onnx.export(
                    module, (example,), str(path), dynamo=False, opset_version=opset,
                    input_names=[input_name], output_names=output_names, dynamic_axes=axes,
                    do_constant_folding=True,
                )  # fmt: skip
        except Exception as err:
            raise ExportError(
                f"the {exporter} exporter failed ({type(err).__name__}: {str(err)[:300]}); try "
                f"exporter={'torchscript' if exporter == 'dynamo' else 'dynamo'}"
            ) from err
    model = onnx.load(str(path), load_external_data=False)
    if _default_opset(model) != opset:
        written = _default_opset(model)
        try:
            model = onnx.version_converter.convert_version(model, opset)
            onnx.checker.check_model(model)  # the converter can write ops the opset lacks
        except Exception as err:
            raise ExportError(
                f"the {exporter} exporter wrote opset {written} and it does not convert to "
                f"{opset} ({type(err).__name__}: {str(err)[:200]}); ask for opset={written}"
            ) from err
        onnx.save(model, str(path))
    if _pin_batch(model, [input_name, *output_names]):
        onnx.save(model, str(path))
    return exporter


@contextlib.contextmanager
def _quiet_loggers(*names: str):
    """Silence other libraries' INFO/WARNING lines (opset notes, optimizer reports) for a while."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _default_opset(model) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), -1)


def _pin_batch(model, names: list[str]) -> bool:
    """Make axis 0 of the named inputs/outputs the symbolic ``batch``; True when anything changed."""
    changed = False
    for value in [*model.graph.input, *model.graph.output]:
        if value.name not in names:
            continue
        dim = value.type.tensor_type.shape.dim[0]
        if dim.dim_param != "batch":
            logger.info("re-pinning axis 0 of %s to a dynamic batch (was %s)", value.name,
                        dim.dim_param or dim.dim_value)  # fmt: skip
            dim.ClearField("dim_value")
            dim.dim_param = "batch"
            changed = True
    return changed
