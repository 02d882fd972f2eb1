"""Models and training loops nobody here wrote, round 3 (issue 28): families beyond outside_models.py (audio,
encoder-decoder, mixture-of-experts, state-space, vision with stochastic depth, diffusers, PEFT) and odd loops
(gradient accumulation, frozen leading layers, LayerDrop, NumPy's RNG, spectral norm, a GAN), each from a tiny
config with random weights (no downloads) and one micro-batch of data.

Every builder returns a ``Loop``; the library imports happen inside the builders, so this module imports without
them. ``NEEDS`` names the package each builder needs (transformers when absent).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

BATCH, SEQ, VOCAB, IMAGE = 4, 32, 128, 32


@dataclass
class Loop:
    model: nn.Module
    inputs: tuple | dict  # one micro-batch
    loss_fn: Callable[[Any], torch.Tensor] | None = None
    step_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None
    micro_batches: int = 1
    blocks: Any = "auto"  # or a callable model -> list of modules
    # a loop torchckpt refuses: a pattern its error must match, and the plan() arguments that error names as the fix
    # ({"blocks": "as the error names them"}: the module paths the error lists)
    refused: str | None = None
    fix: dict[str, Any] = field(default_factory=dict)
    expect_notes: dict[str, str] = field(default_factory=dict)  # plan note name -> text it must contain


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ids(seed: int = 0, batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=_gen(seed))


def _pixels(seed: int = 0, size: int = IMAGE) -> torch.Tensor:
    return torch.randn(BATCH, 3, size, size, generator=_gen(seed))


def _labels(classes: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, classes, (BATCH,), generator=_gen(seed))


def _lm(model: nn.Module, **options: Any) -> Loop:
    ids = _ids()
    return Loop(model.train(), {"input_ids": ids, "labels": ids}, **options)


# ---------------------------------------------------------------- decoders, mixture-of-experts, state-space
def llama_accumulating() -> Loop:
    """Gradient accumulation over 2 micro-batches (defect 2)."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, max_position_embeddings=2 * SEQ)
    return _lm(transformers.LlamaForCausalLM(config), micro_batches=2)


def mixtral() -> Loop:
    import transformers

    config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=2 * SEQ)
    return _lm(transformers.MixtralForCausalLM(config))


def qwen2_moe() -> Loop:
    import transformers

    config = transformers.Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                         moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=2 * SEQ)
    return _lm(transformers.Qwen2MoeForCausalLM(config))


def mamba() -> Loop:
    import transformers

    config = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=64, state_size=8, num_hidden_layers=3,
                                      expand=2, conv_kernel=4)
    return _lm(transformers.MambaForCausalLM(config))


def opt_layerdrop() -> Loop:
    """OPT with LayerDrop on (defect 5): every block may be skipped in a step."""
    import transformers

    config = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=4,
                                    num_attention_heads=4, max_position_embeddings=2 * SEQ, word_embed_proj_dim=64,
                                    layerdrop=0.2)
    return _lm(transformers.OPTForCausalLM(config), expect_notes={"regions": "layerdrop=0.2"})


def gpt_neox() -> Loop:
    import transformers

    config = transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                        num_attention_heads=4, max_position_embeddings=2 * SEQ, rotary_pct=0.5)
    return _lm(transformers.GPTNeoXForCausalLM(config))


def phi3() -> Loop:
    import transformers

    config = transformers.Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2 * SEQ,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return _lm(transformers.Phi3ForCausalLM(config))


def gemma() -> Loop:
    import transformers

    config = transformers.GemmaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                      max_position_embeddings=2 * SEQ)
    return _lm(transformers.GemmaForCausalLM(config))


