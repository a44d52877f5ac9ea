"""Reading checkpoints from local files: .safetensors, .pth/.pt/.bin state dicts, timm/HF folders."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import torch

from hydra_deploy.errors import CheckpointError, spelled
from hydra_deploy.optional import lazy_module

timm = lazy_module("timm", purpose="reading checkpoints", error=CheckpointError)

#: where timm's and open_clip's pretrained weights come from
HUB_HOST = "huggingface.co"

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.pth", "model.pt")
STATE_DICT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".ckpt")


def weights_file(checkpoint: str | os.PathLike) -> Path:
    """The weights file a checkpoint path names: the file itself, or the weights inside a folder."""
    path = Path(checkpoint).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not exist; pass a local .safetensors/.pth file, a folder "
            "holding model.safetensors (timm / Hugging Face layout), or checkpoint=None for random weights"
        )
    if path.is_dir():
        for name in WEIGHT_FILES:
            if (path / name).is_file():
                return path / name
        raise CheckpointError(
            f"folder {str(path)!r} holds none of {', '.join(WEIGHT_FILES)}; point checkpoint at the "
            "weights file itself"
        )
    if path.suffix.lower() not in STATE_DICT_SUFFIXES:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has an unknown extension {path.suffix!r}; "
            f"expected one of {', '.join(STATE_DICT_SUFFIXES)} or a folder"
        )
    return path


def hub_unreachable_reason(host: str = HUB_HOST, timeout_s: float = 3.0) -> str | None:
    """Why a download from ``host`` cannot work now (``HF_HUB_OFFLINE``, no connection), found in
    seconds rather than after minutes of retries; None when it is reachable."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False"):
        return "HF_HUB_OFFLINE is set"
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
        return None
    except OSError as err:
        return f"{host} is unreachable ({err})"


def folder_config(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """The ``config.json`` beside a checkpoint folder (timm hub layout), or {} when there is none."""
    path = Path(checkpoint).expanduser()
    config_path = path / "config.json" if path.is_dir() else path.with_name("config.json")
    if not config_path.is_file():
        return {}
    try:
        return json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {str(config_path)!r}: {err}") from err


def read_state_dict(checkpoint: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Load a state dict from a local checkpoint (unwrapping ``state_dict``/``model``/EMA keys)."""
    path = weights_file(checkpoint)
    try:  # safetensors reports an unreadable file as "No such file or directory"
        path.open("rb").close()
    except OSError as err:
        raise CheckpointError(
            f"cannot read checkpoint {str(path)!r}: {err.strerror or err}; check the file's "
            "permissions"
        ) from err
    try:
        state_dict = timm.models.load_state_dict(
            str(path), use_ema=True, device="cpu", weights_only=True
        )
    except Exception as err:  # corrupt file, pickle refused by weights_only, truncated safetensors
        raise CheckpointError(
            f"cannot read checkpoint {str(path)!r} ({type(err).__name__}: {err}); is the file complete "
            "and a PyTorch state dict or safetensors file?"
        ) from err
    if not isinstance(state_dict, dict) or not state_dict:
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds no state dict (got {type(state_dict).__name__})"
        )
    bad = [k for k, v in state_dict.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds entries that are not tensors: {bad[:5]}; save "
            "model.state_dict() instead of a full training checkpoint"
        )
    return state_dict


def load_into(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """``model.load_state_dict(strict=True)`` with an error that names the mismatching keys."""
    own = model.state_dict()
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    wrong_shape = [
        f"{k}: checkpoint {tuple(state_dict[k].shape)} vs model {tuple(v.shape)}"
        for k, v in own.items()
        if k in state_dict and tuple(state_dict[k].shape) != tuple(v.shape)
    ]
    if missing or unexpected or wrong_shape:
        parts = []
        if wrong_shape:
            parts.append("shape mismatch: " + "; ".join(wrong_shape[:4]))
        if missing:
            parts.append(f"{len(missing)} missing keys (e.g. {', '.join(missing[:4])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected keys (e.g. {', '.join(unexpected[:4])})")
        hint = (
            f"check that {spelled('the backbone name', '--backbone')} matches the checkpoint's "
            "architecture"
        )
        if not missing and not unexpected and all(s.startswith("head.") for s in wrong_shape):
            hint = (
                f"pass {spelled('num_classes', '--num-classes')} matching the checkpoint's "
                "classifier, or leave it out to size the classifier from the checkpoint"
            )
        raise CheckpointError(
            f"checkpoint {source!r} does not fit the model: {'; '.join(parts)}; {hint}"
        )
    model.load_state_dict(state_dict, strict=True)
