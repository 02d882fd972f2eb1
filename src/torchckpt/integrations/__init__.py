"""Integrations with other libraries, each imported by its own name (each needs its library installed):

- ``torchckpt.integrations.hf``: plan activation checkpointing for Hugging Face transformers models.
- ``torchckpt.integrations.hf_trainer``: crash-safe checkpoints and a bit-exact resume of a
  ``transformers.Trainer`` run (``TorchckptCallback``, ``train``).
- ``torchckpt.integrations.lightning``: ``TorchckptIO``, a Lightning ``CheckpointIO`` that writes
  torchckpt checkpoints.
"""
