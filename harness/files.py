"""Files written whole or not at all: a kill, a full disk or a power loss leaves the old file or the new one,
never half of one, and JSON that every reader parses. A leaf: the engine, the trainer and the reports use it."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path


def write_atomic(path: str | Path, text: str) -> Path:
    """Write to a temporary file beside ``path``, fsync, then rename over it: a kill leaves old or new, never half."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, a kill signal turned exception: no temp file is left behind
        tmp.unlink(missing_ok=True)
        raise
    return path


def strict_json(obj, **kw) -> str:
    """JSON every reader accepts: a NaN or infinite float (a standard error of one row, a diverged loss) is
    written as null, never as the bare ``NaN`` that JavaScript, Go and jq refuse."""
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    return json.dumps(clean(obj), allow_nan=False, **kw)


def write_json(path: str | Path, obj, **kw) -> Path:
    """``obj`` as strict JSON (``strict_json``), written atomically."""
    return write_atomic(path, strict_json(obj, **kw))


def remove_stale_temps(directory: Path) -> list[Path]:
    """Temp files ``write_atomic`` left in ``directory`` when its process died before it could clean up (SIGKILL,
    power loss): those of processes no longer alive are removed."""
    gone = []
    for tmp in directory.glob(".*.tmp"):
        pid = tmp.name.rsplit(".", 2)[-2]
        if pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)
            gone.append(tmp)
    return gone


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
