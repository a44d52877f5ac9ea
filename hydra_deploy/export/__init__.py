"""Export: a HydraModel -> ONNX (+ hydra.json and weights), validated against PyTorch."""

from hydra_deploy.export.exporter import export_onnx
from hydra_deploy.export.load import load_export
from hydra_deploy.export.validate import validate_onnx

__all__ = ["export_onnx", "load_export", "validate_onnx"]
