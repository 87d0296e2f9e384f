"""The public surface: every name in ``ckptd.__all__`` resolves, lazily, to the right object."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import ckptd


def test_every_public_name_resolves_and_none_is_shadowed_by_a_submodule():
    submodules = {m.name for m in pkgutil.iter_modules(ckptd.__path__)}
    for name in ckptd.__all__:
        importlib.import_module("ckptd.cli")  # imports most submodules, binding them on the package
        value = getattr(ckptd, name)
        if name == "errors":
            assert value.__name__ == "ckptd.errors"
        else:
            assert name not in submodules, f"ckptd.{name} would be shadowed by the submodule of that name"
            assert not isinstance(value, type(ckptd)), name


def test_import_ckptd_does_not_import_torch():
    code = "import sys, ckptd; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
