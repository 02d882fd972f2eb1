"""The chunked loss head (executor/loss_head.py): exact loss, bitwise input gradients, the head weight's gradient
to rounding, deferred logits made real (and recorded) wherever a loop reads them, and the memory it saves."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchckpt.executor.loss_head import ChunkedCrossEntropy, DeferredLogits, chunk_loss_head, default_chunk_tokens
from torchckpt.memory import MemoryMeter

EPS32 = torch.finfo(torch.float32).eps


def _grads(head: nn.Linear, hidden: torch.Tensor, loss_of) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                     torch.Tensor | None]:
    head.zero_grad(set_to_none=True)
    x = hidden.clone().requires_grad_()
    loss = loss_of(head(x))
    loss.backward()
    bias = head.bias.grad.clone() if head.bias is not None else None
    return loss.detach(), x.grad, head.weight.grad.clone(), bias


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("tokens,width,vocab,chunk,bias,reduction", [
    (512, 64, 1000, 37, False, "mean"),
    (300, 96, 32000, 7, True, "mean"),
    (257, 32, 5000, 64, False, "sum"),
    (64, 16, 300, 64, True, "mean"),  # one chunk: the weight gradient is one product too
    (2048, 256, 8000, None, False, "mean"),  # the default chunk (256 rows): a head 256 wide needs >= 192 rows
])
def test_the_chunked_loss_is_the_plain_one_and_its_input_gradient_bitwise(tokens, width, vocab, chunk, bias,
                                                                          reduction):
    torch.manual_seed(0)
    head = nn.Linear(width, vocab, bias=bias)
    hidden = torch.randn(tokens, width)
    target = torch.randint(0, vocab, (tokens,))
    target[::7] = -100

    def loss_of(logits):
        return F.cross_entropy(logits.float(), target, reduction=reduction)

    plain = _grads(head, hidden, loss_of)
    handle = chunk_loss_head(head, chunk)
    chunked = _grads(head, hidden, loss_of)
    handle.remove()
    assert handle.chunked_losses == 1 and handle.materialized == []
    assert torch.equal(chunked[0], plain[0]), "the loss is reduced by the plain loss's own kernel"
    assert torch.equal(chunked[1], plain[1]), "each row of the input gradient is its own product"
    assert _relative(chunked[2], plain[2]) <= 32 * EPS32
    if chunk is not None and chunk >= tokens:
        assert torch.equal(chunked[2], plain[2])
    if bias:
        assert _relative(chunked[3], plain[3]) <= 32 * EPS32


def test_a_scaled_loss_and_a_shifted_view_keep_the_input_gradient_bitwise():
    """Hugging Face's older shift (``logits[..., :-1, :].contiguous()``), a 3-d view and a loss scaled before
    backward (gradient accumulation): the incoming gradient goes through ATen's own backward kernels."""
    torch.manual_seed(1)
    head = nn.Linear(32, 700, bias=False)
    hidden = torch.randn(3, 20, 32)
    labels = torch.randint(0, 700, (3, 20))

    def loss_of(logits):
        shifted = logits[..., :-1, :].contiguous()
        return F.cross_entropy(shifted.view(-1, shifted.size(-1)), labels[..., 1:].reshape(-1)) / 3

    plain = _grads(head, hidden, loss_of)
    handle = chunk_loss_head(head, 5)
    chunked = _grads(head, hidden, loss_of)
    handle.remove()
    assert handle.chunked_losses == 1 and not handle.materialized
    assert torch.equal(chunked[0], plain[0]) and torch.equal(chunked[1], plain[1])
    assert _relative(chunked[2], plain[2]) <= 32 * EPS32


def test_logits_read_whole_are_real_and_recorded():
    torch.manual_seed(2)
    head = nn.Linear(16, 50)
    hidden = torch.randn(4, 6, 16)
    target = torch.randint(0, 50, (4, 6))
    plain_logits = head(hidden)
    handle = chunk_loss_head(head)
    logits = head(hidden)
    assert isinstance(logits, DeferredLogits) and logits.shape == (4, 6, 50) and logits.dtype == torch.float32
    assert "computed in chunks" in repr(logits)
    accuracy = (logits.argmax(-1) == target).float().mean()
    assert accuracy == (plain_logits.argmax(-1) == target).float().mean()
    smoothed = F.cross_entropy(logits.view(-1, 50), target.view(-1), label_smoothing=0.1)  # not chunked: real
    assert torch.equal(smoothed, F.cross_entropy(plain_logits.view(-1, 50), target.view(-1), label_smoothing=0.1))
    handle.remove()
    assert handle.materialized == ["argmax", "cross_entropy"] and handle.chunked_losses == 0
    assert "forward" not in vars(head)


