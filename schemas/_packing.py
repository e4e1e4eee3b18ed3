"""Packed little-endian arrays: the hot fields of a ScoredGroup travel as raw bytes, not Avro arrays.

Encoding 8 x 4096 token ids as Avro `array<int>` costs a Python object per element; as packed bytes
it is one memcpy. Decoded arrays are zero-copy, read-only numpy views over the record's bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

from schemas._errors import DecodeError, InvalidRecordError

INT32_LE = np.dtype("<i4")
FLOAT32_LE = np.dtype("<f4")
UINT8 = np.dtype("u1")  # loss masks: one 0/1 byte per token


def pack(values: Sequence[int] | Sequence[float] | np.ndarray, dtype: np.dtype, field: str) -> bytes:
    """Pack a 1-D sequence of numbers as little-endian bytes of `dtype`; raise InvalidRecordError naming `field`."""
    try:
        array = np.asarray(values)
        if array.ndim != 1:
            raise ValueError(f"expected a 1-D sequence, got shape {array.shape}")
        if dtype.kind == "i" and array.size:
            if array.dtype.kind not in "iu":
                raise ValueError(f"expected integers, got {array.dtype}")
            info = np.iinfo(dtype)
            if array.min() < info.min or array.max() > info.max:
                raise ValueError(f"values must fit {dtype.name} ({info.min}..{info.max}); "
                                 f"got {array.min()}..{array.max()}")
        return array.astype(dtype, copy=False).tobytes()
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidRecordError(f"field {field!r}: {exc}") from exc


def unpack(data: bytes, dtype: np.dtype, field: str) -> np.ndarray:
    """View packed bytes as a read-only numpy array of `dtype` (no copy)."""
    if len(data) % dtype.itemsize:
        raise DecodeError(
            f"field {field!r}: {len(data)} bytes is not a multiple of {dtype.itemsize} ({dtype})"
        )
    return np.frombuffer(data, dtype=dtype)


def int32_array(values: Sequence[int] | np.ndarray, field: str) -> np.ndarray:
    """`values` as a contiguous int32 array (itself when it already is one); InvalidRecordError names `field`."""
    if isinstance(values, np.ndarray) and values.dtype == INT32_LE and values.ndim == 1 and values.flags.c_contiguous:
        return values
    return unpack(pack(values, INT32_LE, field), INT32_LE, field)


def float32_array(values: Sequence[float] | np.ndarray | None, field: str) -> np.ndarray | None:
    """`values` as a contiguous float32 array, like `int32_array`; None stays None."""
    if values is None:
        return None
    if isinstance(values, np.ndarray) and values.dtype == FLOAT32_LE and values.ndim == 1 and values.flags.c_contiguous:
        return values
    return unpack(pack(values, FLOAT32_LE, field), FLOAT32_LE, field)


def pack_values(values: Sequence[int] | Sequence[float], code: str) -> bytes:
    """Pack a few numbers as little-endian `struct` type `code` (``i`` int32, ``q`` int64, ``d`` float64)."""
    return struct.pack(f"<{len(values)}{code}", *values)


def unpack_values(data: bytes | memoryview, code: str, field: str) -> tuple:
    """The numbers packed by `pack_values`, as a tuple of Python ints or floats."""
    size = struct.calcsize(code)
    if len(data) % size:
        raise DecodeError(f"field {field!r}: {len(data)} bytes is not a multiple of {size}")
    return struct.unpack(f"<{len(data) // size}{code}", data)
