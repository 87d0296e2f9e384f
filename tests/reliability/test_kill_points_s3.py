"""Kill points on an object store (the loopback S3 server): SIGKILL at chosen HTTP requests of a
save, then check that only committed steps are visible and whole, that garbage collection
leaves no uncommitted object or multipart upload, and that the step can be saved again.

Two points only: a save on the loopback server takes seconds, and the local suite covers the
commit logic; these prove the object-store commit point (the manifest) and its clean-up.
"""

from __future__ import annotations

from typing import Any

import pytest
from crashsim import run, stop_zygote
from scenario import state_for

import ckptd
from ckptd.catalog import read_manifest
from ckptd.garbage import collect_garbage
from ckptd.load.reader import CheckpointReader
from ckptd.storage import storage_for

pytestmark = [pytest.mark.slow, pytest.mark.objectstore]

PREFIX = "run"


@pytest.fixture(scope="module", autouse=True)
def _forking_server() -> Any:
    yield
    stop_zygote()


POINTS = [
    ("s3/shard-upload", r"http|^PUT /[^ ]*/checkpoint-2/model-00001|1|after", set()),
    ("s3/manifest-upload", r"http|^PUT /[^ ]*/checkpoint-2/checkpoint_manifest|1|before", set()),
]


@pytest.mark.parametrize(("kill", "also"), [p[1:] for p in POINTS], ids=[p[0] for p in POINTS])
def test_kill_point_s3(kill: str, also: set[int], s3: Any) -> None:
    pytest.importorskip("s3fs")
    root, options = s3.url(PREFIX), s3.options()
    with ckptd.Checkpointer(root, storage_options=options, max_shard_size="4KB") as ckpt:
        ckpt.save(1, state_for(1))
    run("save", {"root": root, "steps": [2], "storage_options": options}, kill=kill)
    storage = storage_for(root, options)
    collect_garbage(storage, root, older_than=0)  # the crashed save's claim is stale at once
    with ckptd.Checkpointer(root, storage_options=options, max_shard_size="4KB") as ckpt:
        assert set(ckpt.steps()) == {1} | also
        for step in ckpt.steps():
            reader = CheckpointReader.open(ckpt.path_for(step), options)
            reader.verify()
            got = reader.read("model")
            for key, tensor in state_for(step)["model"].items():
                assert got[key].dtype == tensor.dtype and got[key].shape == tensor.shape, key
                assert ckptd_equal(got[key], tensor), f"step {step}: {key}"
        prefixes = {key.split("/")[1] for key in s3.keys(PREFIX + "/")}
        uncommitted = [p for p in prefixes if read_manifest(storage, f"{root}/{p}") is None]
        assert not uncommitted, f"left after garbage collection: {uncommitted} ({s3.keys(PREFIX + '/')})"
        assert s3.uploads() == [], "multipart uploads left open"
        ckpt.save(2, state_for(2, 7), overwrite=2 in ckpt.steps())
        reader = CheckpointReader.open(ckpt.path_for(2), options)
        reader.verify()
        assert ckptd_equal(reader.read("model")["w"], state_for(2, 7)["model"]["w"])


def ckptd_equal(a: Any, b: Any) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
