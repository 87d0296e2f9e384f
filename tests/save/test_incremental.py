"""Incremental saves: unchanged files are linked (or copied) from the previous checkpoint, never
rewritten, and every checkpoint holds all of its files.

Regression tests of the reliability review at 645fdbc (defects 2, 3, 7, 8, 13), each on real
saves, real files and real writer processes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from typing import Any

import pytest
import torch
from conftest import assert_same, paused

import ckptd
from ckptd.errors import MissingFileError, ReferencedCheckpointError
from ckptd.formats.checksum import crc32c
from ckptd.load.reader import CheckpointReader
from ckptd.storage.local import LocalStorage


class LoRAish(torch.nn.Module):
    """A frozen base (embedding + projection) and a small trainable adapter."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(512, 64)
        self.base = torch.nn.Linear(64, 64)
        self.adapter = torch.nn.Linear(64, 64)
        for p in [*self.embed.parameters(), *self.base.parameters()]:
            p.requires_grad_(False)


def manifest_of(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "checkpoint_manifest.json")) as f:
        return json.load(f)


def frozen_files(path: str) -> set[str]:
    return {n for n, f in manifest_of(path)["files"].items() if f.get("reused")}


def step_forward(model: LoRAish, amount: float = 1.0) -> None:
    with torch.no_grad():
        model.adapter.bias.add_(amount)


# ---- the layout: linked files, self-contained directories ---------------------------------


def test_frozen_files_are_hard_linked_and_the_manifest_references_nothing(root):
    torch.manual_seed(0)
    model = LoRAish()
    with ckptd.Checkpointer(root, incremental=True) as ckpt:
        first = ckpt.save(1, {"model": model})
        step_forward(model)
        second = ckpt.save(2, {"model": model})
        assert first.bytes_reused == first.bytes_linked == 0
        assert second.bytes_linked > 4 * second.bytes_written and second.bytes_copied == 0
        assert second.bytes_reused == second.bytes_linked
        files = manifest_of(second.path)["files"]
        assert all("checkpoint" not in f for f in files.values()), "no reference into another checkpoint"
        linked = frozen_files(second.path)
        assert linked and {files[n]["reused"] for n in linked} == {"link"}
        assert sum(files[n]["size"] for n in linked) == second.bytes_linked
        for name in linked:
            mine, theirs = os.stat(os.path.join(second.path, name)), os.stat(os.path.join(first.path, name))
            assert (mine.st_ino, mine.st_dev) == (theirs.st_ino, theirs.st_dev), "one inode: no byte written"
        assert_same(model.state_dict(), ckpt.load(2, verify=True)["model"])
        fresh = LoRAish()
        ckpt.load(2, into={"model": fresh})
        assert_same(model.state_dict(), fresh.state_dict())


def test_every_checkpoint_stands_alone_when_the_others_are_deleted_by_hand(root):
    torch.manual_seed(0)
    model = LoRAish()
    with ckptd.Checkpointer(root, incremental=True) as ckpt:
        for step in (1, 2, 3):
            step_forward(model)
            ckpt.save(step, {"model": model})
    shutil.rmtree(os.path.join(root, "checkpoint-1"))  # not through ckptd: a plain rm -rf
    shutil.rmtree(os.path.join(root, "checkpoint-2"))
    third = os.path.join(root, "checkpoint-3")
    assert_same(model.state_dict(), ckptd.load_checkpoint(third))
    reader = CheckpointReader.open(third)
    reader.verify()
    assert_same(model.state_dict(), reader.read("model"))
    safetensors = pytest.importorskip("safetensors.torch")
    shards = [n for n in os.listdir(third) if n.endswith(".safetensors")]
    loaded = {k: v for n in shards for k, v in safetensors.load_file(os.path.join(third, n)).items()}
    assert_same(model.state_dict(), loaded)


def test_from_pretrained_reads_the_newest_checkpoint_of_an_incremental_run(root):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_("ln_f" in name)  # train the final norm only
    with ckptd.Checkpointer(root, incremental=True, max_shard_size="40KB") as ckpt:
        for step in (1, 2, 3):
            with torch.no_grad():
                model.transformer.ln_f.bias.add_(0.5)
            result = ckpt.save(step, {"model": model})
        assert result.bytes_linked > result.bytes_written
    newest = os.path.join(root, "checkpoint-3")
    config.save_pretrained(newest)
    shutil.rmtree(os.path.join(root, "checkpoint-1"))
    loaded = transformers.GPT2LMHeadModel.from_pretrained(newest)
    assert_same(model.state_dict(), loaded.state_dict())