# ---------------------------------------------------------------- encoder-decoders
def t5() -> Loop:
    """Its tied embedding's gradient is summed between two blocks' backward passes (defect 7)."""
    import transformers

    config = transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                   num_decoder_layers=2, num_heads=4, decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(config)
    return Loop(model.train(), {"input_ids": _ids(0), "labels": _ids(1, seq=SEQ // 2)})


def bart_layerdrop() -> Loop:
    import transformers

    config = transformers.BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                     decoder_ffn_dim=128, max_position_embeddings=2 * SEQ, encoder_layerdrop=0.1,
                                     decoder_layerdrop=0.1)
    model = transformers.BartForConditionalGeneration(config)
    return Loop(model.train(), {"input_ids": _ids(0), "labels": _ids(1, seq=SEQ // 2)},
                expect_notes={"regions": "encoder_layerdrop=0.1"})


def whisper() -> Loop:
    import transformers

    config = transformers.WhisperConfig(vocab_size=VOCAB, num_mel_bins=16, d_model=64, encoder_layers=2,
                                        decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                                        encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=32,
                                        max_target_positions=32, decoder_start_token_id=1, pad_token_id=0,
                                        bos_token_id=1, eos_token_id=2)
    model = transformers.WhisperForConditionalGeneration(config)
    features = torch.randn(BATCH, 16, 64, generator=_gen(0))  # 2 x max_source_positions frames
    return Loop(model.train(), {"input_features": features, "labels": _ids(1, seq=8) % (VOCAB - 3) + 3})


# ---------------------------------------------------------------- audio encoders
def _audio(kind: str, **extra: Any) -> Loop:
    import transformers

    configs = {"wav2vec2": transformers.Wav2Vec2Config, "hubert": transformers.HubertConfig,
               "wavlm": transformers.WavLMConfig}
    models = {"wav2vec2": transformers.Wav2Vec2ForCTC, "hubert": transformers.HubertForCTC,
              "wavlm": transformers.WavLMForCTC}
    config = configs[kind](hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
                           conv_dim=(32,) * 7, vocab_size=16, num_conv_pos_embeddings=16,
                           num_conv_pos_embedding_groups=4, mask_time_prob=0.05, **extra)  # layerdrop 0.1 default
    model = models[kind](config)
    inputs = {"input_values": torch.randn(2, 16000, generator=_gen(1)),
              "labels": torch.randint(1, 16, (2, 8), generator=_gen(2))}
    return Loop(model.train(), inputs, expect_notes={"regions": "layerdrop=0.1"})


def wav2vec2() -> Loop:
    """SpecAugment draws from NumPy (defect 4); LayerDrop 0.1 (defect 5): both defaults."""
    return _audio("wav2vec2")


def hubert() -> Loop:
    return _audio("hubert")


def wavlm() -> Loop:
    return _audio("wavlm")


# ---------------------------------------------------------------- encoders
def bert_frozen_leading_layers() -> Loop:
    """Embeddings and the first two layers frozen (defect 1's class on a real model)."""
    import transformers

    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=SEQ + 4, num_labels=3)
    model = transformers.BertForSequenceClassification(config)
    model.bert.embeddings.requires_grad_(False)
    for layer in model.bert.encoder.layer[:2]:
        layer.requires_grad_(False)
    return Loop(model.train(), {"input_ids": _ids(), "labels": _labels(3)})


def distilbert() -> Loop:
    import transformers

    config = transformers.DistilBertConfig(vocab_size=VOCAB, dim=64, n_layers=3, n_heads=4, hidden_dim=128,
                                           max_position_embeddings=SEQ + 4)
    model = transformers.DistilBertForMaskedLM(config)
    ids = _ids()
    return Loop(model.train(), {"input_ids": ids, "labels": ids})


# ---------------------------------------------------------------- vision
def swin() -> Loop:
    import transformers

    config = transformers.SwinConfig(image_size=IMAGE, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4],
                                     window_size=4, drop_path_rate=0.1, num_labels=10)
    model = transformers.SwinForImageClassification(config)
    return Loop(model.train(), {"pixel_values": _pixels(), "labels": _labels(10)})


def dinov2() -> Loop:
    import transformers

    config = transformers.Dinov2Config(image_size=IMAGE, patch_size=8, hidden_size=64, num_hidden_layers=3,
                                       num_attention_heads=4, mlp_ratio=2, drop_path_rate=0.1, num_labels=10)
    model = transformers.Dinov2ForImageClassification(config)
    return Loop(model.train(), {"pixel_values": _pixels(), "labels": _labels(10)})


def deit() -> Loop:
    import transformers

    config = transformers.DeiTConfig(image_size=IMAGE, patch_size=8, hidden_size=64, num_hidden_layers=3,
                                     num_attention_heads=4, intermediate_size=128, num_labels=10)
    model = transformers.DeiTForImageClassification(config)
    return Loop(model.train(), {"pixel_values": _pixels(), "labels": _labels(10)})


def segformer() -> Loop:
    import transformers

    config = transformers.SegformerConfig(num_encoder_blocks=2, depths=[2, 2], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                                          num_attention_heads=[1, 2], decoder_hidden_size=32, num_labels=4,
                                          drop_path_rate=0.1)
    model = transformers.SegformerForSemanticSegmentation(config)
    labels = torch.randint(0, 4, (BATCH, IMAGE, IMAGE), generator=_gen(2))
    return Loop(model.train(), {"pixel_values": _pixels(), "labels": labels})


def convnext_drop_path() -> Loop:
    import transformers

    config = transformers.ConvNextConfig(num_channels=3, patch_size=4, hidden_sizes=[16, 32], depths=[2, 2],
                                         num_stages=2, num_labels=10, drop_path_rate=0.2, image_size=2 * IMAGE)
    model = transformers.ConvNextForImageClassification(config)
    return Loop(model.train(), {"pixel_values": _pixels(size=2 * IMAGE), "labels": _labels(10)})


def resnet_accumulating() -> Loop:
    """BatchNorm statistics move on every micro-batch; 3 micro-batches per optimizer step."""
    import transformers

    config = transformers.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[2, 2],
                                       layer_type="basic", num_labels=10)
    model = transformers.ResNetForImageClassification(config)
    return Loop(model.train(), {"pixel_values": _pixels(size=2 * IMAGE), "labels": _labels(10)}, micro_batches=3)


# ---------------------------------------------------------------- diffusers and PEFT
def unet_conditional() -> Loop:
    import diffusers

    model = diffusers.UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(16, 32),
                                           layers_per_block=1, cross_attention_dim=16, attention_head_dim=4,
                                           norm_num_groups=8,
                                           down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                           up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    inputs = {"sample": torch.randn(2, 4, 8, 8, generator=_gen(0)), "timestep": torch.tensor([10, 500]),
              "encoder_hidden_states": torch.randn(2, 6, 16, generator=_gen(1))}
    return Loop(model.train(), inputs, loss_fn=lambda out: out.sample.pow(2).mean())


def vae() -> Loop:
    import diffusers

    model = diffusers.AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(16, 32), layers_per_block=1,
                                    latent_channels=4, norm_num_groups=8,
                                    down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
                                    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"))
    return Loop(model.train(), (_pixels(size=16),), loss_fn=lambda out: out.sample.pow(2).mean())


def lora_gpt2() -> Loop:
    import peft
    import transformers

    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=2 * SEQ)
    model = peft.get_peft_model(transformers.GPT2LMHeadModel(config),
                                peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["c_attn"],
                                                fan_in_fan_out=True))
    return _lm(model)


