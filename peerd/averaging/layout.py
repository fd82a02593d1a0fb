"""How a round cuts the flat tensor: one span per member, chunks within a span.

Both ends of every stream derive the same layout from (numel, members, block size, chunk_numel); only
``span_numel`` and ``chunk_numel`` travel in the ReduceRequest, as a check. Changing anything here changes the
protocol (protocols/peerd_averaging.proto).
"""

from __future__ import annotations

import math


def split_spans(numel: int, parts: int, align: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) spans, as equal as ``align``-sized blocks allow (last ones may be empty)."""
    blocks = math.ceil(numel / align) if numel else 0
    bounds = [min(numel, (blocks * i // parts) * align) for i in range(parts + 1)]
    bounds[-1] = numel
    return [(bounds[i], bounds[i + 1]) for i in range(parts)]


def chunk_bounds(numel: int, chunk_numel: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of a span: ``chunk_numel`` elements each, the last one shorter."""
    return [(start, min(numel, start + chunk_numel)) for start in range(0, numel, chunk_numel)] or [(0, 0)]


def max_payload_bytes(numel: int) -> int:
    """Largest codec payload ``numel`` elements may take (raw fp32 plus header and shape)."""
    return 4 * numel + 4096
