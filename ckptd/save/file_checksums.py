"""The CRC32C of every file a save wrote, from the ranks' write results, without reading a byte back.

A rank's writer checksums each piece it writes.  A file one rank writes whole keeps its piece's
CRC32C.  A file several ranks write parts of (FSDP row blocks, shared files) gets its CRC32C by
combination: each rank folds the pieces it wrote of that file into one spread
(:func:`fold_shared_pieces`: their CRC32C with zeros in the other ranks' places), so a rank
reports one result per file instead of one per piece, and the coordinator combines one spread
per rank and file (:func:`combine_pieces`).  With W ranks of 1,000 pieces each that is W x files
results through the store and as many combines, where it was W x 1,000 of each.

Whether the pieces cover each file exactly once is checked where the pieces are known: a rank
checks that it wrote exactly the pieces of its plan (whose pieces the coordinator planned and
checked for gaps and overlaps), and the coordinator that each file's bytes add up to its size.
A file with no folded result (written whole by one rank, or made from an earlier checkpoint) is
checked piece by piece as before; beside folded results, a piece reported alone (one rank's
write of a file from its start, while another rank folded the empty piece of a zero-element
tensor at its end) counts as that rank's spread.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING

from ..errors import CorruptCheckpointError
from ..formats.checksum import crc32c_concat, crc32c_overlay, crc32c_spread, format_crc
from ..formats.manifest import FileRecord
from ..writer.protocol import FileResult

if TYPE_CHECKING:
    from .incremental import ReusedFile
    from .plan import RankPlan, SavePlan  # plan imports torch; this module must not

__all__ = ["combine_pieces", "fold_shared_pieces"]


def fold_shared_pieces(
    plan: RankPlan, results: Sequence[FileResult], reused: Collection[str] = ()
) -> tuple[FileResult, ...]:
    """This rank's write results as it reports them: whole files and files made from an earlier
    checkpoint as they are, and the pieces of each shared file (a file other ranks write parts
    of) folded into one result (``spread_end`` set).  ``reused``: the files this save makes from
    an earlier checkpoint's (no rank writes their pieces).  Raises
    :class:`~ckptd.errors.CorruptCheckpointError` unless the written pieces of shared files are
    exactly the plan's."""
    shared = {
        (p.file_name, p.file_offset, p.size) for p in plan.pieces if not p.whole_file and p.file_name not in reused
    }
    kept: list[FileResult] = []
    by_file: dict[str, list[FileResult]] = {}
    for result in results:
        if result.reused or result.spread_end or (result.name, result.file_offset, result.size) not in shared:
            kept.append(result)
        else:
            by_file.setdefault(result.name, []).append(result)
    written = {(r.name, r.file_offset, r.size) for pieces in by_file.values() for r in pieces}
    count = sum(len(pieces) for pieces in by_file.values())
    if written != shared or count != len(shared):
        missing = sorted(shared - written)[:3]
        raise CorruptCheckpointError(
            f"the writer reported {count} pieces of shared files where the plan has {len(shared)}"
            + (f" (not written: {', '.join(f'{n} at {o}' for n, o, _ in missing)})" if missing else "")
        )
    for name, pieces in by_file.items():
        pieces.sort(key=lambda r: r.file_offset)
        try:
            crc, end = crc32c_spread((r.file_offset, r.crc32c, r.size) for r in pieces)
        except ValueError as e:
            raise CorruptCheckpointError(f"{name}: {e}") from e
        kept.append(
            FileResult(
                name,
                sum(r.size for r in pieces),
                crc,
                sum(r.seconds for r in pieces),
                pieces[0].file_offset,
                spread_end=end,
            )
        )
    return tuple(kept)


def combine_pieces(
    plan: SavePlan,
    results: Sequence[FileResult],
    reused: Mapping[str, ReusedFile] | None = None,
    hashed: Mapping[str, ReusedFile] | None = None,
) -> dict[str, FileRecord]:
    """File records from the ranks' write results: every file must be covered exactly (per-piece
    results in order, or folded ones adding up to its size); the CRC32Cs combine into the file's.
    A file an incremental save made from the last checkpoint's (``reused``, or a ``hashed`` one
    whose SHA-256 matched: the writer linked or copied it) keeps that checkpoint's size, CRC32C
    and digest, and records how it was made."""
    reused, hashed = reused or {}, hashed or {}
    by_file: dict[str, list[FileResult]] = {}
    for result in results:
        by_file.setdefault(result.name, []).append(result)
    records: dict[str, FileRecord] = {}
    for file in plan.files:
        name = file.file_name
        results_of_file = by_file.get(name, [])
        made = [r for r in results_of_file if r.reused]
        if made:
            source = reused.get(name) or hashed.get(name)
            if source is None or len(results_of_file) != 1:
                raise CorruptCheckpointError(f"{name}: the writer made it from an earlier checkpoint, unasked")
            records[name] = source.record(made[0].how)
            continue
        if name in reused:
            raise CorruptCheckpointError(f"{name}: taken from {reused[name].source}, but no rank linked or copied it")
        if any(r.spread_end for r in results_of_file):
            records[name] = FileRecord(file.size, format_crc(_combine_spreads(name, file.size, results_of_file)))
            continue
        pieces = sorted(results_of_file, key=lambda r: (r.file_offset, r.size))  # an empty piece first
        position = 0
        for piece in pieces:
            if piece.file_offset != position:
                gap = f"{position}-{piece.file_offset}"
                raise CorruptCheckpointError(f"{name}: bytes {gap} were not written by any rank")
            position += piece.size
        value = crc32c_concat((piece.crc32c, piece.size) for piece in pieces)
        if position != file.size:
            raise CorruptCheckpointError(f"{name}: {position} of {file.size} bytes were written")
        digest = pieces[0].digest if len(pieces) == 1 else None  # a SHA-256 covers one whole-file write
        records[name] = FileRecord(file.size, format_crc(value), digest=digest)
    return records


def _combine_spreads(name: str, size: int, results: Sequence[FileResult]) -> int:
    """The CRC32C of a shared file from the ranks' folded results (one per rank that wrote any),
    and from pieces reported one by one beside them (a rank's piece that covers the file from
    its start is a whole-file write, reported as such, while another rank's empty piece of a
    zero-element tensor at its end was folded)."""
    spreads = []
    for r in results:
        end = r.spread_end if r.spread_end else r.file_offset + r.size
        if end > size or r.size > end:
            raise CorruptCheckpointError(f"{name}: a rank reported bytes up to {end} of a {size}-byte file")
        spreads.append((r.crc32c, r.spread_end) if r.spread_end else crc32c_spread([(r.file_offset, r.crc32c, r.size)]))
    written = sum(r.size for r in results)
    if written != size:
        raise CorruptCheckpointError(f"{name}: {written} of {size} bytes were written")
    return crc32c_overlay(spreads, size)