# ---------------------------------------------------------------- plain torch: odd loops
class _Residual(nn.Module):
    def __init__(self, width: int, wrap: Callable[[nn.Module], nn.Module] = lambda m: m, draw: str = "") -> None:
        super().__init__()
        self.linear, self.norm, self.draw = wrap(nn.Linear(width, width)), nn.LayerNorm(width), draw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.linear(self.norm(x))
        if self.draw == "numpy":
            hidden = hidden * torch.from_numpy(np.random.rand(*hidden.shape[-1:]).astype(np.float32))
        elif self.draw == "random":
            hidden = hidden * random.uniform(0.5, 1.5)
        return x + torch.nn.functional.gelu(hidden)


class _Stack(nn.Module):
    def __init__(self, depth: int, width: int, make: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(make(i) for i in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _features(width: int, rows: int = 256, seed: int = 0) -> tuple[torch.Tensor]:
    return (torch.randn(rows, width, generator=_gen(seed)),)


def _squared(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def spectral_norm_stack() -> Loop:
    """Power iterations in forward (defect 3): those blocks are never recomputed."""
    model = _Stack(5, 64, lambda i: _Residual(64, torch.nn.utils.parametrizations.spectral_norm if i % 2 else
                                              (lambda m: m)))
    return Loop(model.train(), _features(64), loss_fn=_squared,
                expect_notes={"not recomputed": "block 1 (blocks.1): its forward writes"})


def numpy_draws_in_blocks() -> Loop:
    model = _Stack(4, 64, lambda i: _Residual(64, draw="numpy" if i == 2 else "random" if i == 1 else ""))
    return Loop(model.train(), _features(64), loss_fn=_squared,
                expect_notes={"not recomputed": "block 2 (blocks.2): its forward draws from NumPy"})


def accumulating_step_fn() -> Loop:
    """A loop of its own (step_fn) with 4 micro-batches per optimizer step."""
    def step(model: nn.Module, inputs: tuple) -> torch.Tensor:
        loss = model(*inputs).pow(2).mean() / 4
        loss.backward()
        return loss

    model = _Stack(4, 64, lambda i: _Residual(64))
    return Loop(model.train(), _features(64), step_fn=step, micro_batches=4)


def no_grad_prefix() -> Loop:
    """The first two blocks run under torch.no_grad() (a frozen feature extractor in the loop's own code)."""
    class Prefixed(_Stack):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                x = self.blocks[1](self.blocks[0](x))
            for block in self.blocks[2:]:
                x = block(x)
            return self.head(x)

    model = Prefixed(6, 64, lambda i: _Residual(64))
    return Loop(model.train(), _features(64, rows=512), loss_fn=_squared, blocks=lambda m: list(m.blocks))


class _GAN(nn.Module):
    """A generator and a discriminator; the step calls D twice (real, then generated)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.G = _Stack(3, width, lambda i: _Residual(width))
        self.D = _Stack(3, width, lambda i: _Residual(width, torch.nn.utils.parametrizations.spectral_norm))
        self.width = width

    def forward(self, real: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        fake = self._generate(noise)
        return torch.nn.functional.softplus(-self.D(real)).mean() + torch.nn.functional.softplus(self.D(fake)).mean()

    def _generate(self, noise: torch.Tensor) -> torch.Tensor:
        x = noise
        for block in self.G.blocks:
            x = block(x)
        return x


def autocast_gpt2() -> Loop:
    """A loop of its own under bfloat16 autocast."""
    import transformers

    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=2 * SEQ)
    model = transformers.GPT2LMHeadModel(config)

    def step(model: nn.Module, inputs: dict) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**inputs).loss
        loss.backward()
        return loss

    ids = _ids()
    return Loop(model.train(), {"input_ids": ids, "labels": ids}, step_fn=step)


def gan_d_twice() -> Loop:
    """D runs twice per step: refused, and the error names blocks that run once (the generator's)."""
    model = _GAN()
    inputs = (torch.randn(128, 32, generator=_gen(0)), torch.randn(128, 32, generator=_gen(1)))
    return Loop(model.train(), inputs, loss_fn=lambda loss: loss, refused=r"D.blocks.0, _Residual\) ran 2 times",
                fix={"blocks": "as the error names them"})


BUILDERS: dict[str, Callable[[], Loop]] = {
    "llama_accumulating": llama_accumulating, "mixtral": mixtral, "qwen2_moe": qwen2_moe, "mamba": mamba,
    "opt_layerdrop": opt_layerdrop, "gpt_neox": gpt_neox, "phi3": phi3, "gemma": gemma, "t5": t5,
    "bart_layerdrop": bart_layerdrop, "whisper": whisper, "wav2vec2": wav2vec2, "hubert": hubert, "wavlm": wavlm,
    "bert_frozen_leading_layers": bert_frozen_leading_layers, "distilbert": distilbert, "swin": swin,
    "dinov2": dinov2, "deit": deit, "segformer": segformer, "convnext_drop_path": convnext_drop_path,
    "resnet_accumulating": resnet_accumulating, "autocast_gpt2": autocast_gpt2,
    "unet_conditional": unet_conditional, "vae": vae,
    "lora_gpt2": lora_gpt2, "spectral_norm_stack": spectral_norm_stack, "numpy_draws_in_blocks": numpy_draws_in_blocks,
    "accumulating_step_fn": accumulating_step_fn, "no_grad_prefix": no_grad_prefix, "gan_d_twice": gan_d_twice,
}
NEEDS = {"unet_conditional": "diffusers", "vae": "diffusers", "lora_gpt2": "peft", "spectral_norm_stack": None,
         "numpy_draws_in_blocks": None, "accumulating_step_fn": None, "no_grad_prefix": None,
         "gan_d_twice": None}  # else transformers
