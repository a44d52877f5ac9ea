"""The PyTorch runner: a fused Hydra model (``fuse(...)``'s ``HydraModel``) behind the same
:class:`~hydra_deploy.engines.runner_base.Runner` interface as the ONNX Runtime and TensorRT
runners, so ``hydra_deploy.evaluation.evaluate`` and ``hydra-calibrate`` score it the same way.

Outside :mod:`hydra_deploy.engines` because it runs torch (the edge runtime never imports it);
torch itself is imported when the model runs, so importing this module stays cheap.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from hydra_deploy.engines.runner_base import TensorSpec
from hydra_deploy.errors import HydraError
from hydra_deploy.families import get_family

__all__ = ["TorchRunner"]


class TorchRunner:
    """A fused PyTorch Hydra model (``fuse(...)``'s ``HydraModel``) called like an engine runner.

    ``runner(inputs)`` takes numpy arrays (pixel values, or a dict of ``input_ids`` /
    ``attention_mask`` / ``token_type_ids`` for text models) and returns ``{"member_logits":
    [B, M, C]}`` in float32, computed under ``torch.inference_mode()`` on the model's device.
    Text files need a tokenizer, which a bare PyTorch model lacks: pass token arrays instead.
    """

    def __init__(self, model: Any) -> None:
        if not hasattr(model, "num_members") or not hasattr(model, "spec"):
            raise HydraError(
                f"{type(model).__name__} is not a fused Hydra model (hydra_deploy.fusion.fuse "
                "returns one); wrap other models in a callable returning {'member_logits': ...}"
            )
        self.model = model.eval()
        self.family = getattr(model, "family", None)
        self.class_names = getattr(model, "class_names", None)  # labels map through them
        family = get_family(self.family or "vit")
        self.input_names = family.input_names if family.text else ()
        self.preprocessing = getattr(model, "preprocessing", None)  # image folders, as exported
        self.max_batch: int | None = None  # any batch
        self.decisions = None  # a PyTorch model carries no calibration
        self.precision: str | None = None
        # text: the family's token inputs; an image model's input size is known when it runs
        self.inputs = tuple(TensorSpec(n, (None, None), "int64") for n in self.input_names)
        members, classes = getattr(model, "num_members", None), getattr(model, "num_classes", None)
        self.outputs = (TensorSpec("member_logits", (None, members, classes), "float32"),)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.outputs)

    def __call__(
        self, inputs: Any, batch_size: int | None = None, allow_nonfinite: bool = False
    ) -> dict[str, np.ndarray]:
        import torch

        device = next(self.model.parameters()).device
        if isinstance(inputs, Mapping):
            missing = "input_ids" not in inputs
            if missing or not self.input_names:
                raise HydraError(
                    f"this {type(self.model).__name__} takes "
                    + ("input_ids (and attention_mask)" if self.input_names else "one image array")
                    + f", got the arrays {sorted(inputs)}"
                )
            args = [
                torch.as_tensor(np.asarray(inputs[k]), device=device) if k in inputs else None
                for k in self.input_names
            ]
        else:
            if self.input_names:
                raise HydraError(
                    "a text model needs a dict of input_ids and attention_mask arrays, got one "
                    "array; pass {'input_ids': ..., 'attention_mask': ...}"
                )
            args = [torch.as_tensor(np.asarray(inputs, dtype=np.float32), device=device)]
        with torch.inference_mode():
            logits = self.model(*args)
        return {"member_logits": logits.float().cpu().numpy()}

    def text_encoder(self) -> Any:
        raise HydraError(
            "a PyTorch Hydra model has no tokenizer: evaluate text as token arrays (a .npz or a "
            "dict with input_ids and attention_mask), or evaluate the export folder"
        )

    def close(self) -> None:
        """Nothing to free: the model stays the caller's."""

    def __enter__(self) -> TorchRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
