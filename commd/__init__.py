"""commd: a per-node daemon that owns collective communication for GPU workers."""

from proto import PROTOCOL_VERSION
from proto.peer import PEER_VERSION

__version__ = "0.1.0"


def build_line() -> str:
    """This build and the two protocols it speaks (README "Upgrading")."""
    return f"commd {__version__} (worker protocol {PROTOCOL_VERSION}, peer protocol {PEER_VERSION})"
