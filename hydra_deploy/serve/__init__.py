"""Serving: Triton model repositories (``triton_repo``) and a live PyTriton server (``pytriton_app``).

Runtime code here imports numpy and the serving library only (never torch).
"""
