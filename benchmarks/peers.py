"""The libraries ``bench_peers.py`` measures, each behind one small adapter.

Every adapter saves the same training state (``{"model": {...}, "optimizer": {...}}`` of CPU
tensors) the way that library's documentation says to save asynchronously, and loads it back into
the live tensors.  ``save(step)`` returns when the library lets the caller change the tensors
again (the *blocking* time) with a :class:`Pending` that completes when the library says the
checkpoint is written (the *committed* time).  A library that cannot run here raises
:class:`PeerUnavailable` from :meth:`Peer.open` with the reason, which becomes the peer's row.

The peers' install notes (``pip install ckptd[peers]`` and what it cannot pin) are in
``docs/benchmarks.md``, "Peers side by side".
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from bench_save import State, iter_tensors


class PeerUnavailable(Exception):
    """This library cannot run on this machine; the message says why."""


@dataclass(frozen=True)
class Pending:
    """A save under way: ``done()`` polls, ``wait()`` blocks until the library says it is written
    (and raises what the save raised)."""

    done: Callable[[], bool]
    wait: Callable[[], Any]


FINISHED = Pending(done=lambda: True, wait=lambda: None)
"""The pending save of a library whose save returns once it is written."""


def future_pending(future: Any) -> Pending:
    """A ``concurrent.futures.Future`` (or anything with ``done()`` and ``result()``)."""
    return Pending(done=future.done, wait=future.result)


def flat(state: State) -> dict[str, torch.Tensor]:
    """``{"component.key": tensor}``: the flat form safetensors and ByteCheckpoint take here."""
    return dict(iter_tensors(state))


def files_under(path: str) -> Iterator[str]:
    """Every regular file under ``path`` (a file or a directory)."""
    if os.path.isfile(path):
        yield path
        return
    for directory, _, names in os.walk(path):
        for name in names:
            yield os.path.join(directory, name)


class Peer:
    """One library.  ``open`` builds what a training job builds once (untimed in warm saves; the
    first-save measurement times it), ``save``/``load_into`` one checkpoint, ``remove`` deletes it."""

    name = ""
    note = ""
    modules: tuple[str, ...] = ()  # imported before any timing: a process's import cost is not a save's

    def __init__(self, state: State, directory: str) -> None:
        self.state = state
        self.directory = directory

    def path(self, step: int) -> str:
        return os.path.join(self.directory, f"step-{step}")

    def environment(self) -> None:
        """What the job has before any checkpointing (a process group): untimed everywhere."""

    def open(self) -> None:
        """Build the library's saver; raise :class:`PeerUnavailable` if it cannot run here."""

    def save(self, step: int) -> Pending:
        raise NotImplementedError

    def load_into(self, step: int) -> None:
        raise NotImplementedError

    def remove(self, step: int) -> None:
        shutil.rmtree(self.path(step), ignore_errors=True)

    def close(self) -> None:
        """Stop what ``open`` started (threads, processes, process groups)."""


def import_modules(peer: type[Peer]) -> None:
    """Import the peer's modules, or raise :class:`PeerUnavailable` naming the missing one."""
    import importlib

    for module in peer.modules:
        try:
            importlib.import_module(module)
        except Exception as e:
            raise PeerUnavailable(f"import {module} failed: {type(e).__name__}: {e}") from e


# ---- ckptd -----------------------------------------------------------------------------------


class CkptdPeer(Peer):
    name = "ckptd"
    note = "Checkpointer(root).async_save(step, state): shared-memory arena, writer process, O_DIRECT + fsync"
    modules = ("ckptd",)

    def open(self) -> None:
        import ckptd

        self.checkpointer = ckptd.Checkpointer(self.directory)

    def path(self, step: int) -> str:
        return self.checkpointer.path_for(step)

    def save(self, step: int) -> Pending:
        return future_pending(self.checkpointer.async_save(step, self.state))

    def load_into(self, step: int) -> None:
        self.checkpointer.load(step, into=self.state)

    def close(self) -> None:
        if hasattr(self, "checkpointer"):
            self.checkpointer.close()

    def writer_pids(self) -> list[int]:
        pid = self.checkpointer.writer_pid
        return [pid] if pid else []


# ---- torch.distributed.checkpoint ------------------------------------------------------------


