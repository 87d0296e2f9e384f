"""On-disk formats: file names (``names``), safetensors headers (``safetensors``, torch-free) and
their torch dtypes (``torch_dtypes``), PyTorch ``.bin`` shards (``torch_bin``, seed-compatible),
the manifest, state file and HF indexes (``manifest``), the guarded reader of those small JSON
files (``json_files``) and CRC32C (``checksum``)."""

__all__: list[str] = []
