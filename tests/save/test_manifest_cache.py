"""Retention's manifest cache: parsed once per content, parsed and checked again once edited, and
filled by each commit with the manifest it wrote (retention after a save parses nothing)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import ckptd
from ckptd.catalog import ManifestCache, list_checkpoints
from ckptd.formats import manifest as manifest_module
from ckptd.formats.names import MANIFEST_NAME
from ckptd.retention import apply_retention
from ckptd.storage.local import LocalStorage


def _state(value: float) -> dict[str, Any]:
    return {"model": {"w": torch.full((4, 4), value)}}


def _count_parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    parsed: list[str] = []
    original = manifest_module.Manifest.from_json.__func__  # type: ignore[attr-defined]

    def counting(cls: type, data: bytes, where: str) -> Any:
        parsed.append(where)
        return original(cls, data, where)

    monkeypatch.setattr(manifest_module.Manifest, "from_json", classmethod(counting))
    return parsed


def _save_steps(root: str, steps: list[int]) -> None:
    with ckptd.Checkpointer(root) as ckpt:
        for step in steps:
            ckpt.save(step, _state(float(step)))


def test_unchanged_manifests_are_parsed_once(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    root = str(tmp_path)
    _save_steps(root, [1, 2, 3])
    parsed = _count_parses(monkeypatch)
    cache = ManifestCache()
    storage = LocalStorage()
    first = list_checkpoints(storage, root, cache)
    assert [info.step for info in first] == [1, 2, 3]
    assert len(parsed) == 3
    second = list_checkpoints(storage, root, cache)
    assert len(parsed) == 3  # nothing parsed again
    assert [info.manifest for info in second] == [info.manifest for info in first]
    list_checkpoints(storage, root)  # without a cache: parsed as before
    assert len(parsed) == 6


def test_an_edited_manifest_is_checked_again(tmp_path: Any) -> None:
    root = str(tmp_path)
    _save_steps(root, [1, 2, 3])
    cache = ManifestCache()
    storage = LocalStorage()
    assert [info.step for info in list_checkpoints(storage, root, cache)] == [1, 2, 3]
    where = os.path.join(root, "checkpoint-2", MANIFEST_NAME)
    with open(where, "rb") as f:
        data = f.read()
    # Same size, one byte changed inside the checksummed body: no longer a valid checkpoint.
    at = data.index(b'"world_size": 1') + len(b'"world_size": ')
    with open(where, "r+b") as f:
        f.seek(at)
        f.write(b"2")
    assert [info.step for info in list_checkpoints(storage, root, cache)] == [1, 3]
    # Retention with the same cache keeps the newest valid one and never counts the edited one.
    removed = apply_retention(storage, root, 1, cache=cache)
    assert removed == [os.path.join(root, "checkpoint-1")]
    assert [info.step for info in list_checkpoints(storage, root)] == [3]


def test_forgets_checkpoints_no_longer_listed(tmp_path: Any) -> None:
    root = str(tmp_path)
    with ckptd.Checkpointer(root, keep_last=2) as ckpt:
        for step in range(1, 6):
            ckpt.save(step, _state(float(step)))
        cached = set(ckpt._saver.listed._parsed)  # the Checkpointer's own retention cache
    assert cached == {os.path.join(root, f"checkpoint-{s}", MANIFEST_NAME) for s in (3, 4, 5)} or cached == {
        os.path.join(root, f"checkpoint-{s}", MANIFEST_NAME) for s in (4, 5)
    }
    assert [info.step for info in list_checkpoints(LocalStorage(), root)] == [4, 5]


def test_retention_after_each_commit_parses_no_manifest(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each commit leaves the manifest it wrote in the cache: the listing after it finds every
    # manifest there (a 30,000-tensor manifest took about 0.3 s to parse and check).
    root = str(tmp_path)
    parsed = _count_parses(monkeypatch)
    with ckptd.Checkpointer(root, keep_last=2) as ckpt:
        for step in range(1, 6):
            ckpt.save(step, _state(float(step)))
    assert parsed == []
    assert [info.step for info in list_checkpoints(LocalStorage(), root)] == [4, 5]
    assert len(parsed) == 2  # a listing without the cache parses as before


def test_a_managers_retention_uses_the_manifests_its_saves_committed(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = str(tmp_path)
    parsed = _count_parses(monkeypatch)
    policy = ckptd.CheckpointPolicy(keep_last=1, keep_best=1, metric="loss")
    with ckptd.CheckpointManager(root, policy) as manager:
        for step, loss in ((1, 0.5), (2, 0.9), (3, 0.7), (4, 0.8)):
            manager.save(step, _state(float(step)), metrics={"loss": loss}).result()
            manager.wait()
    assert parsed == []
    assert [info.step for info in list_checkpoints(LocalStorage(), root)] == [1, 4]  # best loss, newest


def test_the_remembered_manifest_is_the_one_parsing_the_file_gives(tmp_path: Any) -> None:
    root = str(tmp_path)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1].weight = model[0].weight  # tied
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    state = {"model": model, "optimizer": optimizer, "extra": {"epoch": 3, "seen": [1.5, None, "x"]}}
    with ckptd.Checkpointer(root, keep_last=3) as ckpt:
        ckpt.save(7, state, metadata={"run": "r1"}, metrics={"loss": 0.25, "tokens": 10**12})
        where = os.path.join(root, "checkpoint-7", MANIFEST_NAME)
        with open(where, "rb") as f:
            data = f.read()
        remembered = ckpt._saver.listed.get(where, data)
    assert remembered is not None
    assert remembered == manifest_module.Manifest.from_json(data, where)
