"""``python -m torchckpt`` (and ``torchrun ... -m torchckpt train``): the ``torchckpt`` command."""

import sys

from torchckpt.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
