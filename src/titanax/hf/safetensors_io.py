"""Streaming safetensors: read one tensor at a time, write one tensor at a time.

The format (https://github.com/huggingface/safetensors) is an 8-byte little-endian header
length, a JSON header {name: {dtype, shape, data_offsets}}, then the raw little-endian bytes.
The `safetensors` package can only write a whole dict of tensors held in memory at once, so a
multi-GB shard would sit in host memory; here the header is written from the planned shapes
first and each tensor's bytes follow as soon as they are produced. Reading goes through plain
file reads (no mmap, so a read tensor's pages do not stay in the resident set) and validates
the header against the file size first, so a truncated download is reported before any use.
Nothing here unpickles anything.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import struct

import ml_dtypes
import numpy as np

# safetensors dtype names -> numpy. Only floating types are ever loaded into a model; the rest
# are listed so that an error can say what a file holds instead of "unknown dtype".
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8), "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
NAME_OF_DTYPE = {v: k for k, v in DTYPES.items()}
_MAX_HEADER_BYTES = 100_000_000  # the reference implementation's own limit


class SafetensorsError(ValueError):
    """A safetensors file that cannot be used as it is; the message names the file."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors name, e.g. 'BF16'
    shape: tuple[int, ...]
    start: int  # absolute file offsets of the tensor's bytes
    end: int


def dtype_name(dtype) -> str:
    dt = np.dtype(dtype)
    if dt not in NAME_OF_DTYPE:
        raise SafetensorsError(f"dtype {dt} has no safetensors name")
    return NAME_OF_DTYPE[dt]


def read_header(path: str | pathlib.Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """({name: TensorInfo}, __metadata__) after checking the header against the file size."""
    path = pathlib.Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise SafetensorsError(f"{path}: {size} bytes is too short for a safetensors file "
                                   "(truncated or not safetensors)")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER_BYTES or 8 + n > size:
            raise SafetensorsError(f"{path}: header claims {n} bytes but the file has {size}; "
                                   "the file is truncated or not safetensors")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"{path}: unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: the safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    base = 8 + n
    tensors = {}
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{path}: malformed header entry for {name!r}: {entry!r}") from None
        if dtype not in DTYPES:
            raise SafetensorsError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
        if end - begin != nbytes or begin < 0:
            raise SafetensorsError(f"{path}: tensor {name!r} {dtype}{list(shape)} needs {nbytes} "
                                   f"bytes but its offsets {begin}..{end} span {end - begin}")
        if base + end > size:
            raise SafetensorsError(f"{path}: tensor {name!r} ends at byte {base + end} but the file "
                                   f"has {size} bytes; the file is truncated (re-download it)")
        tensors[name] = TensorInfo(dtype, shape, base + begin, base + end)
    return tensors, metadata


def read_tensor(path: str | pathlib.Path, info: TensorInfo) -> np.ndarray:
    out = np.empty(info.shape, DTYPES[info.dtype])
    with open(path, "rb") as f:
        f.seek(info.start)
        got = f.readinto(memoryview(out.reshape(-1).view(np.uint8)))
    if got != info.end - info.start:
        raise SafetensorsError(f"{path}: short read of {info.dtype}{list(info.shape)} tensor at "
                               f"byte {info.start} (file changed or truncated)")
    return out


class StreamingWriter:
    """Writes a safetensors file whose tensors (names, shapes, dtypes, order) are known up
    front; `write` then takes them one at a time, in that order. The file appears under its
    name only after `close` has checked that every tensor was written."""

    def __init__(self, path: str | pathlib.Path, plan: list[tuple[str, tuple[int, ...], str]],
                 metadata: dict[str, str] | None = None):
        self.path = pathlib.Path(path)
        self._plan = list(plan)
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        for name, shape, dtype in self._plan:
            nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
            header[name] = {"dtype": dtype, "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # tensor data 8-byte aligned, as the reference writer does
        self._tmp = self.path.with_name(f".{self.path.name}.partial")
        self._f = open(self._tmp, "wb")
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0

    def write(self, name: str, array: np.ndarray) -> None:
        if self._next >= len(self._plan):
            raise SafetensorsError(f"{self.path}: {name!r} written after the last planned tensor")
        want_name, want_shape, want_dtype = self._plan[self._next]
        got = (name, tuple(array.shape), dtype_name(array.dtype))
        if got != (want_name, tuple(want_shape), want_dtype):
            raise SafetensorsError(f"{self.path}: expected {want_name} {want_dtype}"
                                   f"{list(want_shape)} next, got {got[0]} {got[2]}{list(got[1])}")
        # A contiguous view as bytes: no second copy of the tensor (x86/ARM are little-endian,
        # as the format requires).
        self._f.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
        self._next += 1

    def close(self) -> None:
        self._f.close()
        if self._next != len(self._plan):
            self._tmp.unlink(missing_ok=True)
            raise SafetensorsError(f"{self.path}: only {self._next} of {len(self._plan)} planned "
                                   "tensors were written")
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        self._f.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.close()
        else:
            self.abort()
