"""Choosing the members: head importance, member selection, fine-tuning, and the data they use."""

from hydra_deploy.pruning.data import LabelledData, load_data, load_inputs
from hydra_deploy.pruning.finetune import FinetunedMembers, finetune_members, zero_pruned_heads
from hydra_deploy.pruning.importance import circuit_search, head_importance, taylor_importance
from hydra_deploy.pruning.selection import select_members

__all__ = [
    "FinetunedMembers",
    "LabelledData",
    "circuit_search",
    "finetune_members",
    "head_importance",
    "load_data",
    "load_inputs",
    "select_members",
    "taylor_importance",
    "zero_pruned_heads",
]
