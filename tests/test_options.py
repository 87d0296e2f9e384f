"""CheckpointerOptions: one record of settings, environment overrides, explicit overrides."""

from __future__ import annotations

import pytest

import ckptd
from ckptd.errors import ConfigError
from ckptd.options import (
    DEFAULT_MAX_SHARD_SIZE,
    DEFAULT_REMOTE_WRITE_THREADS,
    DEFAULT_WRITE_THREADS,
    CheckpointerOptions,
)


def test_defaults_are_the_documented_constants() -> None:
    options = CheckpointerOptions()
    assert options.max_shard_size == DEFAULT_MAX_SHARD_SIZE
    assert options.writer_nice == 10 and options.writer_ionice == 7
    assert options.write_threads is None  # filled in per location
    assert options.for_location(remote=False).write_threads == DEFAULT_WRITE_THREADS
    assert options.for_location(remote=True).write_threads == DEFAULT_REMOTE_WRITE_THREADS


def test_sizes_are_parsed_and_validated() -> None:
    options = CheckpointerOptions(max_shard_size="512MiB", chunk_size="1MB")
    assert options.max_shard_size == 512 * 1024**2
    assert options.chunk_size == 1000**2
    with pytest.raises(ConfigError, match="max_shard_size"):
        CheckpointerOptions(max_shard_size="lots")
    with pytest.raises(ConfigError, match="part_size"):
        CheckpointerOptions(part_size="1MiB")
    with pytest.raises(ConfigError, match="staging"):
        CheckpointerOptions(staging="later")
    with pytest.raises(ConfigError, match="writer_ionice"):
        CheckpointerOptions(writer_ionice=9)


def test_environment_replaces_defaults_and_explicit_values_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTD_MAX_SHARD_SIZE", "1GB")
    monkeypatch.setenv("CKPTD_WRITE_THREADS", "3")
    monkeypatch.setenv("CKPTD_DIST_TIMEOUT", "30")
    options = CheckpointerOptions.from_env()
    assert (options.max_shard_size, options.write_threads, options.dist_timeout) == (1000**3, 3, 30.0)
    assert CheckpointerOptions.from_env(max_shard_size="2GB").max_shard_size == 2 * 1000**3
    monkeypatch.setenv("CKPTD_DIST_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="CKPTD_DIST_TIMEOUT"):
        CheckpointerOptions.from_env()


def test_overrides_unknown_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="max_shard_sise"):
        CheckpointerOptions().with_overrides(max_shard_sise="1GB")


def test_tuning_is_derived_from_the_options() -> None:
    tuning = CheckpointerOptions(part_size="32MiB", retry_attempts=2, direct_io=False).tuning
    assert (tuning.part_size, tuning.retry_attempts, tuning.direct_io) == (32 * 1024**2, 2, False)


def test_checkpointer_takes_an_options_record_and_overrides(tmp_path) -> None:
    options = CheckpointerOptions(max_shard_size="1MB", keep_last=2, writer_nice=0)
    with ckptd.Checkpointer(tmp_path, options, keep_last=5) as ckpt:
        assert ckpt.options.max_shard_size == 1000**2
        assert ckpt.options.keep_last == 5  # the override wins
        assert ckpt.options.writer_nice == 0
        assert ckpt.options.write_threads == DEFAULT_WRITE_THREADS
    with pytest.raises(ConfigError, match="unknown Checkpointer option"):
        ckptd.Checkpointer(tmp_path, keep_lats=2)
