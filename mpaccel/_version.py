"""mpaccel's version: a module of its own, importable without the rest of the package."""

__version__ = "0.1.0"
