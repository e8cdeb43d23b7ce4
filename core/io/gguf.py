"""Reading GGUF files: metadata, tensor directory, memory-mapped tensor data, dequantization.

We parse the header ourselves because `gguf.GGUFReader` builds a Python object per array element
and takes ~15 s to open a file with a 262k-token vocabulary; this parser reads numeric arrays with
numpy and takes a fraction of a second. Quantization block layouts and the dequantizers for the
k-quants come from the `gguf` package (the reference implementation shipped by llama.cpp).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from outrider.errors import ModelFileError

_MAGIC = b"GGUF"
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
                 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9

# Types the two real models use, plus the other common ones whose dequantizer we have tested.
SUPPORTED_TYPES = {
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (slowest dimension first); GGUF stores the reverse
    type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


class _Cursor:
    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise ModelFileError(f"{self.path}: file ends inside its header (truncated download?); fetch it again")
        view = self.buf[self.pos:self.pos + n]
        self.pos += n
        return view

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return bytes(self.take(self.scalar("<Q"))).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            if item_type in _NUMPY_DTYPES:
                dtype = np.dtype(_NUMPY_DTYPES[item_type])
                return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).tolist()
            return [self.value(item_type) for _ in range(count)]
        raise ModelFileError(f"{self.path}: unknown GGUF value type {vtype}; the file is corrupt or from a newer GGUF")


class GGUFFile:
    """A GGUF file: `metadata` (plain Python values), `tensors` (directory), `load(name)` (torch tensor)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFileError(f"{self.path}: no such model file; pass a .gguf path or a catalog name (`outrider models`)")
        with open(self.path, "rb") as f:
            try:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:
                raise ModelFileError(f"{self.path}: file is empty; fetch it again") from None
            # the contents this object maps, told from those of a file replaced or rewritten at the same path
            # later (`outrider.models.packed_cache` keys what it keeps by it)
            st = os.fstat(f.fileno())
            self.identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        self._buf = memoryview(self._mmap)
        cur = _Cursor(self._buf, self.path)
        if bytes(cur.take(4)) != _MAGIC:
            raise ModelFileError(f"{self.path}: not a GGUF file (bad magic); pass a .gguf model file")
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise ModelFileError(f"{self.path}: GGUF version {version} is not supported (need 2 or 3)")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar("<I"))
        raw = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
            raw.append((name, tuple(reversed(dims)), cur.scalar("<I"), cur.scalar("<Q")))
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-cur.pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, type_id, rel in raw:
            try:
                qtype = GGMLQuantizationType(type_id)
            except ValueError:
                raise ModelFileError(f"{self.path}: tensor {name} has unknown type id {type_id}; "
                                     "re-quantize it to a supported type (e.g. Q8_0, Q4_K)") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(shape)) if shape else 1
            info = TensorInfo(name, shape, qtype, data_start + rel, n // block * type_size)
            if info.offset + info.nbytes > len(self._buf):
                raise ModelFileError(f"{self.path}: tensor {name} lies past the end of the file "
                                     f"({len(self._buf)} bytes): the file is truncated; fetch it again")
            self.tensors[name] = info

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_key(self, key: str, default: Any = None) -> Any:
        """Metadata under the architecture's prefix, e.g. `block_count` -> `llama.block_count`."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def require(self, key: str) -> Any:
        full = f"{self.architecture}.{key}"
        if full not in self.metadata:
            raise ModelFileError(f"{self.path}: required metadata key {full} is missing; the file is incomplete")
        return self.metadata[full]

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of a tensor, memory-mapped (no copy)."""
        info = self.tensors[name]
        return np.frombuffer(self._buf, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def load(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A tensor dequantized to `dtype`, in torch's dimension order."""
        if name not in self.tensors:
            raise ModelFileError(f"{self.path}: tensor {name} is missing; the file is incomplete or not this architecture")
        info = self.tensors[name]
        return dequantize(self.raw(name), info.type, info.shape, self.path, name).to(dtype)

    def close(self) -> None:
        self._buf.release()
        self._mmap.close()


class TensorsInMemory(GGUFFile):
    """What a GGUF file of these tensors and metadata reads as, held in memory: for a model part made while the
    program runs (a head `drafter.learn` trains), which would otherwise be written to a file only to be read back.
    `tensors`: {name: (stored bytes or values, type, shape in torch order)}; `name` stands for the path in messages."""

    def __init__(self, name: str, metadata: dict[str, Any],
                 tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType, tuple[int, ...]]]):
        self.path, self.metadata = Path(name), dict(metadata)
        self.identity = None  # no file: nothing outlives the program (see GGUFFile.identity)
        self._data = {key: np.ascontiguousarray(array).view(np.uint8).reshape(-1)
                      for key, (array, _, _) in tensors.items()}
        self.tensors = {key: TensorInfo(key, tuple(shape), qtype, 0, self._data[key].nbytes)
                        for key, (_, qtype, shape) in tensors.items()}

    def raw(self, name: str) -> np.ndarray:
        return self._data[name]

    def close(self) -> None:
        self._data.clear()


def check_supported(qtype: GGMLQuantizationType, path: Path | str, name: str) -> None:
    if qtype not in SUPPORTED_TYPES:
        raise ModelFileError(f"{path}: tensor {name} uses quantization {qtype.name}, which Outrider does not support; "
                             f"re-quantize the model to one of {', '.join(sorted(t.name for t in SUPPORTED_TYPES))}")


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...],
               path: Path | str = "", name: str = "") -> torch.Tensor:
    """Raw GGUF bytes -> float32 tensor of `shape`."""
    check_supported(qtype, path, name)
    if qtype == GGMLQuantizationType.F32:
        return torch.from_numpy(data.view(np.float32).copy()).reshape(shape)
    if qtype == GGMLQuantizationType.F16:
        return torch.from_numpy(data.view(np.float16).copy()).float().reshape(shape)
    if qtype == GGMLQuantizationType.BF16:
        return torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16).float().reshape(shape)
    if qtype == GGMLQuantizationType.Q8_0:
        return _dequantize_q8_0(data).reshape(shape)
    rows = data.reshape(int(np.prod(shape[:-1])) if len(shape) > 1 else 1, -1)
    return torch.from_numpy(np.ascontiguousarray(gguf_quants.dequantize(rows, qtype))).reshape(shape)


def _dequantize_q8_0(data: np.ndarray) -> torch.Tensor:
    # Block of 34 bytes: float16 scale, then 32 int8 values. Done in torch because the numpy path is
    # ~20x slower on Gemma's 262k x 640 embedding table.
    blocks = torch.from_numpy(data.reshape(-1, 34).copy())
    scale = blocks[:, :2].contiguous().view(torch.float16).float()
    return (blocks[:, 2:].view(torch.int8).float() * scale).reshape(-1)


def stored_weight_bytes(gguf) -> int:
    """Bytes of weights read per decoded token as stored in the GGUF. The input embedding is a row gather,
    so it counts only when it doubles as the output head."""
    stored = sum(info.nbytes for name, info in gguf.tensors.items() if name != "token_embd.weight")
    if "output.weight" not in gguf.tensors and "token_embd.weight" in gguf.tensors:
        stored += gguf.tensors["token_embd.weight"].nbytes
    return stored
