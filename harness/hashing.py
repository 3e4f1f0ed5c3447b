"""The project's one content hash: SHA-256 over text, JSON or files. Settings, data, templates, prompts,
checkpoints and the trainer's per-batch seeds are all identified through it."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def digest(*parts: str | bytes, length: int | None = None) -> str:
    """Hex SHA-256 of ``parts`` in order (text as UTF-8, lone surrogates kept), cut to ``length`` characters."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part if isinstance(part, bytes) else part.encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:length]


def json_digest(obj: Any, length: int | None = 16) -> str:
    """The digest of ``obj`` as canonical JSON (sorted keys; what JSON cannot hold, as text)."""
    return digest(json.dumps(obj, sort_keys=True, default=str), length=length)


def file_digest(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes, read in 4 MiB chunks (checkpoints run to gigabytes)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def content_sha256(rows: list) -> str:
    """Hash of the loaded data (not its path): an edited data file is a different run, a moved one is not."""
    return digest(*(json.dumps(r, sort_keys=True, ensure_ascii=False, default=str) + "\n" for r in rows), length=16)