def test_linked_files_keep_their_bytes_when_another_checkpoint_rewrites_the_same_name(root):
    """Files are hard links shared between checkpoints: a write to one name must replace it with
    a new file, never truncate the shared inode (remove the unlink-before-create and the older
    checkpoint changes)."""
    torch.manual_seed(0)
    model = LoRAish()
    with ckptd.Checkpointer(root, incremental=True) as ckpt:
        ckpt.save(1, {"model": model})
        step_forward(model)
        second = ckpt.save(2, {"model": model})
    name = sorted(frozen_files(second.path))[0]
    target = os.path.join(second.path, name)
    before = open(os.path.join(root, "checkpoint-1", name), "rb").read()
    storage = LocalStorage()
    garbage = memoryview(bytearray(b"x" * 4096))
    storage.write_view(target, garbage, fsync=True, chunk_size=4096, should_stop=lambda: False, on_progress=id)
    storage.write_bytes(target, b"y" * 10)
    assert open(os.path.join(root, "checkpoint-1", name), "rb").read() == before
    with ckptd.Checkpointer(root) as ckpt:
        ckpt.load(1, verify=True)


def test_copy_file_copies_across_devices_and_never_follows_a_symlink(tmp_path):
    shm = "/dev/shm"
    if not os.path.isdir(shm) or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the test's directory")
    storage = LocalStorage()
    source = tmp_path / "shard.safetensors"
    payload = os.urandom(3 * 1024 * 1024 + 17)
    source.write_bytes(payload)
    target = os.path.join(shm, f"ckptd-test-copy-{os.getpid()}")
    try:
        assert storage.copy_file(str(source), target) == "copy", "EXDEV: copied, not linked"
        assert open(target, "rb").read() == payload
        assert os.stat(target).st_ino != os.stat(source).st_ino
    finally:
        storage.remove(target)
    assert storage.copy_file(str(source), str(tmp_path / "same-device")) == "link"
    (tmp_path / "evil").symlink_to("/etc/passwd")
    with pytest.raises(ckptd.errors.StorageError):
        storage._copy(str(tmp_path / "evil"), str(tmp_path / "stolen"), fsync=False)
    assert not (tmp_path / "stolen").exists()
    with pytest.raises(MissingFileError, match="missing-source"):
        storage.copy_file(str(tmp_path / "missing-source"), str(tmp_path / "x"))


# ---- retention: defects 2, 3 and 7 --------------------------------------------------------


def test_keep_last_one_in_a_loop_of_async_saves_always_leaves_a_loadable_checkpoint(root):
    """Defect 2: retention ran before the commit was remembered, so a save planned in that window
    took files from the checkpoint being deleted; every save succeeded and none loaded."""
    torch.manual_seed(0)
    model = LoRAish()
    requests = []
    with ckptd.Checkpointer(root, incremental=True, keep_last=1, max_in_flight=2) as ckpt:
        for step in range(1, 31):
            step_forward(model)
            requests.append(ckpt.async_save(step, {"model": model}))
        results = [r.result(120) for r in requests]
        assert ckpt.steps() == [30]
        assert sum(r.bytes_linked for r in results) > 0, "the run did take files from earlier saves"
        assert_same(model.state_dict(), ckpt.load(30, verify=True)["model"])
    assert sorted(os.listdir(root)) == ["checkpoint-30"]


def test_keep_last_three_keeps_exactly_three_self_contained_directories(root):
    """Before 0.2.0, ``keep_last=3`` with ``incremental=True`` kept a fourth directory that a kept
    one referenced.  Now exactly three remain, each loads on its own after the others are gone,
    and the frozen files are shared by hard links (no extra space)."""
    torch.manual_seed(0)
    model = LoRAish()
    with ckptd.Checkpointer(root, incremental=True, keep_last=3) as ckpt:
        for step in range(1, 7):
            step_forward(model)
            ckpt.save(step, {"model": model})
        assert ckpt.steps() == [4, 5, 6]
    assert sorted(os.listdir(root)) == ["checkpoint-4", "checkpoint-5", "checkpoint-6"]
    newest = os.path.join(root, "checkpoint-6")
    linked = frozen_files(newest)
    assert linked, "the frozen base was reused"
    for name in linked:
        inodes = {os.stat(os.path.join(root, f"checkpoint-{s}", name)).st_ino for s in (4, 5, 6)}
        assert len(inodes) == 1, f"{name} is one file on disk, linked into each checkpoint"
    shutil.rmtree(os.path.join(root, "checkpoint-4"))
    shutil.rmtree(os.path.join(root, "checkpoint-5"))
    with ckptd.Checkpointer(root) as ckpt:
        assert_same(model.state_dict(), ckpt.load(6, verify=True)["model"])


