"""What ``torchckpt train`` says it resumed: what the restore left out (``ElasticResumeWarning``) is named as not
restored and not listed as restored; other warnings pass through. The job on 2 then 1 processes:
tests/train/test_train_distributed.py."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from torchckpt.state import ElasticResumeWarning
from torchckpt.train.resumed import restore_and_say


class _Elastic:
    directory = "runs/x/checkpoints"

    def restore(self, **items: Any) -> int:
        warnings.warn(ElasticResumeWarning("saved by 2 rank(s) and is restored on 1", not_restored=("loader",),
                                           rng_restored=False), stacklevel=2)
        warnings.warn("something else", UserWarning, stacklevel=2)
        return 4


def test_an_elastic_resume_says_what_it_did_not_restore() -> None:
    said: list[str] = []
    items = {"model": 1, "optimizer": 2, "scheduler": 3, "loader": 4, "progress": {}}
    with pytest.warns(UserWarning) as seen:
        assert restore_and_say(_Elastic(), items, said.append) == 4
    assert said == ["resumed from runs/x/checkpoints/step-000000004 (model, AdamW, LR schedule; not restored: "
                    "data position, RNG, as warned above)"]
    assert {type(w.message) for w in seen} == {ElasticResumeWarning, UserWarning}  # both still shown
