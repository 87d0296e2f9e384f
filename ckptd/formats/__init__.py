"""Shard file formats: safetensors (written and read) and PyTorch ``.bin`` (seed-compatible)."""

__all__: list[str] = []
