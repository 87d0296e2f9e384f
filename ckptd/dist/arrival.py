"""Arrival before a save's collectives: a rank that never comes is named, and nobody waits forever.

A collective on the gloo group cannot say who is missing, and a rank that is alive but never
calls ``async_save`` (stuck in its data loader, say) would hold every other rank in it for the
process group's timeout (30 minutes by default).  So before the collectives of a save every rank
checks in through the c10d store, with keys under ``<namespace>/<sequence>/``:

1. ``append(who, "<rank>,")`` then ``add(count, 1)``; the rank whose ``add`` returns the world
   size sets ``all``.
2. It waits for ``all`` (a server-side wait, no polling) for at most ``timeout`` seconds.
3. It stores its decision with ``compare_set(go, "", decision)``: ``ok`` if ``all`` came, else the
   ranks missing from ``who``.  The first decision stored wins and every rank follows it, so a rank
   that arrives after the others gave up raises too instead of entering a collective alone.

Four keys per save; the coordinator deletes them (:meth:`Arrival.forget`) once the collective that
follows has completed, when every rank has read the decision.  A failed arrival's keys stay for
latecomers to read (four per failed save).  The namespace is derived from the checkpoint root, and
the sequence counts this process's saves of that root: every rank must pass the same root.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
from datetime import timedelta

from ..errors import DistributedSaveError
from .group import DistContext

__all__ = ["Arrival"]

logger = logging.getLogger(__name__)

_SEQUENCES: dict[str, itertools.count[int]] = {}  # namespace -> this process's next save number
_SEQUENCES_LOCK = threading.Lock()


class Arrival:
    """The check-in of one Checkpointer's saves (see the module docstring)."""

    def __init__(self, dist: DistContext, root: str) -> None:
        self.dist = dist
        self.namespace = "ckptd/arrive/" + hashlib.blake2b(root.encode(), digest_size=6).hexdigest()
        with _SEQUENCES_LOCK:
            self._sequence = _SEQUENCES.setdefault(self.namespace, itertools.count())
        self._pending: list[str] = []  # the keys of the last arrival, until forget()

    def arrive(self, what: str) -> None:
        """Return once every rank has arrived; raise a :class:`DistributedSaveError` naming the
        ranks that did not arrive within ``dist.timeout`` seconds."""
        dist = self.dist
        prefix = f"{self.namespace}/{next(self._sequence)}"
        who, count, done, go = (f"{prefix}/{k}" for k in ("who", "count", "all", "go"))
        self._pending = [who, count, done, go]
        dist.traffic.keys.update(self._pending)
        store = dist.store
        try:
            store.append(who, f"{dist.rank},")
            if int(store.add(count, 1)) == dist.world_size:
                store.set(done, "1")
        except Exception as e:
            raise dist._lost(e) from e
        arrived = self._wait(done, dist.timeout)
        decision = "ok" if arrived else "missing:" + ",".join(map(str, self._missing(who)))
        try:
            final = store.compare_set(go, "", decision)
        except Exception as e:
            raise dist._lost(e) from e
        final = final.decode() if isinstance(final, bytes) else str(final)
        if final == "ok":
            return
        missing = [int(r) for r in final.removeprefix("missing:").split(",") if r]
        raise DistributedSaveError(
            f"{what} failed: rank(s) {missing} did not arrive within {dist.timeout:g}s (dist_timeout): "
            "they are stalled, dead, or did not call async_save/prepare with the others",
            missing,
        )

    def forget(self) -> None:
        """Delete the last arrival's keys (the coordinator, after the collective that followed)."""
        keys, self._pending = self._pending, []
        self.dist.forget([k.removeprefix("ckptd/") for k in keys])

    def _wait(self, key: str, timeout: float) -> bool:
        try:
            self.dist.store.wait([key], timedelta(seconds=timeout))
            return True
        except Exception:  # noqa: BLE001 - a timeout: check, the store may still have the key
            pass
        try:
            return bool(self.dist.store.check([key]))
        except Exception as e:
            raise self.dist._lost(e) from e

    def _missing(self, who: str) -> list[int]:
        try:
            raw = self.dist.store.get(who)
        except Exception as e:
            raise self.dist._lost(e) from e
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        arrived = {int(r) for r in text.split(",") if r}
        missing = sorted(set(range(self.dist.world_size)) - arrived)
        logger.warning("ckptd: ranks %s did not arrive in %.1fs", missing, self.dist.timeout)
        return missing
