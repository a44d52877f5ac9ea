"""Exports of the other families: OpenCLIP zero-shot and BERT, through ONNX and back."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import perturbed_members
from test_bert import tiny_bert
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


# --- BERT ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("precision", "finetuned"), [("fp32", False), ("fp32", True),
                                                      ("fp16", False), ("bf16", True)])  # fmt: skip
def test_bert_exports_with_padding_and_reloads(precision, finetuned, tmp_path):
    """ORT equals PyTorch at batch 1, 3, 4 and lengths 5 and 23 (padded rows); folder reloads."""
    import onnx

    from hydra_deploy.engines.runner import load_runner
    from hydra_deploy.export.precision import attention_casts

    backbone = tiny_bert("segments")
    spec = HydraSpec.random(backbone.name, backbone.num_layers, backbone.num_heads,
                            backbone.head_dim, members=3, heads_per_member=2, seed=2)  # fmt: skip
    members = perturbed_members(backbone, 3, seed=3) if finetuned else backbone
    hydra = fuse(members, spec, "grouped" if finetuned else "average")
    out = tmp_path / "bert"
    info = export_onnx(hydra, out, batch=(1, 2, 4), precision=precision, uq_outputs=True)
    assert info["validation"]["passed"] and info["exporter"] == "dynamo"
    assert list(info["validation"]["batches"]) == ["1", "3", "4", "3x5", "3x23"]
    assert info["graph_passes"]["fold_attention_scale"] == backbone.num_layers  # through the mask
    assert [i["name"] for i in info["inputs"]] == ["input_ids", "attention_mask", "token_type_ids"]
    assert all(i["shape"] == ["batch", "sequence"] and i["dtype"] == "int64" for i in info["inputs"])
    model = onnx.load(str(out / "model.onnx"))
    assert attention_casts(model) == 0
    rebuilt = load_export(out)  # checked against model.onnx in the file's precision
    x = hydra.example_inputs(3, seed=9, seq_len=11)
    with torch.no_grad():
        np.testing.assert_allclose(rebuilt(*x).numpy(), hydra(*x).numpy(), atol=1e-5, rtol=0)
    if precision == "fp32":  # the runner feeds the three int64 inputs by name
        runner = load_runner(out)
        got = runner(dict(zip(hydra.input_names, (t.numpy() for t in x), strict=True)))
        with torch.no_grad():
            np.testing.assert_allclose(got["member_logits"], hydra(*x).numpy(), atol=1e-4, rtol=0)
