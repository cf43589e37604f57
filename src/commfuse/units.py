"""Parsing of the human units used on the command line: byte sizes and link rates.

Sizes follow nccl-tests: ``4K`` is 4 * 1024 bytes, ``16M`` is 16 * 2**20. Rates follow ``tc``:
``1gbit`` is 1e9 bits per second, ``100mbit`` is 1e8.
"""

from __future__ import annotations

import re

_SIZE_SUFFIX = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMG]?)(?:I?B)?\s*$", re.IGNORECASE)
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(mbit|gbit|m|g)(?:/s|ps)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"16M"`` -> 16777216. Raises ValueError with the accepted forms."""
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(
            f"bad size {text!r}: use a byte count with an optional K, M or G, like 4K or 16M"
        )
    return int(match.group(1)) * _SIZE_SUFFIX[match.group(2).upper()]


def parse_sizes(text: str) -> list[int]:
    """A comma list (``4K,1M,16M``) or a doubling range (``4K:64M``) of byte sizes."""
    sizes: list[int] = []
    for part in text.split(","):
        if ":" in part:
            low_text, high_text = part.split(":", 1)
            low, high = parse_size(low_text), parse_size(high_text)
            if low <= 0 or high < low:
                raise ValueError(f"bad size range {part!r}: need 0 < low <= high, like 4K:64M")
            size = low
            while size <= high:
                sizes.append(size)
                size *= 2
        else:
            sizes.append(parse_size(part))
    return sizes


def format_size(num_bytes: int) -> str:
    """The inverse of parse_size for exact multiples (16777216 -> "16M")."""
    for suffix in ("G", "M", "K"):
        unit = _SIZE_SUFFIX[suffix]
        if num_bytes >= unit and num_bytes % unit == 0:
            return f"{num_bytes // unit}{suffix}"
    return str(num_bytes)


def parse_rate_mbit(text: str) -> float:
    """``"1gbit"`` -> 1000.0 (Mbit/s). Zero and negative rates are refused."""
    match = _RATE_RE.match(text)
    if not match:
        raise ValueError(
            f"bad link rate {text!r}: use Mbit/s or Gbit/s, like 100mbit, 1gbit or 2.5gbit"
        )
    value = float(match.group(1))
    mbit = value * (1000.0 if match.group(2).lower().startswith("g") else 1.0)
    if mbit <= 0:
        raise ValueError(f"bad link rate {text!r}: a link must carry more than 0 bit/s")
    return mbit


def format_rate(mbit: float) -> str:
    """1000.0 -> "1gbit"; 250.0 -> "250mbit"."""
    if mbit >= 1000 and mbit % 1000 == 0:
        return f"{int(mbit // 1000)}gbit"
    if mbit >= 1000:
        return f"{mbit / 1000:g}gbit"
    return f"{mbit:g}mbit"
