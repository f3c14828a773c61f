"""A fast GGUF header reader: metadata key/values and tensor descriptors, plus tensor bytes.

Why not ``gguf.GGUFReader``: it builds a numpy memmap view per array element, ~4.5 s for the
~100k tokenizer strings of SmolLM2 alone. The header format is simple (see the GGUF spec in
ggml's docs): little-endian ``magic "GGUF", version u32, n_tensors u64, n_kv u64``, then
``n_kv`` x (key string, value type u32, value), then ``n_tensors`` x (name string, n_dims
u32, dims u64[n_dims] (fastest-varying first), ggml type u32, offset u64), then tensor data
at ``align_up(end of header, general.alignment)``. Strings are u64 length + UTF-8 bytes.
Dequantization stays with the ``gguf`` package's type tables (and quants.py fallback).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# GGUF value type -> (struct format, numpy dtype) for scalars.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "<u1"),
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    # numpy order (slowest-varying first), e.g. [out_features, in_features].
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        if self._mm[:4] != b"GGUF":
            raise ValueError(f"model: {self.path} is not a GGUF file")
        self._pos = 4
        version, n_tensors, n_kv = self._unpack("<IQQ")
        if version < 2:
            raise ValueError(f"model: GGUF version {version} is not supported")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            (vtype,) = self._unpack("<I")
            self.metadata[key] = self._value(vtype)
        infos = [self._tensor_info() for _ in range(n_tensors)]
        align = int(self.metadata.get("general.alignment", 32))
        data_start = (self._pos + align - 1) // align * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, qtype, rel in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            nbytes = int(np.prod(shape)) // block * type_size
            self.tensors[name] = TensorInfo(name, shape, qtype, data_start + rel, nbytes)

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self._mm, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._mm, self._pos)
        start = self._pos + 8
        self._pos = start + n
        return self._mm[start : start + n].decode("utf-8", errors="replace")

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._unpack("<IQ")
            if etype == _STRING:
                return [self._string() for _ in range(count)]
            if etype == _ARRAY:
                return [self._value(_ARRAY) for _ in range(count)]
            dtype = np.dtype(_SCALARS[etype][1])
            arr = np.frombuffer(self._mm, dtype=dtype, count=count, offset=self._pos)
            self._pos += count * dtype.itemsize
            return arr.tolist()
        fmt = _SCALARS[vtype][0]
        (value,) = self._unpack(fmt)
        return bool(value) if vtype == 7 else value

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        (n_dims,) = self._unpack("<I")
        dims = self._unpack(f"<{n_dims}Q")
        qtype, offset = self._unpack("<IQ")
        return name, tuple(reversed(dims)), GGMLQuantizationType(qtype), offset

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes as uint8 [rows..., bytes_per_row] (zero-copy view of the mmap)."""
        flat = np.frombuffer(self._mm, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return flat.reshape(*info.shape[:-1], -1)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)
