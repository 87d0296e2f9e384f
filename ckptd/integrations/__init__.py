"""ckptd inside training frameworks: Lightning, Hugging Face Trainer, Accelerate.

Each module imports its framework on import and is optional (``pip install ckptd[lightning]``,
``ckptd[hf]``, ``ckptd[accelerate]``); nothing in the ckptd core imports them.
"""

from __future__ import annotations

__all__: list[str] = []
