"""The live side of a checkpoint: training objects and RNG streams captured into states and applied back, and
their tensors copied to host memory for a save.

Owns capture.py (items, RNG streams, checks before anything changes) and staging.py (host copies). May
import: ``state.errors`` and ``state.process`` (it needs nothing from them but errors today).
"""
