"""How ckptd starts its helper processes (the writer, the keeper): this interpreter running a
module of this very ckptd, whatever the current directory holds.

``python -m MODULE`` puts the current directory first on the child's ``sys.path``, so a ``ckptd``
package there (another version in a clone, or one planted in a shared directory) would be the
one the helper imports: its code would run in the writer.  The helpers are started with ``-c``
instead, dropping that entry (``""``) before ``runpy`` runs the module, and with the parent
directory of this package first on ``PYTHONPATH`` (a trainer that found ckptd through
``sys.path`` rather than an installation gets the same ckptd in its helpers).

This module imports nothing heavy: the writer process uses it too.
"""

from __future__ import annotations

import os
import sys

__all__ = ["helper_command", "helper_environment"]

_RUN = (
    "import sys; sys.path[:] = [p for p in sys.path if p]; "
    "import runpy; runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
)


def helper_command(module: str, *args: str) -> list[str]:
    """The command that runs ``module`` (``ckptd.writer.process``...) with ``args``, the current
    directory left off its ``sys.path``."""
    return [sys.executable, "-c", _RUN.format(module=module), *args]


def helper_environment() -> dict[str, str]:
    """This process's environment, with this ckptd's parent directory first on ``PYTHONPATH``."""
    env = dict(os.environ)
    package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH", "")) if p)
    return env
