"""The format, manifest, commit and catalog code imports no torch.

The writer process, the CLI's listing commands and any tool that only reads manifests stay
light: they load the safetensors header code, the manifest and the catalog without torch.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ckptd.formats.safetensors import DTYPE_ITEMSIZE
from ckptd.formats.torch_dtypes import TORCH_DTYPES, dtype_from_name, dtype_name

_MODULES = [
    "ckptd.formats.names",
    "ckptd.formats.safetensors",
    "ckptd.formats.manifest",
    "ckptd.formats.checksum",
    "ckptd.save.commit",
    "ckptd.catalog",
]


@pytest.mark.parametrize("module", _MODULES)
def test_module_imports_no_torch(module):
    code = f"import sys, importlib; importlib.import_module({module!r}); print('torch' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False", f"importing {module} imports torch"


def test_dtype_tables_agree():
    assert set(TORCH_DTYPES) == set(DTYPE_ITEMSIZE)
    for name, dtype in TORCH_DTYPES.items():
        assert DTYPE_ITEMSIZE[name] == dtype.itemsize, name
        assert dtype_name(dtype) == name
        assert dtype_from_name(name) is dtype
