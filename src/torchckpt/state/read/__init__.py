"""Reading steps back: one step read and verified (step.py), the steps of a directory and whether they are
valid (catalog.py), the newest valid one a restore takes (newest.py), a decoded step loaded into live
objects and ``load`` (load.py). Each module imports only the ones listed before it.

May import: ``state.errors``, ``state.process``, ``state.live``, ``state.format``, ``state.storage``.
"""
