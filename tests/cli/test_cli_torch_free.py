"""``ls``, ``info``, ``verify``, ``diff``, ``gc`` and ``rm`` import neither torch nor numpy for ckptd
and HF safetensors checkpoints: each runs ``python -X importtime -m ckptd ...`` and reads what the
interpreter imported from its own report."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import safetensors.torch
import torch
from cli_helpers import EXIT, REPO

import ckptd

HEAVY = ("torch", "numpy")


def imported_modules(*args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run ``python -m ckptd ARGS`` and return it with every module it imported (``-X importtime``
    reports each import on stderr, which is then left with the command's own lines)."""
    environment = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ckptd", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment,
    )
    modules = set()
    rest = []
    for line in out.stderr.splitlines():
        if line.startswith("import time:"):
            name = line.rsplit("|", 1)[1].strip()
            if name != "imported package":
                modules.add(name)
        else:
            rest.append(line)
    out.stderr = "\n".join(rest)
    return out, modules


def heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in HEAVY)


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """A root of two ckptd checkpoints (model, optimizer, non-tensor state; the second an
    incremental save), an HF sharded directory, an HF single-file directory and a lone file."""
    base = tmp_path_factory.mktemp("torch_free")
    root = str(base / "runs")
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 8)).sum().backward()
    optimizer.step()
    with ckptd.Checkpointer(root, incremental=True) as ckpt:
        ckpt.save(10, {"model": model, "optimizer": optimizer, "progress": {"step": 10}})
        optimizer.step()
        ckpt.save(20, {"model": model, "optimizer": optimizer, "progress": {"step": 20}})
    sharded = str(base / "hf_sharded")
    ckptd.export_hf(os.path.join(root, "checkpoint-20"), sharded)
    single = base / "hf_single"
    single.mkdir()
    safetensors.torch.save_file(model.state_dict(), str(single / "model.safetensors"))
    lone = str(base / "weights.safetensors")
    safetensors.torch.save_file(model.state_dict(), lone)
    return {
        "root": root,
        "a": os.path.join(root, "checkpoint-10"),
        "b": os.path.join(root, "checkpoint-20"),
        "sharded": sharded,
        "single": str(single),
        "lone": lone,
    }


CASES = [
    ("ls", ["ls", "{root}"], "ok"),
    ("info ckptd", ["info", "{b}"], "ok"),
    ("info hf sharded", ["info", "{sharded}"], "ok"),
    ("info hf single", ["info", "{single}", "--json"], "ok"),
    ("info lone file", ["info", "{lone}"], "ok"),
    ("verify", ["verify", "{b}"], "ok"),
    ("diff", ["diff", "{a}", "{b}"], "differs"),
    ("diff --exact", ["diff", "{a}", "{b}", "--exact", "--json"], "differs"),
    ("diff --exact hf", ["diff", "{sharded}", "{single}", "--exact"], "ok"),
    ("gc", ["gc", "{root}"], "ok"),
]


@pytest.mark.parametrize(("label", "args", "code"), CASES, ids=[c[0] for c in CASES])
def test_inspecting_commands_import_neither_torch_nor_numpy(places, label, args, code):
    out, modules = imported_modules(*(a.format(**places) for a in args))
    assert out.returncode == {**EXIT, "differs": 7}[code], (out.returncode, out.stdout, out.stderr)
    assert out.stderr == ""
    assert "ckptd.cli.app" in modules  # the report covers the command's own imports
    assert heavy(modules) == [], f"{label} imported {heavy(modules)[:5]}"


def test_rm_imports_neither_torch_nor_numpy(tmp_path):
    root = str(tmp_path / "runs")
    with ckptd.Checkpointer(root) as ckpt:
        ckpt.save(1, {"model": {"w": torch.ones(3)}})
        ckpt.save(2, {"model": {"w": torch.ones(3)}})
    out, modules = imported_modules("rm", root, "1")
    assert out.returncode == 0, out.stderr
    assert heavy(modules) == []
    assert ckptd.Checkpointer(root).steps() == [2]


def test_a_dcp_checkpoint_is_described_through_torch(dcp_checkpoint):
    """The formats only torch reads still work (and may import it)."""
    _model, _optimizer, path = dcp_checkpoint
    out, modules = imported_modules("info", path)
    assert out.returncode == 0, out.stderr
    assert "format: dcp" in out.stdout and "torch" in modules
