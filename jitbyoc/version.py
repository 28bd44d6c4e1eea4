"""jitbyoc's version (a leaf: the compile cache keys code by it)."""

__version__ = "0.1.0"
