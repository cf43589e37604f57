"""An independent decoder of the all-gather compressors' messages, for the tests' references.

Written from the wire format the compressors' modules document, with numpy in float64, and
sharing no code with ``commfuse.compress``: a reference built from the compressor's own
``decompress_sum`` would agree with a wrong decoder. One rank's message is a run of int32
words; its bytes are the fields laid end to end in the order below, with no padding between
them, and zero bytes up to a whole word at the end:

========== ===================================================================================
int8       fp32 scale; ``numel`` int8 codes q.                   x_i = scale * q_i
qsgd       fp32 norm per chunk of ``chunk_numel``; ``numel``    x_i = norm_c * (code_i - s) / s
terngrad   codes of ``b`` bits packed 8 / b per byte, low bits  (s = levels; terngrad: s = 1;
           first; b the narrowest of 1, 2, 4, 8 with 2**b >=   b = 2 for s = 1, 4 for s <= 7)
           2 s + 1.
sign,      fp32 scale; ``numel`` bits packed 8 per byte, low    x_i = scale if bit_i else -scale
ef-sign    bits first.
topk, dgc  k values (the gradient's dtype); k int32 indices.    x[index_j] += value_j
           k = min(numel, max(1, ceil(density * numel))); top-k's density is its ratio; DGC's
           decays from 0.25 to its ratio over ``warmup`` steps: 0.25 (ratio / 0.25)**(t / warmup).
int4       fp32 scale per chunk of c; ``numel`` 4-bit codes     x_i = scale_c * (code_i - 8)
           q + 8, two per byte, low nibble first.
sparseloco per row of c elements (c = min(chunk_numel, numel), rows = ceil(numel / c), the last
           zero-padded), k = min(num_kept_per_chunk, c): fp32 levels (low, high) per row;
           rows x k uint16 indices inside the row; rows x k 2-bit codes packed 4 per byte (bit
           0: sign, 1 = positive; bit 1: level, 1 = high).  x[row c + index] = +-(high or low)
demo       rows and k as sparseloco's: rows x k fp32 DCT coefficients; rows x k uint8 indices;
           each row is the inverse orthonormal DCT-II of its kept coefficients (the padded tail
           of the last row is dropped).
========== ===================================================================================
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

F64 = npt.NDArray[np.float64]
NUMPY_DTYPES = {
    "torch.float32": np.float32,
    "torch.float64": np.float64,
    "torch.float16": np.float16,
}


def code_bits(levels: int) -> int:
    return next(bits for bits in (1, 2, 4, 8) if 2 * levels + 1 <= 1 << bits)


def sparse_k(compressor: Any, numel: int, step: int) -> int:
    density = float(compressor.ratio)
    if compressor.name == "dgc" and step < compressor.warmup and density < 0.25:
        density = 0.25 * (density / 0.25) ** (step / compressor.warmup)
    return int(min(numel, max(1, math.ceil(density * numel))))


def field_sizes(compressor: Any, numel: int, step: int, value_dtype: str) -> list[tuple[Any, int]]:
    """The message's fields, in order, as (numpy dtype, count)."""
    name = compressor.name
    if name == "int8":
        return [(np.float32, 1), (np.int8, numel)]
    if name in ("qsgd", "terngrad"):
        chunks = -(-numel // compressor.chunk_numel)
        return [(np.float32, chunks), (np.uint8, -(-numel * code_bits(compressor.levels) // 8))]
    if name in ("sign", "ef-sign"):
        return [(np.float32, 1), (np.uint8, -(-numel // 8))]
    if name in ("topk", "dgc"):
        k = sparse_k(compressor, numel, step)
        return [(NUMPY_DTYPES[value_dtype], k), (np.int32, k)]
    if name == "int4":
        chunks = -(-numel // min(compressor.chunk_numel, numel))
        return [(np.float32, chunks), (np.uint8, -(-numel // 2))]
    if name in ("sparseloco", "demo"):
        rows, _, k = rows_chunk_k(compressor, numel)
        if name == "demo":
            return [(np.float32, rows * k), (np.uint8, rows * k)]
        return [(np.float32, 2 * rows), (np.uint16, rows * k), (np.uint8, -(-rows * k // 4))]
    raise ValueError(f"no independent decoder for {name!r}")


def rows_chunk_k(compressor: Any, numel: int) -> tuple[int, int, int]:
    chunk = min(compressor.chunk_numel, numel)
    return -(-numel // chunk), chunk, min(compressor.num_kept_per_chunk, chunk)


def inverse_dct(coefficients: F64) -> F64:
    """The inverse orthonormal DCT-II of a row, by its defining sum (DCT-III)."""
    size = len(coefficients)
    k = np.arange(size)
    out = np.zeros(size)
    for i in range(size):
        basis = np.cos(np.pi * (2 * i + 1) * k / (2 * size)) * np.sqrt(2.0 / size)
        basis[0] /= np.sqrt(2.0)
        out[i] = float(np.dot(basis, coefficients))
    return out


def wire_bytes(compressor: Any, numel: int, step: int, value_dtype: str = "torch.float32") -> int:
    size = sum(
        int(np.dtype(dt).itemsize) * n
        for dt, n in field_sizes(compressor, numel, step, value_dtype)
    )
    return -(-size // 4) * 4


def parse(
    compressor: Any, message: bytes, numel: int, step: int, value_dtype: str = "torch.float32"
) -> list[npt.NDArray[Any]]:
    """One rank's message split into its fields (numpy arrays)."""
    expected = wire_bytes(compressor, numel, step, value_dtype)
    if len(message) != expected:
        raise ValueError(f"{compressor.name}: message of {len(message)} bytes, expected {expected}")
    out, offset = [], 0
    for dtype, count in field_sizes(compressor, numel, step, value_dtype):
        size = np.dtype(dtype).itemsize * count
        out.append(np.frombuffer(message[offset : offset + size], dtype=dtype).copy())
        offset += size
    if any(message[offset:]):
        raise ValueError(f"{compressor.name}: the padding after the fields is not zero")
    return out


def unpack_codes(packed: npt.NDArray[np.uint8], bits: int, numel: int) -> npt.NDArray[np.int64]:
    per_byte = 8 // bits
    index = np.arange(numel)
    shifted = packed[index // per_byte].astype(np.int64) >> ((index % per_byte) * bits)
    return shifted & ((1 << bits) - 1)


def decode(
    compressor: Any, message: bytes, numel: int, step: int, value_dtype: str = "torch.float32"
) -> F64:
    """One rank's message as the dense float64 vector it stands for."""
    fields = parse(compressor, message, numel, step, value_dtype)
    name = compressor.name
    if name == "int8":
        scale, codes = fields
        return float(scale[0]) * codes.astype(np.float64)
    if name in ("qsgd", "terngrad"):
        norms, packed = fields
        s = compressor.levels
        codes = unpack_codes(packed, code_bits(s), numel)
        per_element = np.repeat(norms.astype(np.float64), compressor.chunk_numel)[:numel]
        return np.asarray(per_element * (codes - s) / s, dtype=np.float64)
    if name in ("sign", "ef-sign"):
        scale, packed = fields
        bits = unpack_codes(packed, 1, numel)
        return np.where(bits == 1, 1.0, -1.0) * float(scale[0])
    if name == "int4":
        scales, packed = fields
        chunk = min(compressor.chunk_numel, numel)
        per_element = np.repeat(scales.astype(np.float64), chunk)[:numel]
        return np.asarray(per_element * (unpack_codes(packed, 4, numel) - 8), dtype=np.float64)
    if name in ("sparseloco", "demo"):
        rows, chunk, k = rows_chunk_k(compressor, numel)
        padded = np.zeros(rows * chunk)
        if name == "sparseloco":
            bounds, indices, packed = fields
            codes = unpack_codes(packed, 2, rows * k)
            for j in range(rows * k):
                row = j // k
                level = bounds[2 * row + 1] if codes[j] & 2 else bounds[2 * row]
                padded[row * chunk + int(indices[j])] += level if codes[j] & 1 else -level
            return padded[:numel]
        values, indices = fields
        for row in range(rows):
            coefficients = np.zeros(chunk)
            for j in range(row * k, (row + 1) * k):
                coefficients[int(indices[j])] += float(values[j])
            padded[row * chunk : (row + 1) * chunk] = inverse_dct(coefficients)
        return padded[:numel]
    values, indices = fields
    dense = np.zeros(numel, dtype=np.float64)
    np.add.at(dense, indices.astype(np.int64), values.astype(np.float64))
    return dense


def average(
    compressor: Any,
    messages: list[bytes],
    numel: int,
    step: int,
    value_dtype: str = "torch.float32",
) -> F64:
    """``(1/P) sum_r decode(message_r)``: what every rank's output must be, in float64."""
    decoded = [decode(compressor, m, numel, step, value_dtype) for m in messages]
    return np.asarray(np.sum(decoded, axis=0) / len(messages), dtype=np.float64)
