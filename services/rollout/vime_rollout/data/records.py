"""Reading prompt records from JSONL and Parquet files.

Both formats yield plain dicts, so the dataset builder does not care where a record came from.
A malformed line names its file and line number instead of failing somewhere later.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class DataFileError(ValueError):
    """A prompt file that cannot be read; the message names the file (and line)."""


def read_records(path: str | Path) -> Iterator[dict[str, Any]]:
    """Records of a ``.jsonl`` / ``.json`` (one object per line) or ``.parquet`` file."""
    p = Path(path)
    if not p.is_file():
        raise DataFileError(f"prompt file {p} does not exist")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return _read_jsonl(p)
    if suffix in (".parquet", ".pq"):
        return _read_parquet(p)
    raise DataFileError(f"prompt file {p}: unknown format {suffix!r} (use .jsonl or .parquet)")


def _read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataFileError(f"{path}:{lineno}: not valid JSON: {exc.msg}") from None
            if not isinstance(record, dict):
                raise DataFileError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            yield record


def _read_parquet(path: Path) -> Iterator[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise DataFileError(f"{path}: not a readable parquet file: {exc}") from None
    for batch in parquet.iter_batches(batch_size=4096):
        yield from batch.to_pylist()