def gate_type(name: str) -> type:
    """A tensor type whose copy waits on its own gate: it holds one background staging open."""
    gate = threading.Event()

    def torch_function(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_ and any(isinstance(a, cls) for a in args[1:2]):
            if not gate.wait(30):
                raise RuntimeError("gate never opened")
        return super(cls, cls).__torch_function__(func, types, args, kwargs or {})

    return type(name, (torch.Tensor,), {"gate": gate, "__torch_function__": classmethod(torch_function)})


def test_retention_keeps_the_checkpoint_a_queued_save_links_from_until_it_is_done(root):
    torch.manual_seed(0)
    model = LoRAish()
    first_gate, second_gate = gate_type("First"), gate_type("Second")
    with ckptd.Checkpointer(root, incremental=True, keep_last=1, max_in_flight=2, staging="background") as ckpt:
        one = ckpt.async_save(100, {"model": model, "hold": {"x": torch.ones(4).as_subclass(first_gate)}})
        two = ckpt.async_save(200, {"model": model, "hold": {"x": torch.ones(4).as_subclass(second_gate)}})
        first_gate.gate.set()
        one.wait(60)
        three = ckpt.async_save(300, {"model": model})  # planned after 100 committed: links its files
        second_gate.gate.set()  # 200 (which takes nothing) commits while 300 is queued: retention runs
        two.wait(60)
        assert 100 in ckpt.steps(), "the queued save 300 still links files from 100"
        assert three.wait(60).bytes_linked > 0
        assert ckpt.steps() == [300], "once 300 is committed, it holds its files: 100 and 200 go"
        assert_same(model.state_dict(), ckpt.load(300, verify=True)["model"])


def test_manager_retention_keeps_what_queued_saves_link_from(root):
    """Defect 3: the CheckpointManager's retention ignored the checkpoints queued saves took
    files from (saves 2 and 3 queued behind a stopped writer; 3 links from 1)."""
    torch.manual_seed(0)
    model = LoRAish()
    policy = ckptd.CheckpointPolicy(keep_last=1)
    with ckptd.CheckpointManager(root, policy, incremental=True, max_in_flight=2) as manager:
        manager.save(1, {"model": model}).result(60)
        pid = manager.checkpointer.health_check()["writer_pid"]
        with paused(pid):
            step_forward(model)
            two = manager.save(2, {"model": model})
            step_forward(model)
            three = manager.save(3, {"model": model})  # planned while 2 is queued: links from 1
        assert two.result(60).bytes_written > 0
        assert three.result(60).bytes_linked > 0
        manager.wait(60)
        assert manager.steps() == [3]
        assert_same(model.state_dict(), manager.load(3, verify=True)["model"])


def seeded_root(root: str, steps: tuple[int, ...]) -> dict[int, dict[str, torch.Tensor]]:
    states = {}
    with ckptd.Checkpointer(root) as ckpt:
        for step in steps:
            states[step] = {"w": torch.full((8,), float(step))}
            ckpt.save(step, {"model": states[step]})
    return states


def test_a_rollback_keeps_this_runs_saves_and_says_what_it_deleted(root, caplog):
    """Defect 7: after resuming from 50 under a root holding 100, keep_last=1 deleted the
    run's own 60 and 70 (by step, 100 was the newest)."""
    seeded_root(root, (50, 100))
    policy = ckptd.CheckpointPolicy(keep_last=1)
    with caplog.at_level(logging.WARNING, logger="ckptd"), ckptd.CheckpointManager(root, policy) as manager:
        resumed = manager.load(50)["model"]
        for step in (60, 70):
            resumed["w"].add_(1)
            manager.save(step, {"model": resumed}).result(60)
            manager.wait(60)
        assert manager.steps() == [70]
        assert_same(resumed, manager.load(70, verify=True)["model"])
    assert any("100" in r.getMessage() and "earlier step" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("keep", [1, 2])
def test_checkpointer_keep_last_orders_by_this_runs_timeline(root, keep):
    seeded_root(root, (50, 100))
    with ckptd.Checkpointer(root, keep_last=keep) as ckpt:
        for step in (60, 70):
            ckpt.save(step, {"model": {"w": torch.full((8,), float(step))}})
        assert ckpt.steps() == [60, 70][-keep:]


def test_a_manager_refuses_a_checkpointer_that_has_its_own_retention(root):
    with ckptd.Checkpointer(root, keep_last=2) as ckpt:
        with pytest.raises(ckptd.errors.ConfigError, match="keep_last"):
            ckptd.CheckpointManager(checkpointer=ckpt)


# ---- path= saves: defect 8 ----------------------------------------------------------------


def test_a_save_to_a_chosen_path_then_to_the_root_links_from_that_path(root, tmp_path):
    torch.manual_seed(0)
    model = LoRAish()
    best = os.path.join(root, "best-model")
    with ckptd.Checkpointer(root, incremental=True) as ckpt:
        ckpt.save(1, {"model": model}, path=best)
        step_forward(model)
        second = ckpt.save(2, {"model": model})
        assert second.bytes_linked > 0
        elsewhere = os.path.join(os.path.dirname(root), "elsewhere", "checkpoint-7")
        ckpt.save(7, {"model": model}, path=elsewhere)
        step_forward(model)
        eighth = ckpt.save(8, {"model": model})
        assert eighth.bytes_linked > 0 and not os.path.exists(os.path.join(root, "checkpoint-7"))
    shutil.rmtree(best)
    shutil.rmtree(elsewhere)
    with ckptd.Checkpointer(root) as ckpt:
        ckpt.load(2, verify=True)
        assert_same(model.state_dict(), ckpt.load(8, verify=True)["model"])


# ---- hash mode: defect 13 -----------------------------------------------------------------


def forge_crc(data: bytearray, position: int, target: int) -> None:
    """Set the 4 bytes at ``position`` so that CRC32C(data) == ``target`` (CRC32C is affine over
    GF(2) in those bits: solve the 32x32 system by Gaussian elimination)."""
    data[position : position + 4] = b"\0\0\0\0"
    base = crc32c(bytes(data))
    columns = []
    for bit in range(32):
        trial = bytearray(data)
        trial[position + bit // 8] ^= 1 << (bit % 8)
        columns.append(crc32c(bytes(trial)) ^ base)
    want = base ^ target
    rows = [(columns[bit], 1 << bit) for bit in range(32)]  # (effect on the CRC, bits flipped)
    basis: dict[int, tuple[int, int]] = {}
    for effect, flips in rows:
        for pivot in sorted(basis, reverse=True):
            if effect >> pivot & 1:
                effect ^= basis[pivot][0]
                flips ^= basis[pivot][1]
        if effect:
            basis[effect.bit_length() - 1] = (effect, flips)
    solution = 0
    for pivot in sorted(basis, reverse=True):
        if want >> pivot & 1:
            want ^= basis[pivot][0]
            solution ^= basis[pivot][1]
    assert want == 0, "the 4 bytes span every CRC value"
    data[position : position + 4] = solution.to_bytes(4, "little")


def test_hash_mode_compares_a_strong_digest_not_the_crc(root):
    """Defect 13: an edit crafted to keep the shard's CRC32C was taken as unchanged and the old
    tensor loaded.  The edit here changes the first value and fixes the CRC in the last one."""
    values = torch.arange(1024, dtype=torch.float32)
    with ckptd.Checkpointer(root, incremental="hash", max_shard_size="1MB") as ckpt:
        first = ckpt.save(1, {"model": {"table": values}})
        shard = next(n for n in os.listdir(first.path) if n.startswith("model-"))
        old = open(os.path.join(first.path, shard), "rb").read()
        data = bytearray(old)
        header = 8 + int.from_bytes(old[:8], "little")
        data[header : header + 4] = torch.tensor([-7.5]).numpy().tobytes()
        forge_crc(data, len(data) - 4, crc32c(old))
        assert crc32c(bytes(data)) == crc32c(old) and bytes(data) != old
        crafted = torch.frombuffer(bytearray(data[header:]), dtype=torch.float32).clone()
        second = ckpt.save(2, {"model": {"table": crafted}})
        assert second.bytes_linked == 0 and second.bytes_written > 0
        loaded = ckpt.load(2, verify=True)["model"]["table"]
        assert_same(crafted, loaded)
        assert loaded[0].item() == -7.5
        third = ckpt.save(3, {"model": {"table": crafted}})  # unchanged for real: linked
        assert third.bytes_linked > 0 and manifest_of(third.path)["files"][shard]["reused"] == "link"
        digest = manifest_of(third.path)["files"][shard]["digest"]
        assert digest.startswith("sha256:") and digest == manifest_of(second.path)["files"][shard]["digest"]
        assert_same(crafted, ckpt.load(3, verify=True)["model"]["table"])


# ---- a source deleted from under a queued save ---------------------------------------------


def test_a_source_deleted_by_another_process_fails_the_save_cleanly_and_the_next_one_writes(root):
    torch.manual_seed(0)
    model = LoRAish()
    with ckptd.Checkpointer(root, incremental=True) as ckpt:
        ckpt.save(1, {"model": model})
        pid = ckpt.health_check()["writer_pid"]
        with paused(pid):
            step_forward(model)
            queued = ckpt.async_save(2, {"model": model})
            shutil.rmtree(os.path.join(root, "checkpoint-1"))  # e.g. `ckptd rm` from a shell
        with pytest.raises(MissingFileError, match="checkpoint-1"):
            queued.result(60)
        assert ckpt.steps() == [] and not [n for n in os.listdir(root) if n.startswith(".")]
        third = ckpt.save(3, {"model": model})
        assert third.bytes_linked == 0, "the vanished checkpoint is no longer a source"
        assert_same(model.state_dict(), ckpt.load(3, verify=True)["model"])


# ---- checkpoints of older versions, which reference others ---------------------------------


def test_older_versions_referencing_checkpoints_still_load_and_their_holders_are_kept(legacy_root):
    with ckptd.Checkpointer(legacy_root, keep_last=2) as ckpt:
        third = ckpt.load(3, verify=True)["model"]
        assert torch.equal(third["adapter.bias"], torch.full((4,), 3.0))
        assert torch.equal(third["base.weight"], ckpt.load(1)["model"]["base.weight"])
        ckpt.save(4, {"model": third})
        assert ckpt.steps() == [1, 3, 4], "3 (kept) references 1's files; 2 goes"
        with pytest.raises(ReferencedCheckpointError, match="checkpoint-3"):
            ckpt.save(1, {"model": third}, overwrite=True)
        ckpt.load(3, verify=True)


def test_retention_deletes_older_versions_referrers_before_their_holders(legacy_root):
    with ckptd.Checkpointer(legacy_root, keep_last=1) as ckpt:
        removed: list[str] = []
        original = ckptd.retention.remove_checkpoint

        def recording(storage: Any, path: str) -> None:
            removed.append(os.path.basename(path))
            original(storage, path)

        ckptd.retention.remove_checkpoint = recording
        try:
            ckpt.save(4, {"model": {"w": torch.ones(2)}})
        finally:
            ckptd.retention.remove_checkpoint = original
        assert removed == ["checkpoint-3", "checkpoint-2", "checkpoint-1"]
        assert ckpt.steps() == [4]


# ---- object stores: server-side copies ------------------------------------------------------


@pytest.mark.objectstore
def test_an_incremental_save_on_s3_copies_frozen_files_server_side(s3, proxy):
    """The frozen shard of step 2 is a CopyObject: no byte of it is uploaded again, and step 2
    loads after step 1's objects are all gone."""
    torch.manual_seed(0)
    model = LoRAish()
    options = s3.options(proxy.url)
    with ckptd.Checkpointer(s3.url(), storage_options=options, incremental=True, keep_last=1) as ckpt:
        ckpt.save(1, {"model": model})
        step_forward(model)
        before = len(proxy.exchanges)
        second = ckpt.save(2, {"model": model})
        assert second.bytes_copied > 4 * second.bytes_written and second.bytes_linked == 0
        files = ckpt.manifest(2).files
        copied = [n for n, f in files.items() if f.reused == "server_copy"]
        assert copied and all(f.checkpoint is None for f in files.values())
        for name in copied:
            puts = [e for e in proxy.exchanges[before:] if e.method == "PUT" and e.path.endswith(name)]
            assert puts and all("x-amz-copy-source" in e.request_headers for e in puts), name
            assert sum(e.request_bytes for e in puts) < 1024, "the bytes stayed on the server"
        assert ckpt.steps() == [2]
        assert not s3.keys("run/checkpoint-1/")
        assert_same(model.state_dict(), ckpt.load(2, verify=True)["model"])


def test_an_incremental_save_in_memory_copies_frozen_files():
    torch.manual_seed(0)
    model = LoRAish()
    with ckptd.Checkpointer("memory://ckptd-incremental/run", incremental=True, keep_last=1) as ckpt:
        ckpt.save(1, {"model": model})
        step_forward(model)
        second = ckpt.save(2, {"model": model})
        assert second.bytes_copied > 0 and ckpt.steps() == [2]
        assert_same(model.state_dict(), ckpt.load(2, verify=True)["model"])
