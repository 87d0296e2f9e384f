"""The ``ckptd`` command line (``ckptd ...`` or ``python -m ckptd ...``).

Commands: ``demo``, ``ls``, ``info``, ``verify``, ``diff``, ``gc``, ``rm``, ``consolidate``,
``convert``, ``export-hf``.  Exit codes and the ``--json`` schema are documented in
``docs/cli.md``; the codes are the ``EXIT_*`` constants of :mod:`ckptd.cli.output`.
"""

from __future__ import annotations

from .app import main

__all__ = ["main"]
