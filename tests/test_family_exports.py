"""Exports of the other families: OpenCLIP zero-shot and BERT, through ONNX and back."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_openclip import member_copy, tiny_adapter

from hydra_deploy.export import export_onnx, load_export
from hydra_deploy.fusion import fuse
from hydra_deploy.specs import HydraSpec


@pytest.mark.parametrize(("config", "finetuned"), [("tok", False), ("avg_ls_quickgelu", True)])
def test_openclip_exports_and_reloads(config, finetuned, tmp_path):
    backbone, _ = tiny_adapter(config)
    spec = HydraSpec.random(backbone.name, backbone.num_layers, backbone.num_heads,
                            backbone.head_dim, members=3, heads_per_member=2, seed=1)  # fmt: skip
    members = [member_copy(backbone, seed) for seed in range(3)] if finetuned else backbone
    hydra = fuse(members, spec, "grouped" if finetuned else "average")
    out = tmp_path / "clip"
    info = export_onnx(hydra, out, batch=(1, 2, 4), uq_outputs=True, exporter="auto")
    assert info["exporter"] == "dynamo" and info["graph_passes"]["fold_attention_scale"] == backbone.num_layers
    assert info["family"] == "openclip" and info["validation"]["passed"]
    assert info["class_names"] == hydra.class_names and len(hydra.class_names) == hydra.num_classes
    rebuilt = load_export(out)  # rebuilt from the folder alone, checked against model.onnx
    x = hydra.example_inputs(3, seed=4)
    with torch.no_grad():
        np.testing.assert_allclose(rebuilt(x).numpy(), hydra(x).numpy(), atol=1e-5, rtol=0)
    saved = json.loads((out / "hydra.json").read_text())
    assert saved["backbone_kwargs"]["model_name"] == hydra.backbone_kwargs["model_name"]
