"""What a step is on disk: entry names, file hashing, the manifest, the pickle-free codec, and a step's state
as files (encoded and decoded).

Owns layout.py, hashing.py, manifest.py, codec.py, snapshot.py. May import: ``state.errors``,
``state.process``, ``state.live`` (snapshot.py encodes from live/staging.py's host copies).
"""
