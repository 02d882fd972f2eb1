"""Built-in models: shapes, losses, configs validated with clear errors."""

from __future__ import annotations

import pytest
import torch

from torchckpt.models import GPTConfig, block_modules, gpt, mlp, unet


def test_gpt_small_is_the_documented_shape() -> None:
    model = gpt("small")
    assert (model.config.n_layer, model.config.d_model, model.config.n_head) == (12, 384, 6)
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(block_modules(model)) == 12
    assert model.head.weight is model.wte.weight


@pytest.mark.parametrize("build,options", [(lambda: gpt("tiny"), {"seq_len": 16}),
                                           (lambda: unet("tiny"), {"image_size": 16}),
                                           (lambda: mlp(3, 16), {})])
def test_loss_is_a_finite_scalar_and_logits_have_the_batch_shape(build, options) -> None:  # noqa: ANN001
    model = build()
    batch = model.example_batch(batch_size=2, **options)
    loss = model(*batch)
    assert loss.shape == () and torch.isfinite(loss)
    assert model(batch[0]).shape[0] == 2


def test_unet_skips_make_it_a_non_chain() -> None:
    model = unet("small")
    assert len(model.down) == len(model.up) == 6
    assert model.up[0].norm_1.num_channels == 2 * model.down[-1].conv_2.out_channels


def test_bad_configs_are_explained() -> None:
    with pytest.raises(ValueError, match=r"gpt\(size='huge'\): unknown size; choose one of tiny, mini, small, medium"):
        gpt("huge")
    with pytest.raises(ValueError, match=r"d_model \(100\) must be divisible by n_head \(6\)"):
        GPTConfig(d_model=100)
    with pytest.raises(TypeError, match="valid overrides are the fields of GPTConfig"):
        gpt("tiny", layers=3)
    with pytest.raises(ValueError, match="sequence length 300 exceeds max_seq_len=256"):
        gpt("tiny")(torch.zeros(1, 300, dtype=torch.long))
    with pytest.raises(ValueError, match="must be divisible by 2"):
        unet("tiny")(torch.zeros(1, 3, 15, 15))
    with pytest.raises(ValueError, match=r"MLP\.depth must be >= 1; got MLP\.depth=0"):
        mlp(0, 8)
