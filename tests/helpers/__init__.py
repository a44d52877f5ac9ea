"""Builders and constants the tests share, by topic: ``vit`` (tiny timm ViTs, scrambled weights,
the digits ViT), ``bert`` (tiny BERTs, a tiny text export), ``openclip`` (tiny OpenCLIP models),
``members`` (random specs and fine-tuned-looking member copies), ``text_data`` (the keyword
sentences of the text user story), ``trt_standins`` (TensorRT, Polygraphy and trtexec),
``int8`` (INT8 export folders quantized by ONNX Runtime: static Q/DQ, dynamic, asymmetric, uint8),
``bench`` (the latency benchmark on a tiny ViT), ``progress`` (hydra_deploy.progress's lines
in a test's log) and ``ray_local`` (a local Ray cluster for a test module).

Tests import them as ``from helpers.vit import tiny_vit`` (pyproject.toml puts ``tests/`` on the
path); conftest.py holds only fixtures and hooks, and no test imports from another test module.
"""
