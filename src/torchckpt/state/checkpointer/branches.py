"""Step numbers that go backwards: a rewind starts a new branch, and the newer steps are set aside.

Rules kept here (named in ``docs/design.md``; the design notes they keep in parentheses):

1. **[a rewind abandons the newer steps]** (Note: [a run's own steps survive]) Saving step N while
   committed steps greater than N exist (``restore(step=...)`` of an older step, or a run that
   restarts its step counter in an existing directory) makes those steps an abandoned branch. They
   are moved to ``abandoned/`` (never deleted), just before step N is committed, so that restore,
   ``latest_step`` and retention only ever see the current branch: retention then keeps the new
   saves, and ``restore()`` without a step resumes them, never the abandoned step 200.
2. **[set aside before the commit]** The move happens after step N's files are written and before
   its commit: a failed write abandons nothing, and a crash between the move and the commit leaves
   the directory as the rewind saw it (the restored older step is the newest), never the abandoned
   branch as the newest.
"""

from __future__ import annotations

from torchckpt.state.storage.base import Storage


def abandon_newer_steps(storage: Storage, step: int) -> list[str]:
    """Move every committed step greater than ``step`` to ``abandoned/``; returns where they went.

    Example:
        >>> import tempfile
        >>> from torchckpt.state.storage.backends import open_storage
        >>> tmp = tempfile.TemporaryDirectory()
        >>> abandon_newer_steps(open_storage(tmp.name), 5)  # nothing newer than 5
        []
        >>> tmp.cleanup()
    """
    return [storage.abandon_step(newer) for newer in sorted(storage.step_entries()) if newer > step]
