"""Integrations with other libraries. ``torchckpt.integrations.hf``: Hugging Face transformers models."""
