"""The version, in one place: pyproject.toml reads it from here (``[tool.setuptools.dynamic]``)."""

__version__ = "0.1.0"
