"""A torchdata StatefulDataLoader built with its own generator resumes bitwise, next epochs included (issue 29,
item 10): live/capture.py's [a loader's own generator is captured]."""

from __future__ import annotations

import pytest
import torch

from torchckpt.state import Checkpointer
from torchckpt.state.live.capture import LOADER_GENERATOR_KEY

stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")


def _loader() -> object:
    generator = torch.Generator().manual_seed(1234)
    dataset = torch.utils.data.TensorDataset(torch.arange(24))
    return stateful_dataloader.StatefulDataLoader(dataset, batch_size=4, shuffle=True, generator=generator)


def _epochs(loader, count: int) -> list[list[int]]:
    return [[int(x) for (batch,) in loader for x in batch] for _ in range(count)]


@pytest.mark.parametrize("drop_generator", [False, True], ids=["captured", "control-without-it"])
def test_a_resumed_loader_with_a_generator_gives_the_same_next_epochs(run_dir, monkeypatch, drop_generator):
    reference = _epochs(_loader(), 3)
    loader = _loader()
    first = _epochs(loader, 1)[0]  # epoch 0 done
    iterator = iter(loader)
    first += [int(x) for x in next(iterator)[0]]  # and one batch of epoch 1
    with Checkpointer(run_dir) as ckpt:
        ckpt.save(1, loader=loader)
    resumed = _loader()
    if drop_generator:  # what restore did before: the generator's state is not applied
        import torchckpt.state.live.capture as capture

        monkeypatch.setattr(capture, "LOADER_GENERATOR_KEY", "not-a-key")
    with Checkpointer(run_dir) as ckpt:
        assert ckpt.restore(loader=resumed, rng=False) == 1
    rest = [int(x) for (batch,) in resumed for x in batch]  # the rest of epoch 1
    after = _epochs(resumed, 1)[0]  # epoch 2
    assert first[:24] == reference[0] and first[24:] + rest == reference[1]  # mid-epoch position: torchdata's own
    assert (after == reference[2]) is not drop_generator


def test_the_generator_state_is_saved_only_for_loaders_that_have_one(run_dir):
    from torchckpt.state.live.capture import capture_item

    assert LOADER_GENERATOR_KEY in capture_item("loader", _loader())[1]
    plain = stateful_dataloader.StatefulDataLoader(torch.utils.data.TensorDataset(torch.arange(4)), batch_size=2)
    assert LOADER_GENERATOR_KEY not in capture_item("loader", plain)[1]
