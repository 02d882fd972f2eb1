"""A convolutional U-Net with skip connections: a non-chain model for the planner and the executor.

Encoder activations live until the decoder stage at the same resolution consumes them, so memory is
not a simple chain. ``model(x, target)`` is the mean-squared error (a denoising-style objective).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchckpt.executor.policies import tag
from torchckpt.models._config import check_config, sized_config

__all__ = ["UNetConfig", "UNet", "unet", "UNET_SIZES"]


@dataclass(frozen=True, kw_only=True)
class UNetConfig:
    """Shape of a :class:`UNet`: ``levels`` resolutions, channels doubling from ``base_channels``."""

    in_channels: int = 3
    base_channels: int = 32
    levels: int = 3
    blocks_per_level: int = 2
    groups: int = 8
    dropout: float = 0.1

    def __post_init__(self) -> None:
        check_config(self, ("in_channels", "base_channels", "levels", "blocks_per_level", "groups"))
        if self.base_channels % self.groups:
            raise ValueError(f"UNetConfig.base_channels ({self.base_channels}) must be divisible by "
                             f"groups ({self.groups})")


UNET_SIZES: dict[str, UNetConfig] = {
    "tiny": UNetConfig(base_channels=8, levels=2, blocks_per_level=1, groups=4),
    "small": UNetConfig(base_channels=32, levels=3, blocks_per_level=2),
    "medium": UNetConfig(base_channels=64, levels=4, blocks_per_level=2),
}


class ResBlock(nn.Module):
    """GroupNorm -> SiLU -> conv -> GroupNorm -> SiLU -> dropout -> conv, plus a (projected) shortcut."""

    def __init__(self, in_channels: int, out_channels: int, groups: int, dropout: float) -> None:
        super().__init__()
        self.norm_1 = nn.GroupNorm(groups, in_channels)
        self.conv_1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.norm_2 = nn.GroupNorm(groups, out_channels)
        self.drop = nn.Dropout(dropout)
        self.conv_2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.shortcut = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = tag(self.conv_1(F.silu(self.norm_1(x))), "conv_1")
        h = self.conv_2(self.drop(F.silu(self.norm_2(h))))
        return self.shortcut(x) + h


class UNet(nn.Module):
    """U-Net: ``down`` blocks (with pooling between levels), ``mid``, ``up`` blocks fed by skips.

    Example:
        >>> model = unet("tiny")
        >>> x, target = model.example_batch(batch_size=2, image_size=16)
        >>> model(x, target).shape
        torch.Size([])
    """

    def __init__(self, config: UNetConfig) -> None:
        super().__init__()
        self.config = config
        c, g, p = config.base_channels, config.groups, config.dropout
        self.stem = nn.Conv2d(config.in_channels, c, 3, padding=1)
        widths = [c * 2**level for level in range(config.levels)]
        self.down = nn.ModuleList()
        self.up = nn.ModuleList()
        channels = c
        skip_channels = []
        for width in widths:
            for _ in range(config.blocks_per_level):
                self.down.append(ResBlock(channels, width, g, p))
                channels = width
                skip_channels.append(channels)
        self.mid = ResBlock(channels, channels, g, p)
        for width in reversed(widths):
            for _ in range(config.blocks_per_level):
                self.up.append(ResBlock(channels + skip_channels.pop(), width, g, p))
                channels = width
        self.out = nn.Conv2d(channels, config.in_channels, 3, padding=1)

    def forward(self, x: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        size = 2 ** (self.config.levels - 1)
        if x.shape[-1] % size or x.shape[-2] % size:
            raise ValueError(f"UNet: image height and width must be divisible by {size}; got {tuple(x.shape[-2:])}")
        per_level = self.config.blocks_per_level
        h = self.stem(x)
        skips = []
        for i, block in enumerate(self.down):
            if i and i % per_level == 0:
                h = F.avg_pool2d(h, 2)
            h = block(h)
            skips.append(h)
        h = self.mid(h)
        for i, block in enumerate(self.up):
            if i and i % per_level == 0:
                h = F.interpolate(h, scale_factor=2.0, mode="nearest")
            h = block(torch.cat([h, skips.pop()], dim=1))
        prediction = self.out(h)
        if target is None:
            return prediction
        return F.mse_loss(prediction, target)

    def torchckpt_blocks(self) -> list[nn.Module]:
        """The blocks in forward order, for ``blocks="auto"``: down, middle, up (see remat.blocks).

        Example:
            >>> len(unet("tiny").torchckpt_blocks())
            5
        """
        return [*self.down, self.mid, *self.up]

    def example_batch(self, batch_size: int = 8, image_size: int = 64, seed: int = 0,
                      device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Noisy images and their clean targets: ``model(*batch)`` is the loss.

        Example:
            >>> x, target = unet("tiny").example_batch(batch_size=1, image_size=8)
            >>> x.shape
            torch.Size([1, 3, 8, 8])
        """
        generator = torch.Generator().manual_seed(seed)
        shape = (batch_size, self.config.in_channels, image_size, image_size)
        clean = torch.rand(shape, generator=generator)
        noisy = clean + 0.1 * torch.randn(shape, generator=generator)
        return noisy.to(device), clean.to(device)


def unet(size: str = "small", **overrides: object) -> UNet:
    """Build the built-in U-Net of a named size (``tiny``, ``small``, ``medium``).

    Example:
        >>> len(unet("tiny").down)
        2
    """
    config = sized_config("unet", UNET_SIZES, size, overrides)
    return UNet(config)
