"""torch -> ONNX, with the exporter's version traps handled in this one place.

- torch >= 2.9 exports with the dynamo exporter by default; it needs ``onnxscript``. The TorchScript
  exporter (``dynamo=False``) is the fallback and can be asked for.
- Dynamic axes (the batch; a text model's sequence too) are traced at sizes >= 2 (a size of 1
  invites specialisation), declared explicitly, and checked in the written file: an axis that came
  out fixed is re-pinned to its symbolic name (``batch``, ``sequence``).
- Weights go into the single ``.onnx`` file (``external_data=False``) unless the model is too big
  for one protobuf (2 GiB), where external data is unavoidable.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from hydra_deploy.errors import ExportError
from hydra_deploy.optional import lazy_module, missing, missing_message

onnx = lazy_module("onnx", purpose="exporting models to ONNX", error=ExportError)

logger = logging.getLogger("hydra_deploy")

EXPORTERS = ("auto", "dynamo", "torchscript")
PROTOBUF_LIMIT = 2**31 - 1


def resolve_exporter(exporter: str) -> str:
    if exporter not in EXPORTERS:
        raise ExportError(f"unknown exporter {exporter!r}; choose one of {EXPORTERS}")
    has_onnxscript = not missing("onnxscript")
    if exporter == "auto":
        return "dynamo" if has_onnxscript else "torchscript"
    if exporter == "dynamo" and not has_onnxscript:
        raise ExportError(
            missing_message(
                "onnxscript",
                purpose="the dynamo exporter",
                extra_hint="or use the torchscript exporter (hydra-export --exporter torchscript)",
            )
        )
    return exporter


def as_inputs(example: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A model's example inputs as a tuple (vision models give one tensor, text models several)."""
    return (example,) if isinstance(example, torch.Tensor) else tuple(example)


def export_module(
    module: torch.nn.Module,
    example: torch.Tensor | Sequence[torch.Tensor],
    path: Path,
    *,
    input_names: Sequence[str],
    output_names: list[str],
    opset: int,
    max_batch: int,
    exporter: str = "auto",
    dynamic_axes: dict[str, dict[int, str]] | None = None,
) -> str:
    """Write ``module`` to ``path`` with dynamic axes; returns the exporter used.

    ``example``: the traced input(s), in ``input_names`` order. ``dynamic_axes``: per input, axis ->
    symbolic name (default: axis 0 "batch" for every input); outputs get a dynamic batch. With
    ``exporter="auto"`` a dynamo export that fails, or that cannot be brought down to the requested
    opset (the exporter implements opset 18 and converts), is retried with TorchScript.
    """
    example = as_inputs(example)
    if len(example) != len(input_names):
        raise ExportError(f"{len(example)} example inputs for input names {list(input_names)}")
    axes = dynamic_axes or {name: {0: "batch"} for name in input_names}
    chosen = resolve_exporter(exporter)
    arguments = (module, example, path, list(input_names), output_names, opset, max_batch, axes)
    try:
        return _export_with(chosen, *arguments)
    except ExportError as err:
        if exporter != "auto" or chosen != "dynamo":
            raise
        logger.info("dynamo export unusable (%s); retrying with the TorchScript exporter", err)
        return _export_with("torchscript", *arguments)


def _export_with(
    exporter, module, example, path, input_names, output_names, opset, max_batch, axes
):
    """One try: trace ``module`` with ``exporter``, bring the file to ``opset``, pin its axes."""
    if example[0].shape[0] < 2:
        raise ExportError("trace the export with a batch of at least 2 (a batch of 1 specialises)")
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    if exporter == "dynamo":
        options = {
            "dynamo": True,
            "dynamic_shapes": _dynamo_shapes(module, example, input_names, axes, max_batch),
            "external_data": params > PROTOBUF_LIMIT,
            "verbose": False,
        }
    else:
        dynamic = {name: dict(axes.get(name, {})) for name in input_names}
        dynamic.update({name: {0: "batch"} for name in output_names})
        options = {"dynamo": False, "dynamic_axes": dynamic, "do_constant_folding": True}
    module = module.eval()
    with torch.no_grad(), warnings.catch_warnings(), _quiet_loggers("torch.onnx", "onnxscript"):
        warnings.simplefilter("ignore")  # tracer and exporter chatter; the file is validated after
        try:
            torch.onnx.export(
                module,
                example,
                str(path),
                opset_version=opset,
                input_names=list(input_names),
                output_names=output_names,
                **options,
            )
        except Exception as err:
            raise ExportError(
                f"the {exporter} exporter failed ({type(err).__name__}: {str(err)[:300]}); try "
                f"exporter={'torchscript' if exporter == 'dynamo' else 'dynamo'}"
            ) from err
    model = onnx.load(str(path), load_external_data=False)
    if _default_opset(model) != opset:
        model = _convert_opset(model, opset, exporter)
        onnx.save(model, str(path))
    pinned = {
        **{name: axes.get(name, {}) for name in input_names},
        **{name: {0: "batch"} for name in output_names},
    }
    if _pin_axes(model, pinned):
        onnx.save(model, str(path))
    return exporter


def _dynamo_shapes(module, example, input_names, axes, max_batch) -> tuple:
    """The dynamo exporter's ``dynamic_shapes``: one ``torch.export.Dim`` per symbolic name,
    shared across inputs (the batch up to ``max_batch``, other axes traced at >= 2), positional
    (a tuple in input order: wrappers take ``*inputs``, not the names)."""
    dims = {}
    for name, tensor in zip(input_names, example, strict=True):
        for axis, symbol in axes.get(name, {}).items():
            high = max(max_batch, 2) if symbol == "batch" else None
            if symbol not in dims:
                dims[symbol] = (
                    torch.export.Dim(symbol, min=1, max=high)
                    if high
                    else torch.export.Dim(symbol, min=2)
                )
            if symbol != "batch" and tensor.shape[axis] < 2:
                raise ExportError(f"trace {name} with {symbol} >= 2")
    shapes = tuple(
        {axis: dims[symbol] for axis, symbol in axes.get(name, {}).items()} for name in input_names
    )
    return (shapes,) if _takes_var_positional(module) else shapes  # forward(*inputs): one entry


def _convert_opset(model, opset: int, exporter: str):
    """``model`` converted to ``opset`` (the dynamo exporter writes 18 and converts), checked."""
    written = _default_opset(model)
    try:
        model = onnx.version_converter.convert_version(model, opset)
        onnx.checker.check_model(model)  # the converter can write ops the opset lacks
    except Exception as err:
        raise ExportError(
            f"the {exporter} exporter wrote opset {written} and it does not convert to "
            f"{opset} ({type(err).__name__}: {str(err)[:200]}); ask for opset={written}"
        ) from err
    return model


def _takes_var_positional(module: torch.nn.Module) -> bool:
    parameters = inspect.signature(module.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters)


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


def _pin_axes(model, axes: dict[str, dict[int, str]]) -> bool:
    """Give the named inputs/outputs their symbolic axes; True when anything changed."""
    changed = False
    for value in [*model.graph.input, *model.graph.output]:
        for axis, symbol in axes.get(value.name, {}).items():
            dim = value.type.tensor_type.shape.dim[axis]
            if dim.dim_param != symbol:
                logger.info(
                    "re-pinning axis %d of %s to a dynamic %s (was %s)",
                    axis,
                    value.name,
                    symbol,
                    dim.dim_param or dim.dim_value,
                )
                dim.ClearField("dim_value")
                dim.dim_param = symbol
                changed = True
    return changed
