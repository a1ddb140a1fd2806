"""The TCP framing of the messages between daemons (`peer`), and its sealing (sans-IO).

A frame is `>II` (header length, payload length), a msgpack header (a peer message,
encoded by the same codec as the Unix protocol) and raw payload bytes (the data of a
collective; empty for control messages). Both lengths are checked against limits
before anything is buffered, so a bad peer cannot make a daemon allocate more than one
frame's limit. Every frame after the handshake is sealed (`FrameSeal`): its header and
its payload are each encrypted with AES-256-GCM under a key of its direction derived
from the secret and the handshake's transcript (`frame_keys`), with the frame's
sequence number in the nonce and its lengths as authenticated data.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from .errors import DecodeError, MessageTooLarge
from .fields import MAX_MESSAGE_BYTES

TAG_BYTES = 16  # AES-GCM's, after a sealed header and after a sealed payload
MAX_PAYLOAD_BYTES = 16 << 20
# A sealed frame's header (from a daemon that proved the secret): a world_ready names every
# rank's daemon, ~1 MiB / (name length + 1) ranks. In the clear (a handshake's, from anyone),
# MAX_MESSAGE_BYTES.
MAX_SEALED_HEADER_BYTES = 1 << 20
FRAME = struct.Struct(">II")

Bytes = bytes | bytearray | memoryview


def frame(header: bytes, payload: Bytes = b"") -> list[Bytes]:
    """The pieces to write for one frame in the clear (the payload is not copied)."""
    return [frame_prefix(header, payload), header, payload]


def frame_prefix(header: Bytes, payload: Bytes, header_limit: int = MAX_MESSAGE_BYTES) -> bytes:
    """A frame's lengths, within the limits its reader holds it to (`header_limit`: a
    sealed frame's is MAX_SEALED_HEADER_BYTES)."""
    if len(header) > header_limit:
        raise MessageTooLarge(f"peer header of {len(header)} bytes is over the limit")
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise MessageTooLarge(f"peer payload of {len(payload)} bytes is over the limit")
    return FRAME.pack(len(header), len(payload))


def frame_lengths(prefix: bytes, sealed: bool = False) -> tuple[int, int]:
    """Header and payload lengths from a frame's first 8 bytes (of a sealed frame: its
    header's and payload's in the clear); refuses out-of-bounds ones before the reader
    allocates anything."""
    if len(prefix) != FRAME.size:
        raise DecodeError(f"a frame starts with {FRAME.size} bytes, not {len(prefix)}")
    header_len, payload_len = FRAME.unpack(prefix)
    header_limit = MAX_SEALED_HEADER_BYTES if sealed else MAX_MESSAGE_BYTES
    if not 0 < header_len <= header_limit or payload_len > MAX_PAYLOAD_BYTES:
        raise DecodeError(f"peer frame of {header_len}+{payload_len} bytes is out of bounds")
    return header_len, payload_len


def frame_keys(secret: bytes, transcript: bytes) -> tuple[bytes, bytes]:
    """The keys that seal a link's frames after its handshake: the dialer's, the listener's."""
    return (hmac.new(secret, b"dialer frames|" + transcript, hashlib.sha256).digest(),
            hmac.new(secret, b"listener frames|" + transcript, hashlib.sha256).digest())


def sealed_lengths(header_len: int, payload_len: int) -> tuple[int, int]:
    """The bytes a sealed frame's header and payload take on the wire (an empty payload
    takes none)."""
    return header_len + TAG_BYTES, payload_len + TAG_BYTES if payload_len else 0


class FrameSeal:
    """One direction of a link, frame after frame. The n-th frame's nonce holds n (and
    which part it seals), so a frame dropped, replayed or moved fails to open as surely
    as one changed; its lengths, sent in the clear so the reader can size its buffers,
    are authenticated with each part. AES-GCM, not an HMAC: OpenSSL's runs at 15-30 GB/s
    here, HMAC-SHA256 at 2 GB/s (the host engine's data crosses these links)."""

    def __init__(self, key: bytes) -> None:
        from cryptography.exceptions import InvalidTag  # only where links are
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._aead = AESGCM(key)
        self._invalid = InvalidTag
        self._seq = 0

    def _nonce(self, part: int) -> bytes:
        return part.to_bytes(4, "big") + self._seq.to_bytes(8, "big")

    def seal(self, header: bytes, payload: Bytes) -> list[bytes]:
        """The next frame's bytes: lengths, sealed header, sealed payload (if any)."""
        lengths = frame_prefix(header, payload, MAX_SEALED_HEADER_BYTES)
        pieces = [lengths, self._aead.encrypt(self._nonce(0), header, lengths)]
        if len(payload):
            pieces.append(self._aead.encrypt(self._nonce(1), payload, lengths))
        self._seq += 1
        return pieces

    def open_header(self, lengths: bytes, header: Bytes) -> bytes:
        """The next frame's header, as soon as it is in: its tag covers `lengths` too, so
        the payload's length is vouched for before the reader allocates anything for it."""
        return self._open(0, lengths, header, last=FRAME.unpack(lengths)[1] == 0)

    def open_payload(self, lengths: bytes, payload: Bytes) -> bytes:
        """The payload of the frame whose header was opened last."""
        return self._open(1, lengths, payload, last=True)

    def _open(self, part: int, lengths: bytes, sealed: Bytes, last: bool) -> bytes:
        try:
            return self._aead.decrypt(self._nonce(part), sealed, lengths)
        except self._invalid:
            raise DecodeError("a frame failed its check (forged, changed, replayed or out of "
                              "order)") from None
        finally:
            if last:
                self._seq += 1
