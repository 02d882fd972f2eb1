"""A plain deep chain of equal blocks: the textbook case for checkpointing."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchckpt._units import check_positive_int
from torchckpt.executor.policies import tag

__all__ = ["MLP", "mlp"]


class MLPBlock(nn.Module):
    """Linear -> GELU -> dropout, width to width."""

    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(F.gelu(tag(self.linear(x), "linear")))


class MLP(nn.Module):
    """``depth`` equal blocks between an input projection and a classifier head.

    ``model(x)`` gives logits; ``model(x, labels)`` the mean cross-entropy.

    Example:
        >>> model = mlp(depth=4, width=32)
        >>> x, labels = model.example_batch(batch_size=3)
        >>> model(x, labels).shape
        torch.Size([])
    """

    def __init__(self, depth: int, width: int, in_features: int = 64, classes: int = 10,
                 dropout: float = 0.1) -> None:
        super().__init__()
        for option, value in (("depth", depth), ("width", width), ("in_features", in_features),
                              ("classes", classes)):
            check_positive_int(f"MLP.{option}", value)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"mlp: dropout must be in [0, 1); got {dropout!r}")
        self.in_features, self.classes = in_features, classes
        self.embed = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(MLPBlock(width, dropout) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)
        return logits if labels is None else F.cross_entropy(logits, labels)

    def example_batch(self, batch_size: int = 64, seed: int = 0,
                      device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Random features and class labels: ``model(*batch)`` is the loss.

        Example:
            >>> x, labels = mlp(2, 8).example_batch(batch_size=4)
            >>> x.shape, labels.shape
            (torch.Size([4, 64]), torch.Size([4]))
        """
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(batch_size, self.in_features, generator=generator)
        labels = torch.randint(0, self.classes, (batch_size,), generator=generator)
        return x.to(device), labels.to(device)


def mlp(depth: int = 16, width: int = 256, *, in_features: int = 64, classes: int = 10,
        dropout: float = 0.1) -> MLP:
    """Build the built-in deep MLP (``depth`` blocks of ``width`` units).

    Example:
        >>> len(mlp(depth=3, width=16).blocks)
        3
    """
    return MLP(depth, width, in_features=in_features, classes=classes, dropout=dropout)
