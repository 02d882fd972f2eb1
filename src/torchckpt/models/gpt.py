"""A decoder-only transformer (GPT-2 style, pre-norm) for demos, tests and benchmarks.

``gpt("small")`` is nanoGPT's character-level configuration: 12 layers, width 384, 6 heads, byte
vocabulary (256). Blocks live in ``model.blocks`` (an ``nn.ModuleList``); the token embedding and the
output head share their weight, as in GPT-2. Inside a block, the attention output is tagged
``"attention"`` and the MLP's hidden pre-activation ``"mlp_hidden"`` for the name-based policies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchckpt.executor.policies import tag
from torchckpt.models._config import check_config, sized_config

__all__ = ["GPTConfig", "GPT", "gpt", "GPT_SIZES"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a :class:`GPT`. ``dropout`` applies to embeddings and to both residual branches."""

    vocab_size: int = 256
    max_seq_len: int = 1024
    n_layer: int = 12
    n_head: int = 6
    d_model: int = 384
    dropout: float = 0.1

    def __post_init__(self) -> None:
        check_config(self, ("vocab_size", "max_seq_len", "n_layer", "n_head", "d_model"))
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig.d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")


GPT_SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=2, n_head=4, d_model=64, max_seq_len=256),
    "mini": GPTConfig(n_layer=6, n_head=4, d_model=128, max_seq_len=512),
    "small": GPTConfig(n_layer=12, n_head=6, d_model=384),
    "medium": GPTConfig(n_layer=24, n_head=8, d_model=512),
}


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``scaled_dot_product_attention``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        shape = (batch, seq, self.n_head, width // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = tag(F.scaled_dot_product_attention(q, k, v, is_causal=True), "attention")
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class MLP(nn.Module):
    """Position-wise feed-forward: width -> 4 x width -> GELU -> width."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.proj = nn.Linear(4 * config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(tag(self.fc(x), "mlp_hidden")))


class Block(nn.Module):
    """Pre-norm transformer block with dropout on both residual branches."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    """Decoder-only transformer. ``model(idx)`` gives logits; ``model(idx, targets)`` the mean loss.

    Example:
        >>> model = gpt("tiny")
        >>> idx, targets = model.example_batch(batch_size=2, seq_len=16)
        >>> model(idx, targets).shape
        torch.Size([])
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.max_seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # weight tying, as GPT-2
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        seq = idx.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"GPT: sequence length {seq} exceeds max_seq_len={self.config.max_seq_len}; "
                             "use shorter sequences or a config with a larger max_seq_len")
        positions = torch.arange(seq, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    def example_batch(self, batch_size: int = 8, seq_len: int = 256, seed: int = 0,
                      device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Random token ids and next-token targets: ``model(*batch)`` is the loss.

        Example:
            >>> idx, targets = gpt("tiny").example_batch(batch_size=2, seq_len=8)
            >>> idx.shape, targets.shape
            (torch.Size([2, 8]), torch.Size([2, 8]))
        """
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, self.config.vocab_size, (batch_size, seq_len + 1), generator=generator)
        return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)


def gpt(size: str = "small", **overrides: object) -> GPT:
    """Build the built-in GPT of a named size (``tiny``, ``mini``, ``small``, ``medium``).

    Keyword overrides replace config fields, e.g. ``gpt("small", dropout=0.0, n_layer=4)``.

    Example:
        >>> gpt("tiny").config.n_layer
        2
    """
    config = sized_config("gpt", GPT_SIZES, size, overrides)
    return GPT(config)
