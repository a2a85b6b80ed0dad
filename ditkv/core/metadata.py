"""`DiffusionKVMetadata`: the immutable snapshot of one request's rows and blocks.

Sent to every worker rank; encoded as msgpack. Workers validate it before writing anything.
"""

from __future__ import annotations

import msgspec


class RowMetadata(msgspec.Struct, frozen=True, array_like=True):
    row_id: int
    prefix_len: int
    target_len: int
    seq_len: int
    full_attn_spans: tuple[tuple[int, int], ...]
    block_ids: tuple[int, ...]
    num_computed_tokens: int = 0  # tokens already present (imported prefix or cache hit); step 0 starts here
    # of those, the leading tokens whose pages are shared and read-only (num_cached_tokens // block_size
    # pages, never written by this row): from the prefix cache, then row 0's (num_row0_tokens)
    num_cached_tokens: int = 0
    # of those, the trailing tokens whose pages are row 0's of this request (prefix cache on, equal keys):
    # row 0's first step writes them, and this row reads them in the same pass
    num_row0_tokens: int = 0


class DiffusionKVMetadata(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    generation: int
    block_size: int
    rows: tuple[RowMetadata, ...]

    @property
    def num_blocks(self) -> int:
        return sum(len(r.block_ids) for r in self.rows)

    def same_snapshot(self, other: "DiffusionKVMetadata") -> bool:
        """Equal apart from the generation stamp."""
        return (self.request_id, self.block_size, self.rows) == (other.request_id, other.block_size, other.rows)


_encoder = msgspec.msgpack.Encoder()


def encode_metadata(meta: DiffusionKVMetadata) -> bytes:
    """The snapshot alone as msgpack (what it weighs on the wire; ranks receive it inside an
    engine message and decode it with that message, `engine/messages.py`)."""
    return _encoder.encode(meta)
