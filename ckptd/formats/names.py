"""Every file and directory name ckptd writes or looks for, in one place.

HF-compatible names (``model-00001-of-00002.safetensors``, ``model.safetensors.index.json``,
``model.safetensors``, ``pytorch_model.bin`` and their ``.bin`` counterparts), ckptd's own files
(``checkpoint_manifest.json``, ``state.json``, ``metrics.json``, the object-store claim) and the
directory names under a checkpoint root (``checkpoint-120`` and the hidden staging
directories of saves in progress).  Only names: nothing here touches storage.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import socket
from dataclasses import dataclass

__all__ = [
    "ARENAS_NAME",
    "CLAIM_NAME",
    "MANIFEST_NAME",
    "LEGACY_METRICS_NAME",
    "METRICS_NAME",
    "SAFETENSORS_INDEX",
    "SAFETENSORS_SINGLE",
    "SPARE_NAME",
    "STATE_NAME",
    "TORCH_BIN_INDEX",
    "TIERS_RECORD_NAME",
    "TORCH_BIN_SINGLE",
    "StagingName",
    "checkpoint_dir_name",
    "hf_index_name",
    "host_label",
    "index_file_name",
    "is_seed_shard_name",
    "leftover_name",
    "match_leftover_name",
    "parse_staging_name",
    "parse_step",
    "seed_shard_name",
    "shard_file_name",
    "spread_file_name",
    "staging_dir_name",
]

MANIFEST_NAME = "checkpoint_manifest.json"
"""The commit record, written last: a directory without it is not a checkpoint."""
STATE_NAME = "state.json"
"""The non-tensor state of every component."""
METRICS_NAME = "eval_metrics.json"
"""Metrics saved beside a checkpoint (Forgather's ``save_checkpoint_metrics``)."""
LEGACY_METRICS_NAME = "metrics.json"
"""Where ckptd before 0.2 wrote those metrics (still read)."""
TIERS_RECORD_NAME = ".ckptd-tiers.json"
"""Beside the checkpoints of a root: the slower tiers of the last Checkpointer that saved there
with ``tiers`` (roots, cadence, retention; never credentials), which ``ckptd ls`` lists too."""
SPARE_NAME = ".ckptd-spare"
"""In a held-memory root: the files of the newest checkpoint retention dropped (its manifest
removed), whose pages the next save's files reuse instead of allocating and clearing new ones."""
ARENAS_NAME = ".ckptd-arenas"
"""In a held-memory root: the staging files of the trainers saving there, which the writer links
into a save's directory as its shard files (:mod:`ckptd.save.file_arena`)."""
CLAIM_NAME = ".ckptd-claim"
"""Object stores: the create-only object that claims a checkpoint prefix before any shard."""

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"
TORCH_BIN_SINGLE = "pytorch_model.bin"

_STEP_RE = re.compile(r"^checkpoint-(\d+)$")
_STAGING_RE = re.compile(r"^\.checkpoint-(?P<step>\d+)\.tmp-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]+$")
# Hidden names a crash can leave beside a target ``<base>``: ``tmp`` (a staging directory, or a
# file being written), ``replaced`` (the old checkpoint during an overwrite without an atomic
# exchange), ``deleting`` (a checkpoint being removed).  The owner (host, pid) is recorded;
# names from older versions have none.
_LEFTOVER_RE = re.compile(
    r"^\.(?P<base>.+)\.(?P<kind>tmp|replaced|deleting)-(?:(?P<host>[^-]+)-(?P<pid>\d+)-)?[0-9a-f]+$"
)
_SEED_SHARD_RE = re.compile(r"^(?:model|pytorch_model)-\d{5}-of-\d{5}\.(?:safetensors|bin)$")


def shard_file_name(component: str, index: int, count: int, extension: str = "safetensors") -> str:
    """HF-style shard name: ``model-00001-of-00003.safetensors``."""
    return f"{component}-{index:05d}-of-{count:05d}.{extension}"


def spread_file_name(name: str) -> str:
    """``name`` under a two-hex-digit subdirectory derived from it (``3f/model-00001-of-00008.safetensors``).

    Object stores partition a bucket's request rate by key prefix; keys that differ right after
    the checkpoint directory let the store split the load of many writers (or readers) over up
    to 256 prefixes instead of one.  The digest is stable, so a name always maps to one place.
    """
    return f"{hashlib.sha256(name.encode()).hexdigest()[:2]}/{name}"


def hf_index_name(component: str, kind: str = "safetensors") -> str:
    """``model.safetensors.index.json`` (or ``pytorch_model.bin.index.json`` for ``.bin``)."""
    if kind == "torch_bin":
        return TORCH_BIN_INDEX if component == "model" else f"{component}.bin.index.json"
    return f"{component}.safetensors.index.json"


def index_file_name(safetensors: bool) -> str:
    """``model.safetensors.index.json`` or ``pytorch_model.bin.index.json``."""
    return SAFETENSORS_INDEX if safetensors else TORCH_BIN_INDEX


def seed_shard_name(safetensors: bool, number: int, count: int) -> str:
    """The seed API's shard names: ``model-00001-of-00002.safetensors`` or
    ``pytorch_model-00001-of-00002.bin``."""
    if safetensors:
        return shard_file_name("model", number, count)
    return shard_file_name("pytorch_model", number, count, "bin")


def is_seed_shard_name(name: str) -> bool:
    """Whether ``name`` is a shard the seed API writes (either format)."""
    return _SEED_SHARD_RE.match(name) is not None


def checkpoint_dir_name(step: int) -> str:
    """``checkpoint-120`` for step 120 (the HF Trainer / Forgather convention).

    Directories written before with zero-padded names (``checkpoint-000120``) are still listed
    and loaded: :func:`parse_step` reads both, and listings sort by the parsed step.
    """
    return f"checkpoint-{step}"


def parse_step(name: str) -> int | None:
    """The step of a ``checkpoint-<step>`` name, else ``None``."""
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def host_label() -> str:
    """This host's name as it appears in staging directory names (no '-', the field separator)."""
    return socket.gethostname().replace("-", "_") or "host"


def staging_dir_name(step: int) -> str:
    """A hidden, unique staging directory name recording this host and process:
    ``.checkpoint-120.tmp-<host>-<pid>-<random>``."""
    return leftover_name(checkpoint_dir_name(step), "tmp")


@dataclass(frozen=True)
class StagingName:
    """What a staging directory's name says: the step, and the host and process saving it."""

    step: int
    host: str
    pid: int


def parse_staging_name(name: str) -> StagingName | None:
    """The parts of a :func:`staging_dir_name`, else ``None``."""
    match = _STAGING_RE.match(name)
    if match is None:
        return None
    return StagingName(int(match.group("step")), match.group("host"), int(match.group("pid")))


def leftover_name(base: str, kind: str) -> str:
    """A hidden name beside ``base`` for a staging (``tmp``), ``replaced`` or ``deleting``
    directory, recording this host and process so garbage collection knows its owner."""
    return f".{base}.{kind}-{host_label()}-{os.getpid()}-{secrets.token_hex(4)}"


def match_leftover_name(name: str) -> re.Match[str] | None:
    """The parts (``base``, ``kind``, ``host``, ``pid``) of a :func:`leftover_name`, else ``None``
    (also for a base that names no entry of the root: ``.``, ``..`` or a path)."""
    match = _LEFTOVER_RE.match(name)
    if match is None or match["base"] in (".", "..") or "/" in match["base"]:
        return None
    return match
