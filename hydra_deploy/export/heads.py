"""The ensemble (uncertainty) head that ``uq_outputs=True`` puts into the exported graph.

Same definitions as :func:`hydra_deploy.uncertainty.ensemble_scores` (natural log), computed in
float32 from the member logits, so an engine returns the scores without a numpy step.
"""

from __future__ import annotations

import torch
from torch import nn

from hydra_deploy.uncertainty.scores import GRAPH_SCORES

#: the graph's outputs after member_logits, in order (owned by hydra_deploy.uncertainty.scores)
UQ_OUTPUTS = GRAPH_SCORES


class WithEnsembleHead(nn.Module):
    """``hydra(x) -> (member_logits, probs, predictive_entropy, expected_entropy, MI, msp)``."""

    def __init__(self, hydra: nn.Module) -> None:
        super().__init__()
        self.hydra = hydra

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # sums and TopK rather than mean/amax: opset 18's ReduceMean/ReduceMax (axes as an input)
        # do not convert back to opset 17 cleanly, ReduceSum and TopK need no conversion
        member_logits = self.hydra(*inputs)  # [B, M, C]
        members = member_logits.shape[1]
        log_p = torch.log_softmax(member_logits.float(), dim=-1)
        member_probs = log_p.exp()
        probs = member_probs.sum(dim=1) / members  # [B, C]
        predictive = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)  # 0 log 0 = 0
        expected = -(member_probs * log_p).sum(-1).sum(dim=1) / members
        mutual = (predictive - expected).clamp_min(0.0)
        msp = probs.topk(1, dim=-1).values.squeeze(-1)
        return member_logits, probs, predictive, expected, mutual, msp