def test_an_applied_head_warns_once_when_the_loop_reads_the_logits():
    from torchckpt.executor.loss_head import ChunkedHeadHandle
    head = nn.Linear(8, 40)
    handle = ChunkedHeadHandle(head=head, chunk_tokens=4, warn=True)
    with pytest.warns(RuntimeWarning, match=r"made them whole \(softmax\).*step_fn"):
        handle.forward(torch.randn(2, 3, 8)).softmax(-1)
    handle.forward(torch.randn(2, 3, 8)).softmax(-1)  # once only
    assert handle.materialized == ["softmax", "softmax"]


def test_bad_heads_and_chunks_are_refused_and_remove_is_exact():
    with pytest.raises(TypeError, match="must be an nn.Linear"):
        chunk_loss_head(nn.Conv1d(2, 2, 1))
    with pytest.raises(ValueError, match="chunk_tokens must be an int >= 1"):
        chunk_loss_head(nn.Linear(2, 4), chunk_tokens=0)
    head = nn.Linear(2, 4)
    handle = chunk_loss_head(head)
    with pytest.raises(ValueError, match="already has an instance-level forward"):
        chunk_loss_head(head)
    handle.remove()
    handle.remove()
    assert "forward" not in vars(head) and isinstance(head(torch.randn(3, 2)), torch.Tensor)
    with pytest.raises(ValueError, match="tokens must be an int >= 1"):
        default_chunk_tokens(0, 4, 4)


def test_the_logits_never_exist_whole():
    """Measured with the meter: the plain step holds the logits' log-softmax (tokens x vocab floats) at the end of
    the forward pass and two more in the backward pass; the chunked one, chunks only."""
    torch.manual_seed(3)
    tokens, width, vocab = 1024, 32, 8000
    head = nn.Linear(width, vocab, bias=False)
    hidden = torch.randn(tokens, width, requires_grad=True)
    target = torch.randint(0, vocab, (tokens,))
    full = tokens * vocab * 4

    def peak() -> int:
        head.zero_grad(set_to_none=True)
        hidden.grad = None
        with MemoryMeter() as meter:
            F.cross_entropy(head(hidden), target).backward()
        return meter.peak_bytes

    plain = peak()
    handle = chunk_loss_head(head)
    chunked = peak()
    handle.remove()
    chunk = default_chunk_tokens(tokens, width, vocab)
    assert plain >= 2 * full
    assert chunked <= plain - full
    weight_and_grad = 2 * head.weight.numel() * 4
    assert chunked <= weight_and_grad + 3 * hidden.numel() * 4 + 5 * chunk * vocab * 4


def test_hf_models_with_labels_keep_every_gradient_but_the_heads_bitwise():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(4)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=3000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=3000, n_embd=64, n_layer=2, n_head=4,
                                                                n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                                                attn_pdrop=0.0))
    ids = torch.randint(0, 3000, (2, 40))
    for model, tied in ((llama, "lm_head.weight"), (gpt2, "transformer.wte.weight")):
        def step(model: torch.nn.Module = model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

        plain_loss, plain = step()
        handle = chunk_loss_head(model.get_output_embeddings(), 17)
        loss, grads = step()
        handle.remove()
        assert handle.chunked_losses == 1 and not handle.materialized
        assert torch.equal(loss, plain_loss)
        differ = [name for name in plain if not torch.equal(plain[name], grads[name])]
        assert differ == [tied]
        assert _relative(grads[tied], plain[tied]) <= 32 * EPS32


def test_the_autograd_function_alone():
    torch.manual_seed(5)
    hidden = torch.randn(40, 16, requires_grad=True)
    head = nn.Linear(16, 90)
    target = torch.randint(0, 90, (40,))
    loss = ChunkedCrossEntropy.apply(hidden, head.weight, head.bias, target, None, -100, "mean", 16)
    assert torch.equal(loss, F.cross_entropy(head(hidden), target))
    with torch.no_grad():  # no graph, no error
        ChunkedCrossEntropy.apply(hidden, head.weight, head.bias, target, None, -100, "sum", 16)
