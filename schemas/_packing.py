"""Packed little-endian arrays: the hot fields of a ScoredGroup travel as raw bytes, not Avro arrays.

Encoding 8 x 4096 token ids as Avro `array<int>` costs a Python object per element; as packed bytes
it is one memcpy. Decoded arrays are zero-copy, read-only numpy views over the record's bytes.
"""

from __future__ import annotations

import array
import struct
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
from rollstream.schemas._errors import DecodeError, InvalidRecordError

INT32_LE = np.dtype("<i4")
FLOAT32_LE = np.dtype("<f4")
UINT8 = np.dtype("u1")  # loss masks: one 0/1 byte per token
# `array` type codes of exactly int32 / float32, on a little-endian machine (None: convert lists with numpy).
_INT32_CODE = next((c for c in "il" if array.array(c).itemsize == 4), None) if sys.byteorder == "little" else None
_FLOAT32_CODE = "f" if sys.byteorder == "little" and array.array("f").itemsize == 4 else None


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
    converted = _from_list(values, _INT32_CODE, INT32_LE)
    return converted if converted is not None else unpack(pack(values, INT32_LE, field), INT32_LE, field)


def float32_array(values: Sequence[float] | np.ndarray | None, field: str) -> np.ndarray | None:
    """`values` as a contiguous float32 array, like `int32_array`; None stays None."""
    if values is None:
        return None
    if isinstance(values, np.ndarray) and values.dtype == FLOAT32_LE and values.ndim == 1 and values.flags.c_contiguous:
        return values
    converted = _from_list(values, _FLOAT32_CODE, FLOAT32_LE)
    return converted if converted is not None else unpack(pack(values, FLOAT32_LE, field), FLOAT32_LE, field)


def _from_list(values: Any, code: Any, dtype: np.dtype) -> np.ndarray | None:
    """A list or tuple of numbers (what an engine's JSON gives) as a read-only array of `dtype`, converted
    by `array` (about 2.5x faster than numpy for a list, and in one C loop that holds the interpreter
    lock, where numpy's range checks release it); None when it is no such list (`pack` then converts it,
    and names what is wrong: a float among token ids, an id beyond int32, ...)."""
    if code is None or type(values) not in (list, tuple) or not values or type(values[0]) is bool:
        return None
    try:
        converted = np.frombuffer(array.array(code, values), dtype)
    except (TypeError, OverflowError, ValueError):
        return None
    converted.flags.writeable = False
    return converted


def pack_values(values: Sequence[int] | Sequence[float], code: str) -> bytes:
    """Pack a few numbers as little-endian `struct` type `code` (``i`` int32, ``q`` int64, ``d`` float64)."""
    return struct.pack(f"<{len(values)}{code}", *values)


def unpack_values(data: bytes | memoryview, code: str, field: str) -> tuple:
    """The numbers packed by `pack_values`, as a tuple of Python ints or floats."""
    size = struct.calcsize(code)
    if len(data) % size:
        raise DecodeError(f"field {field!r}: {len(data)} bytes is not a multiple of {size}")
    return struct.unpack(f"<{len(data) // size}{code}", data)
