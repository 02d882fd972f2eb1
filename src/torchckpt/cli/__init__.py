"""The ``torchckpt`` command line."""
