"""The helper processes (writer, keeper) import this ckptd, never a ``ckptd`` package that sits
in the trainer's current directory: ``python -m`` would put that directory first on their path.

Real processes: a Checkpointer saving to a local root and to a held root from a directory that
holds a planted ``ckptd`` package, which would leave a mark and refuse to import."""

from __future__ import annotations

import os

import torch
from conftest import assert_same

import ckptd


def test_a_ckptd_package_in_the_current_directory_is_not_what_the_writer_and_the_keeper_run(tmp_path, monkeypatch):
    planted = tmp_path / "cwd" / "ckptd"
    planted.mkdir(parents=True)
    mark = tmp_path / "planted-code-ran"
    (planted / "__init__.py").write_text(f"open({str(mark)!r}, 'w').close()\nraise ImportError('planted')\n")
    (planted / "writer").mkdir()
    (planted / "writer" / "__init__.py").write_text("")
    monkeypatch.chdir(planted.parent)
    state = {"model": {"w": torch.arange(1024, dtype=torch.float32)}}
    name = f"launch-{os.getpid()}"
    try:
        for root in (str(tmp_path / "local"), f"shm://{name}"):  # the writer; with shm:// the keeper too
            with ckptd.Checkpointer(root, hold_after_exit=300) as ckpt:
                ckpt.save(1, state)
                assert ckpt.writer_pid is not None
                assert_same(state["model"], ckpt.load(1)["model"])
    finally:
        ckptd.drop_held(name, force=True)
    assert not mark.exists(), "a helper process imported the ckptd package of the current directory"
