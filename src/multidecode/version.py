"""The package version, in one place: `pyproject.toml` reads it, and so does everything that records it."""

__version__ = "0.1.0"
