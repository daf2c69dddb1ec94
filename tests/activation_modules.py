"""Small modules shared by the activation tests."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class NestedCheckpoint(nn.Module):
    """A block that checkpoints a piece of itself (with dropout): nested checkpoint regions."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(lambda t: F.dropout(self.a(t).tanh(), 0.2), x, use_reentrant=False)
        return self.b(h).sigmoid() * x
