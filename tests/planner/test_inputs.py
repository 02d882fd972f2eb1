"""How the example batch reaches the model (``call_model``) and how the loss is found (``default_loss``).

A dict batch goes in as keyword arguments when ``forward`` takes its keys, else as the one argument of
a ``forward(self, batch)``; a dict that fits neither is refused saying what to pass. The loss is the
output when scalar, ``.loss``, ``["loss"]``, or a tuple's scalar; a non-scalar output (a classifier's
logits) is refused naming ``loss_fn=``, never silently summed.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutput, SequenceClassifierOutput

import torchckpt
from torchckpt.planner import StepRunner, call_model, default_loss

WIDTH = 16


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class DictModel(nn.Module):
    """``forward(self, batch)`` reads ``batch["x"]`` and ``batch["y"]``, as many user models do."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, batch: dict) -> torch.Tensor:
        h = batch["x"]
        for block in self.blocks:
            h = block(h)
        return (h - batch["y"]).square().mean()


class KeywordModel(DictModel):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward({"x": x, "y": y})


def _batch() -> dict:
    generator = torch.Generator().manual_seed(0)
    return {"x": torch.randn(8, WIDTH, generator=generator), "y": torch.randn(8, WIDTH, generator=generator)}


def test_a_model_taking_one_dict_is_planned_and_verified() -> None:
    torch.manual_seed(0)
    model, batch = DictModel(), _batch()
    assert call_model(model, batch).dim() == 0  # model(batch), not model(**batch)
    plan = torchckpt.plan(model, batch, budget="100%")
    report = torchckpt.verify_plan(model, plan, batch)
    assert report.within_budget and report.gradients_equal
    assert len(plan.block_paths) == 3


def test_a_dict_of_keywords_still_goes_in_as_keywords() -> None:
    torch.manual_seed(0)
    model, batch = KeywordModel(), _batch()
    runner = StepRunner(model, batch)
    loss = runner.forward_backward()
    assert loss is not None and loss.dim() == 0
    reference = DictModel()
    reference.load_state_dict(model.state_dict())
    runner.clear_grads()
    assert torch.equal(call_model(model, batch), call_model(reference, batch))


def test_a_dict_the_forward_cannot_take_is_refused_saying_what_to_pass() -> None:
    with pytest.raises(TypeError, match=r"KeywordModel.forward\(x, y\) takes neither the batch's keys \(input, y\) "
                                        r".*\(batch,\) to pass the dict"):
        call_model(KeywordModel(), {"input": torch.ones(2, WIDTH), "y": torch.ones(2, WIDTH)})
    # (batch,) passes the dict positionally whatever its keys.
    assert call_model(DictModel(), ({"x": torch.ones(2, WIDTH), "y": torch.ones(2, WIDTH)},)).dim() == 0


def test_default_loss_reads_attributes_then_keys_then_a_tuples_scalar() -> None:
    loss, logits = torch.tensor(0.5), torch.ones(2, 3)
    assert default_loss(loss) is loss
    assert default_loss(CausalLMOutput(loss=loss, logits=logits)) is loss  # a ModelOutput (a dict subclass)
    assert default_loss({"logits": logits, "loss": loss}) is loss
    assert default_loss((loss, logits)) is loss  # HF return_dict=False
    assert default_loss((logits, loss)) is loss  # nanoGPT


@pytest.mark.parametrize(("output", "message"), [
    (torch.ones(4, 10), r"the model returned a tensor of shape \(4, 10\), not a scalar loss.*loss_fn=lambda output"),
    (SequenceClassifierOutput(logits=torch.ones(4, 10)), r"SequenceClassifierOutput without a tensor 'loss' "
                                                         r"\(keys: logits\); pass the labels.*loss_fn="),
    ({"logits": torch.ones(4, 10)}, r"dict without a tensor 'loss' \(keys: logits\).*loss_fn="),
    ((torch.ones(4, 10), torch.ones(4)), r"cannot find a loss in a model output of type tuple.*loss_fn="),
    (None, r"cannot find a loss in a model output of type NoneType.*step_fn="),
])
def test_an_output_without_a_loss_is_refused_never_summed(output: object, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        default_loss(output)


def test_a_classifier_without_loss_fn_is_refused_at_its_first_step_and_works_with_it() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(_Block() for _ in range(3)), nn.Linear(WIDTH, 4))
    x, labels = torch.randn(8, WIDTH), torch.randint(0, 4, (8,))
    with pytest.raises(TypeError, match=r"tensor of shape \(8, 4\), not a scalar loss"):
        torchckpt.plan(model, (x,), budget="100%", blocks=list(model)[:3])
    plan = torchckpt.plan(model, (x,), budget="100%", blocks=list(model)[:3],
                          loss_fn=lambda logits: nn.functional.cross_entropy(logits, labels))
    assert plan.predicted_extra_time_s == 0.0
    with pytest.raises(TypeError, match=r"the loss must be a scalar tensor; got a tensor of shape \(8,\) "
                                        r"\(loss_fn's result\)"):
        StepRunner(model, (x,), loss_fn=lambda logits: logits.sum(dim=1)).forward_backward()