class DcpPeer(Peer):
    """``dcp.async_save`` in thread or process mode, with a new or a reused ``DefaultStager``."""

    modules = ("torch.distributed.checkpoint",)
    mode = "THREAD"
    reused_stager = False

    def environment(self) -> None:
        from bench_save import init_single_rank_group

        self.created_group = init_single_rank_group()

    def open(self) -> None:
        self.stager: Any = None
        if self.reused_stager:
            from bench_save import dcp_staging_options
            from torch.distributed.checkpoint.staging import DefaultStager

            self.stager = DefaultStager(dcp_staging_options())

    def save(self, step: int) -> Pending:
        import torch.distributed.checkpoint as dcp
        from bench_save import dcp_upload_future
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        extra = {"async_stager": self.stager} if self.stager is not None else {}
        response = dcp.async_save(
            self.state,
            checkpoint_id=self.path(step),
            async_checkpointer_type=AsyncCheckpointerType[self.mode],
            no_dist=True,
            **extra,
        )
        staging = getattr(response, "staging_completion", None)
        if staging is not None:  # an asynchronous stager: the state may change once it is done
            staging.result()
        return future_pending(dcp_upload_future(response))

    def load_into(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.load(self.state, checkpoint_id=self.path(step), no_dist=True)

    def close(self) -> None:
        import torch.distributed as dist
        from bench_save import stop_dcp_process

        if getattr(self, "stager", None) is not None:
            self.stager.close()
        stop_dcp_process()
        if getattr(self, "created_group", False):
            dist.destroy_process_group()


class DcpThreadPeer(DcpPeer):
    name = "DCP thread"
    note = "dcp.async_save(async_checkpointer_type=THREAD), default stager, no_dist=True, 1-rank gloo group"


class DcpProcessPeer(DcpPeer):
    name = "DCP process"
    note = "dcp.async_save(async_checkpointer_type=PROCESS), default stager (a new one per save)"
    mode = "PROCESS"


class DcpProcessStagerPeer(DcpPeer):
    name = "DCP process + stager"
    note = "dcp.async_save(PROCESS, async_stager=DefaultStager(shared memory, sync copy)) reused across saves"
    mode = "PROCESS"
    reused_stager = True


# ---- torch.save and safetensors ----------------------------------------------------------------


class TorchSaveThreadPeer(Peer):
    """``torch.save`` of a ``clone()`` of the state on a thread: the do-it-yourself async save."""

    name = "torch.save thread"
    note = "clone() every tensor, then torch.save(clones, path) on a thread (no fsync)"

    def open(self) -> None:
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="torch-save")

    def path(self, step: int) -> str:
        return os.path.join(self.directory, f"step-{step}.pt")

    def save(self, step: int) -> Pending:
        os.makedirs(self.directory, exist_ok=True)
        clones = {c: {k: t.clone() for k, t in tensors.items()} for c, tensors in self.state.items()}
        return future_pending(self.executor.submit(torch.save, clones, self.path(step)))

    def load_into(self, step: int) -> None:
        loaded = torch.load(self.path(step), weights_only=True, mmap=True)
        for component, tensors in self.state.items():
            for key, tensor in tensors.items():
                tensor.copy_(loaded[component][key])

    def remove(self, step: int) -> None:
        if os.path.exists(self.path(step)):
            os.remove(self.path(step))

    def close(self) -> None:
        self.executor.shutdown(wait=True)


class SafetensorsPeer(Peer):
    """``safetensors.torch.save_file`` of the flat state: synchronous, what HF tools read."""

    name = "safetensors save_file"
    note = "safetensors.torch.save_file(flat state) in the step loop (synchronous, no fsync)"
    modules = ("safetensors.torch",)

    def path(self, step: int) -> str:
        return os.path.join(self.directory, f"step-{step}.safetensors")

    def save(self, step: int) -> Pending:
        from safetensors.torch import save_file

        os.makedirs(self.directory, exist_ok=True)
        save_file(flat(self.state), self.path(step))
        return FINISHED

    def load_into(self, step: int) -> None:
        from safetensors import safe_open

        live = flat(self.state)
        with safe_open(self.path(step), framework="pt") as f:
            for key in f.keys():
                live[key].copy_(f.get_tensor(key))

    def remove(self, step: int) -> None:
        if os.path.exists(self.path(step)):
            os.remove(self.path(step))


# ---- torch_checkpointing, torchsnapshot, ByteCheckpoint --------------------------------------


