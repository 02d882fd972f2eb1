"""The Checkpointer and what is built on it: its options (config.py), retention, branches, its unsharded
save (unsharded.py; a sharded one goes through ``state.sharded``), and interchange with other formats.

The top layer: may import every other subpackage of ``state``; none imports it.
"""
