"""Where replicas go (``ckptd.replicas.topology``) and what a received checkpoint's listing must
be (``ckptd.replicas.transfer``): plain functions, no process group."""

from __future__ import annotations

import pytest

from ckptd.errors import ConfigError
from ckptd.formats.manifest import FileRecord, Manifest
from ckptd.replicas.topology import replica_holders, wards
from ckptd.replicas.transfer import _check_listing


def test_each_replica_goes_to_the_same_position_on_the_next_node():
    nodes = ["a", "a", "b", "b"]
    assert replica_holders(nodes, 1) == [[2], [3], [0], [1]]
    assert [wards(replica_holders(nodes, 1), rank, 0) for rank in range(4)] == [[2], [3], [0], [1]]


def test_two_replicas_land_on_two_other_nodes_and_every_rank_holds_two():
    nodes = ["a", "b", "c", "a", "b", "c"]  # ranks interleaved across nodes
    holders = replica_holders(nodes, 2)
    for rank, row in enumerate(holders):
        places = {nodes[rank], *(nodes[h] for h in row)}
        assert len(places) == 3, f"rank {rank}: replicas on {row}, not on three distinct nodes"
    held = [sum(rank in row for row in holders) for rank in range(6)]
    assert held == [2] * 6


def test_uneven_nodes_wrap_positions_and_never_place_a_replica_on_its_own_node():
    nodes = ["a", "a", "a", "b"]
    holders = replica_holders(nodes, 1)
    assert holders == [[3], [3], [3], [0]]
    assert wards(holders, 3, 0) == [0, 1, 2]
    assert all(nodes[row[0]] != nodes[rank] for rank, row in enumerate(holders))


@pytest.mark.parametrize(("nodes", "replicas"), [(["a", "a"], 1), (["a", "b"], 2)])
def test_too_few_nodes_for_the_replicas_is_refused(nodes, replicas):
    with pytest.raises(ConfigError, match=f"at least {replicas + 1} nodes"):
        replica_holders(nodes, replicas)


def test_no_replicas_needs_no_other_node():
    assert replica_holders(["a", "a"], 0) == [[], []]


def _manifest(names: dict[str, int], checkpoint: str | None = None) -> Manifest:
    files = {name: FileRecord(size=size, crc32c="00000000", checkpoint=checkpoint) for name, size in names.items()}
    return Manifest(step=1, created_utc="", world_size=1, library_version="0", components={}, files=files)


def test_a_listing_that_is_the_manifest_s_is_accepted():
    assert (
        _check_listing(_manifest({"a.safetensors": 3, "state.json": 2}), [["a.safetensors", 3], ["state.json", 2]])
        is None
    )


@pytest.mark.parametrize(
    ("names", "sent", "why"),
    [
        ({"a": 3}, [["a", 4]], "not the manifest's"),
        ({"a": 3}, [["a", 3], ["b", 1]], "not the manifest's"),
        ({"../escape": 3}, [["../escape", 3]], "not a path inside"),
        ({"/etc/passwd": 3}, [["/etc/passwd", 3]], "not a path inside"),
    ],
)
def test_a_listing_off_the_manifest_or_outside_the_checkpoint_is_refused(names, sent, why):
    assert why in (_check_listing(_manifest(names), sent) or "")


def test_a_file_of_another_checkpoint_is_refused():
    problem = _check_listing(_manifest({"a": 3}, checkpoint="checkpoint-1"), [["a", 3]])
    assert problem is not None and "not self-contained" in problem
