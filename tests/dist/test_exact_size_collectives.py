"""The planning collectives send every rank's bytes at their exact size: the coordinator's
peak memory follows what is sent, not world size x the largest part (torch's gather_object and
scatter_object_list pad every rank's bytes to the largest: 16,384 x a 150 KB plan = 2.4 GB)."""

from __future__ import annotations

import pytest
from distributed import run_ranks

from ckptd.dist.group import DistContext

pytestmark = [pytest.mark.multiprocess, pytest.mark.distributed]

BIG = 48 << 20


def _kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(field)


def _peak_growth(operation) -> tuple[object, int]:
    """``operation()`` and how far the peak resident memory rose above the memory before it."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # restart the peak (VmHWM) from the current resident size
    before = _kib("VmRSS")
    out = operation()
    return out, (_kib("VmHWM") - before) << 10


def one_big_part(rank: int, world: int) -> dict[str, object]:
    context = DistContext.detect(timeout=60)
    assert context is not None
    big = bytes(range(256)) * (BIG // 256)  # made before the measurement: what one rank sends or receives
    gathered, gather_growth = _peak_growth(lambda: context.gather(big if rank == 1 else b"x"))
    parts = [big if r == 1 else b"y" for r in range(world)] if rank == 0 else None
    mine, scatter_growth = _peak_growth(lambda: context.scatter(parts))
    shared = [big] * world if rank == 0 else None  # one object for every rank
    same, shared_growth = _peak_growth(lambda: context.scatter(shared))
    if rank == 0:
        assert gathered is not None and gathered[1] == big and gathered[2] == b"x"
    assert mine == (big if rank == 1 else b"y") and same == big
    return {"gather": gather_growth, "scatter": scatter_growth, "shared": shared_growth}


def test_the_coordinator_holds_what_is_sent_not_world_size_times_the_largest_part():
    world = 4
    coordinator = run_ranks(world, one_big_part)[0]
    # exact sizes: about one or two copies of the big part; padded: world x BIG and more
    growth = {what: round(coordinator[what] / BIG, 2) for what in ("gather", "scatter", "shared")}
    assert all(g < 2.6 for g in growth.values()), growth
