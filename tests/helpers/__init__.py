"""Builders and constants the tests share, by topic: ``vit`` (tiny timm ViTs, scrambled weights,
the digits ViT), ``bert`` (tiny BERTs, a tiny text export), ``openclip`` (tiny OpenCLIP models),
``members`` (random specs and fine-tuned-looking member copies), ``text_data`` (the keyword
sentences of the text user story) and ``trt_standins`` (TensorRT, Polygraphy and trtexec).

Tests import them as ``from helpers.vit import tiny_vit`` (pyproject.toml puts ``tests/`` on the
path); conftest.py holds only fixtures and hooks, and no test imports from another test module.
"""
