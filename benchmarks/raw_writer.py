#!/usr/bin/env python
"""A bare writer process: the write floor of ``floors.py``, run beside a training loop.

``bench_interference.py`` starts this script to learn how much writing the checkpoint's bytes
slows training when nothing else happens: no staging, no checksums, no file format, only the
write floor's I/O (``O_DIRECT`` 16 MiB ``pwrite`` calls from one page-aligned buffer to one new
file, then ``fsync``).  Any slowdown of training steps beyond this one is the saver's own.

Protocol (stdin/stdout, one line each): the script fills its buffer (every page touched), prints
``ready``, waits for a line on stdin, writes ``--bytes`` bytes to ``--path``, prints the seconds
the write took and exits.  It imports nothing heavy (no torch), as ckptd's writer.  Where the
file system refuses ``O_DIRECT`` it writes buffered (the same fallback as the floor).
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time

ALIGNMENT = 4096
CHUNK = 16 * 1024 * 1024  # as floors.WRITE_CHUNK and ckptd's default chunk_size


def filled_buffer(nbytes: int) -> mmap.mmap:
    """A page-aligned anonymous buffer of ``nbytes`` (rounded up to a page), every page written."""
    length = -(-nbytes // ALIGNMENT) * ALIGNMENT
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    buffer = mmap.mmap(-1, length, flags=flags)
    for offset in range(0, length, ALIGNMENT):
        buffer[offset] = (offset // ALIGNMENT) % 251 + 1
    return buffer


def write_file(path: str, buffer: mmap.mmap, nbytes: int) -> float:
    """Seconds to create ``path``, write ``nbytes`` of ``buffer``, truncate to size and ``fsync``."""
    view = memoryview(buffer)
    started = time.perf_counter()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        length = len(buffer)
    except OSError:  # no O_DIRECT on this file system
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        length = nbytes
    try:
        for start in range(0, length, CHUNK):
            chunk = view[start : min(start + CHUNK, length)]
            done = 0
            while done < len(chunk):
                done += os.pwrite(fd, chunk[done:], start + done)
        if length != nbytes:
            os.ftruncate(fd, nbytes)
        os.fsync(fd)
    finally:
        os.close(fd)
        view.release()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bytes", type=int, required=True, help="bytes to write")
    parser.add_argument("--path", required=True, help="the file to create (the caller removes it)")
    parser.add_argument("--nice", type=int, default=0, help="CPU niceness increment (ckptd's writer uses 10)")
    args = parser.parse_args(argv)
    if args.nice:
        os.nice(args.nice)
    buffer = filled_buffer(args.bytes)
    print("ready", flush=True)
    if not sys.stdin.readline():
        return 1  # the caller went away before saying go
    print(f"{write_file(args.path, buffer, args.bytes):.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
