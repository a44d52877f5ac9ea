"""Choosing the members: head importance, member selection, fine-tuning, and the data they use."""

from hydra_deploy.pruning.data import LabelledData, load_data

__all__ = ["LabelledData", "load_data"]
