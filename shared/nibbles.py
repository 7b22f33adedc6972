"""Signed 4-bit values packed two to a byte, for the ``int4+zstd`` codec.

Element ``2k`` goes in the low nibble of byte ``k`` and element ``2k+1`` in its
high nibble (two's complement, -8..7); an odd count leaves the last high nibble
0. Packing works on pairs read as little-endian uint16 (one vectorised pass over
half the elements); unpacking is one lookup in a 256-entry table of byte -> two
int8 values.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

I8 = npt.NDArray[np.int8]

INT4_MIN, INT4_MAX = -8, 7


def _table() -> npt.NDArray[np.uint16]:
    b = np.arange(256, dtype=np.uint16)
    lo, hi = b & 0x0F, b >> 4
    lo = np.where(lo > 7, lo + 0xF0, lo)  # sign-extend each nibble to a byte
    hi = np.where(hi > 7, hi + 0xF0, hi)
    return (lo | (hi << 8)).astype("<u2")


_UNPACK = _table()


def packed_size(count: int) -> int:
    """Bytes that ``count`` 4-bit values take."""
    return (count + 1) // 2


def pack(values: I8) -> bytes:
    """``values`` (int8, already within -8..7) as packed nibbles, C order."""
    flat = np.ascontiguousarray(values, dtype=np.int8).reshape(-1)
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.int8)])
    pairs = flat.view("<u2")
    out = (pairs & 0x000F) | ((pairs >> 4) & 0x00F0)
    return out.astype(np.uint8).tobytes()


def unpack(data: bytes | bytearray | memoryview, count: int) -> I8:
    """``count`` int8 values from packed nibbles (``len(data) == packed_size(count)``)."""
    packed = np.frombuffer(data, dtype=np.uint8)
    values: I8 = _UNPACK.take(packed).view(np.int8)[:count]  # take: faster than [packed]
    return values