class TorchCheckpointingPeer(Peer):
    """meta-pytorch's ``torch_checkpointing``: ``CheckpointManager.save`` returns at once and
    stages on a thread; in-place updates must run under ``manager.lock()``, which waits for the
    copy (the save holds the lock's write side from the call until the copy ends)."""

    name = "torch_checkpointing"
    note = (
        "CheckpointManager(LocalFileSystemStorageConfig(use_direct_io=False)).save(path, state), then "
        "`with manager.lock()` before changing tensors; writer subprocess; O_DIRECT (its default) fails "
        "with EINVAL on this ext4 disk"
    )
    modules = ("torch_checkpointing",)

    def open(self) -> None:
        import torch_checkpointing
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        config = torch_checkpointing.CheckpointManager.Config(
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False)
        )
        self.manager = torch_checkpointing.CheckpointManager(config)

    def save(self, step: int) -> Pending:
        future = self.manager.save(self.path(step), self.state)
        with self.manager.lock():  # returns once the copy ended: tensors may change from here on
            pass
        return future_pending(future)

    def load_into(self, step: int) -> None:
        self.manager.load(self.path(step), into=self.state)

    def close(self) -> None:
        if hasattr(self, "manager"):
            self.manager.close()


class TorchSnapshotPeer(Peer):
    """torchsnapshot ``Snapshot.async_take``: returns once the state is staged, writes on threads."""

    name = "torchsnapshot"
    note = "Snapshot.async_take(path, {component: StateDict(tensors)}).wait(); restore() in place (no fsync)"
    modules = ("torchsnapshot",)

    def app_state(self) -> dict[str, Any]:
        from torchsnapshot import StateDict

        return {component: StateDict(tensors) for component, tensors in self.state.items()}

    def save(self, step: int) -> Pending:
        from torchsnapshot import Snapshot

        pending = Snapshot.async_take(path=self.path(step), app_state=self.app_state())
        return Pending(done=pending.done, wait=pending.wait)

    def load_into(self, step: int) -> None:
        from torchsnapshot import Snapshot

        Snapshot(self.path(step)).restore(app_state=self.app_state())


class _StatefulTensors:
    """The ``state_dict()``/``load_state_dict()`` object ByteCheckpoint saves (it loads in place
    into the tensors ``state_dict()`` returned; any it hands back instead are copied)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.tensors

    def load_state_dict(self, loaded: dict[str, torch.Tensor]) -> None:
        for key, value in loaded.items():
            if value is not self.tensors[key]:
                self.tensors[key].copy_(value)


class ByteCheckpointPeer(Peer):
    """ByteCheckpoint ``bytecheckpoint.save(..., fast_saving=True, callback=...)``.  Its
    ``framework="ddp"`` path writes and fsyncs the data before ``save`` returns (its plan cache
    misses on every call, and the miss path writes synchronously): "committed" is its callback."""

    name = "ByteCheckpoint"
    note = (
        'bytecheckpoint.save(path, {"model": state_dict() object}, framework="ddp", fast_saving=True, '
        "global_steps=step, callback=...); a gRPC server process; 1-rank gloo group"
    )
    modules = ("bytecheckpoint",)

    def environment(self) -> None:
        from bench_save import init_single_rank_group

        self.created_group = init_single_rank_group()

    def save(self, step: int) -> Pending:
        import bytecheckpoint

        done = threading.Event()
        bytecheckpoint.save(
            self.path(step),
            {"model": _StatefulTensors(flat(self.state))},
            framework="ddp",
            fast_saving=True,
            global_steps=step,
            callback=done.set,
        )

        def wait() -> None:
            if not done.wait(1200):
                raise TimeoutError("ByteCheckpoint's completion callback never came")

        return Pending(done=done.is_set, wait=wait)

    def load_into(self, step: int) -> None:
        import bytecheckpoint

        where = os.path.join(self.path(step), f"global_step_{step}")
        bytecheckpoint.load(where, {"model": _StatefulTensors(flat(self.state))}, framework="ddp")

    def close(self) -> None:
        import torch.distributed as dist

        if getattr(self, "created_group", False):
            dist.destroy_process_group()


PEERS: dict[str, type[Peer]] = {
    peer.name: peer
    for peer in (
        CkptdPeer,
        DcpThreadPeer,
        DcpProcessPeer,
        DcpProcessStagerPeer,
        TorchCheckpointingPeer,
        TorchSnapshotPeer,
        ByteCheckpointPeer,
        TorchSaveThreadPeer,
        SafetensorsPeer,
    )
}
