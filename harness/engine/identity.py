"""What a run's rows were computed from, by content: the model's weights and config, its tokenizer's files, and
the software versions that turned them into tokens.

A path says nothing about what is behind it: a checkpoint retrained into ``runs/m``, a re-downloaded hub model
or an edited ``tokenizer.json`` keep their path. So a local folder is identified by the SHA-256 of its files
(cached by path, size, mtimes, inode and device, so a 3 GB checkpoint is hashed once, not every run) and a hub
model by the snapshot commit it resolves to in the Hugging Face cache (a commit's files never change).
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from harness.engine.results import versions
from harness.hub import hub_snapshot
from harness.files import write_atomic
from harness.hashing import digest, file_digest

log = logging.getLogger("harness")

# What each file of a checkpoint folder is. Files of no kind (README, result.json, logs, plots, hidden files such
# as the trainer's mid-run state) are not part of the model. Subfolders are never read.
TOKENIZER_NAMES = frozenset({"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                             "merges.txt", "vocab.txt", "added_tokens.json", "tokenizer.model", "spiece.model",
                             "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json"})
TOKENIZER_SUFFIXES = (".tiktoken",)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5", ".index.json")
CONFIG_NAMES = frozenset({"config.json", "generation_config.json"})
CONFIG_SUFFIXES = (".py",)  # remote code

RACY_SECONDS = 2.0  # a file modified this recently may change again within the clock's resolution: not cached


def file_kind(name: str) -> str | None:
    if name.startswith("."):
        return None
    if name in TOKENIZER_NAMES or name.endswith(TOKENIZER_SUFFIXES):
        return "tokenizer"
    if name in CONFIG_NAMES or name.endswith(CONFIG_SUFFIXES):
        return "config"
    if name.endswith(WEIGHT_SUFFIXES):
        return "weights"
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("ICR_CACHE", Path.home() / ".cache" / "icr-harness"))


class FileHashCache:
    """SHA-256 of files, remembered by (path, size, mtime, ctime, inode, device): any rewrite, copy or ``touch``
    changes one of them. Shared by concurrent runs through a file lock; a lost update only costs a re-hash."""

    def __init__(self, path: Path | None = None):
        self.path = path or cache_dir() / "file-sha256.json"
        self._entries: dict | None = None

    def _load(self) -> dict:
        if self._entries is None:
            try:
                self._entries = json.loads(self.path.read_text())
            except (OSError, ValueError):
                self._entries = {}
        return self._entries

    @staticmethod
    def _stamp(st: os.stat_result) -> list[int]:
        return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]

    def sha256(self, file: Path) -> str:
        file = Path(file).resolve()
        st = file.stat()
        key, stamp = str(file), self._stamp(st)
        hit = self._load().get(key)
        if hit is not None and hit[:-1] == stamp:
            return hit[-1]
        t0 = time.perf_counter()
        sha = file_digest(file)
        if st.st_size > 1 << 28:
            log.info("hashed %s (%.1f GB) in %.1f s; cached until the file changes", file, st.st_size / 1e9,
                     time.perf_counter() - t0)
        if self._stamp(file.stat()) == stamp and time.time() - st.st_mtime > RACY_SECONDS:
            self._store(key, [*stamp, sha])
        return sha

    def _store(self, key: str, value: list) -> None:
        from filelock import FileLock

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(self.path) + ".lock", timeout=10):
                self._entries = None  # merge with what other runs wrote meanwhile
                entries = self._load()
                entries[key] = value
                if len(entries) > 5000:  # forget files that are gone
                    for gone in [k for k in entries if not os.path.exists(k)]:
                        del entries[gone]
                write_atomic(self.path, json.dumps(entries))
        except Exception as e:  # noqa: BLE001  a cache that cannot be written only costs time
            log.debug("file-hash cache not written (%s)", e)


def folder_digest(folder: Path, kind: str, cache: FileHashCache | None = None) -> str | None:
    """One hash over the names and contents of ``folder``'s files of ``kind``; None when it has none."""
    cache = cache or FileHashCache()
    files = sorted(p for p in Path(folder).iterdir() if p.is_file() and file_kind(p.name) == kind)
    if not files:
        return None
    return digest(*(f"{p.name}\0{cache.sha256(p)}\n" for p in files), length=16)


def source_identity(name: str | None, kinds: tuple[str, ...], cache: FileHashCache | None = None) -> dict:
    """``{kind: identity}`` of a local folder's files or of a hub id's cached snapshot (``hub:ID@COMMIT``;
    ``None`` when the id is not in the cache yet: the caller loads it, which downloads it, and asks again)."""
    if name is None:
        return {}
    local = Path(name).expanduser()
    if local.is_dir():
        return {k: folder_digest(local, k, cache) for k in kinds}
    snap = hub_snapshot(name)
    commit = f"hub:{name}@{snap.name}" if snap is not None else None
    return {k: commit for k in kinds}


def model_identity(model_path: str, tokenizer: str | None) -> dict:
    """The model's weights, config and tokenizer by content (``tokenizer``: a separate tokenizer's folder or id,
    else the model's own files), and the versions of the code that runs them."""
    cache = FileHashCache()
    ident = source_identity(model_path, ("weights", "config"), cache)
    ident.update(source_identity(tokenizer or model_path, ("tokenizer",), cache))
    return {"model_weights": ident.get("weights"), "model_config": ident.get("config"),
            "tokenizer_files": ident.get("tokenizer"), "software": software_versions()}


def awaits_download(model_path: str, tokenizer: str | None, identity: dict) -> bool:
    """A hub model or tokenizer not in the HF cache yet: its commit is known once it has been loaded."""
    return any(identity.get(key) is None and not Path(src).expanduser().is_dir()
               for key, src in (("model_weights", model_path), ("tokenizer_files", tokenizer or model_path)))


def software_versions() -> dict[str, str]:
    """The packages whose code decides a generation: another version may round, tokenize or decode differently."""
    found = versions()
    return {pkg: found.get(pkg, "absent") for pkg in ("icr-harness", "torch", "transformers", "tokenizers")}


# What a changed key of the resolved settings is called in an error line.
LABELS = {"model_weights": "model weights", "model_config": "model config (config.json)",
          "tokenizer_files": "tokenizer files", "software": "package versions", "data_sha256": "data file",
          "template_sha256": "template", "dtype": "dtype", "device_type": "device type", "model": "model",
          "scan": "Phi-Mamba scan path", "vllm_engine": "vLLM (version and engine settings)"}


def describe_changes(old: dict, new: dict) -> str:
    """``model weights changed since this run started: 1a2b… → 3c4d…; ...`` for every key that differs."""
    parts = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            sub = [f"{s} {a.get(s)} → {b.get(s)}" for s in sorted(set(a) | set(b)) if a.get(s) != b.get(s)]
            parts.append(f"{LABELS.get(k, k)} changed since this run started: {', '.join(sub)}")
        else:
            parts.append(f"{LABELS.get(k, k)} changed since this run started: {_short(a)} → {_short(b)}")
    return "; ".join(parts) or "unknown (run.json predates hashing)"


def _short(v) -> str:
    return "none" if v is None else repr(v) if not isinstance(v, str) else v
