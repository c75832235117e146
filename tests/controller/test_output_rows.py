"""How output pieces become stored rows (``coalesce_output``): pure, property-tested.

A streamed output request is journalled piece by piece (the server's read size);
the commit joins pieces that continue each other into rows of bounded size. The
bytes and where they sit must not change; only the cuts may.
"""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from rc_worker.controller.persist.codec import coalesce_output

Piece = tuple[str, int, bytes]


@st.composite
def journalled(draw: st.DrawFn) -> list[Piece]:
    """Pieces as a store journals them: each job's appends follow each other (a job
    resumed at its committed offset after a restart starts a new run), interleaved."""
    ends: dict[str, int] = {}
    pieces: list[Piece] = []
    for _ in range(draw(st.integers(0, 40))):
        job = draw(st.sampled_from(["a", "b", "c"]))
        data = draw(st.binary(min_size=1, max_size=12))
        off = ends.get(job, draw(st.integers(0, 5)))
        pieces.append((job, off, data))
        ends[job] = off + len(data)
    return pieces


def placed(rows: list[Piece] | tuple[Piece, ...]) -> dict[str, dict[int, int]]:
    """Every byte of every job at its offset."""
    out: dict[str, dict[int, int]] = {}
    for job, off, data in rows:
        for i, b in enumerate(data):
            out.setdefault(job, {})[off + i] = b
    return out


@given(journalled(), st.integers(1, 30))
def test_the_bytes_and_their_offsets_are_unchanged(pieces: list[Piece], row: int) -> None:
    rows = coalesce_output(pieces, row)
    assert placed(rows) == placed(pieces)
    assert sum(len(d) for _, _, d in rows) == sum(len(d) for _, _, d in pieces)


@given(journalled(), st.integers(1, 30))
def test_rows_are_bounded_unless_a_single_piece_is_larger(pieces: list[Piece], row: int) -> None:
    sizes = {len(d) for _, _, d in pieces}
    for _, _, data in coalesce_output(pieces, row):
        assert len(data) <= row or len(data) in sizes


@given(journalled(), st.integers(1, 30))
def test_pieces_that_continue_each_other_are_joined(pieces: list[Piece], row: int) -> None:
    rows = coalesce_output(pieces, row)
    for (j1, o1, d1), (j2, o2, d2) in itertools.pairwise(rows):
        # Two rows in a row are apart only if they could not be one.
        assert j1 != j2 or o1 + len(d1) != o2 or len(d1) + len(d2) > row
    assert len(rows) <= len(pieces)


def test_a_streamed_body_of_small_pieces_becomes_a_few_large_rows() -> None:
    pieces = [("j", i * 64, bytes([i % 256]) * 64) for i in range(100)]
    rows = coalesce_output(pieces, 1024)
    assert [(off, len(d)) for _, off, d in rows] == [(i * 1024, 1024) for i in range(6)] + [
        (6144, 256)
    ]
