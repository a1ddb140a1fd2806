"""commd: a per-node daemon that owns collective communication for GPU workers."""

__version__ = "0.1.0"
