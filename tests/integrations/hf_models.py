"""Small Hugging Face models built from configs (no downloads) and one training batch for each."""

from __future__ import annotations

from collections.abc import Callable

import torch
import transformers
from torch import nn

BATCH, SEQ, VOCAB = 4, 64, 256


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def llama() -> tuple[nn.Module, dict]:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=172, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      attention_dropout=0.1)
    ids = _ids()
    return transformers.LlamaForCausalLM(config).train(), {"input_ids": ids, "labels": ids}


def gpt2() -> tuple[nn.Module, dict]:
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=128)
    ids = _ids()
    return transformers.GPT2LMHeadModel(config).train(), {"input_ids": ids, "labels": ids}


def bert() -> tuple[nn.Module, dict]:
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=128)
    ids = _ids()
    masked = torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)) < 0.15
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    inputs = torch.where(masked, torch.full_like(ids, 3), ids)  # 3 plays [MASK]
    return transformers.BertForMaskedLM(config).train(), {"input_ids": inputs, "attention_mask": torch.ones_like(ids),
                                                           "labels": labels}


def t5() -> tuple[nn.Module, dict]:
    config = transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=3,
                                   num_decoder_layers=3, num_heads=4, decoder_start_token_id=0)
    return transformers.T5ForConditionalGeneration(config).train(), {"input_ids": _ids(), "labels": _ids(2)}


MODELS: dict[str, Callable[[], tuple[nn.Module, dict]]] = {"llama": llama, "gpt2": gpt2, "bert": bert, "t5": t5}


def freeze(model: nn.Module, how: str) -> None:
    """``none``; ``embeddings``: the input embedding is frozen (block 0's input needs no grad);
    ``lora``: every weight matrix is frozen, only 1-D parameters (norms, biases) train, as in adapters."""
    if how == "embeddings":
        model.get_input_embeddings().weight.requires_grad_(False)
    elif how == "lora":
        for param in model.parameters():
            if param.dim() >= 2:
                param.requires_grad_(False)
    elif how != "none":
        raise ValueError(how)
