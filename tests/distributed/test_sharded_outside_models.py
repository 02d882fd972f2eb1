"""Sharded checkpoints of models nobody here wrote, built from configs: LoRA on GPT-2 (PEFT: a frozen base,
tied embeddings) and BERT's masked LM (decoder tied to the embeddings), saved by 2 FSDP2 ranks and restored in
one process and on 2 DDP ranks, bitwise equal to the full state gathered at save time."""

from __future__ import annotations

from pathlib import Path

import pytest

from .sharded_workers import outside_worker


@pytest.mark.parametrize("kind", [pytest.param("peft-gpt2", marks=pytest.mark.slow),
                                  pytest.param("bert", marks=pytest.mark.slow)])  # 32 s; test_sharded_state.py is fast
def test_an_outside_model_saved_by_fsdp2_restores_bitwise(spawn_ranks, tmp_path: Path, kind: str) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    directory = str(tmp_path / "ckpt")
    spawn_ranks(outside_worker, 2, kind, "fsdp2", directory, "save")
    for world, mode in [(1, "single"), (2, "ddp")]:
        result = spawn_ranks(outside_worker, world, kind, mode, directory, "restore")[0]
        assert result["step"] == 2 and result["keys_equal"] and result["compared"] > 40, result
        assert result["unequal"] == [], result
