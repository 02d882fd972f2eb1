"""Where checkpoint bytes live: the Storage protocol, the local and fsspec back ends, opening the files of a
local step without trusting them, and writing a file while it is hashed.

Owns base.py, local.py, remote.py, backends.py, local_files.py, hashed_write.py. May import:
``state.errors``, ``state.process``, ``state.live``, ``state.format``.
"""
