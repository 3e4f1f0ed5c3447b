"""What a run's rows were computed from, by content: the model's weights and config, its tokenizer's files, and
the software versions that turned them into tokens.

A path says nothing about what is behind it: a checkpoint retrained into ``runs/m``, a re-downloaded hub model
or an edited ``tokenizer.json`` keep their path. So a local folder is identified by the SHA-256 of its files
(cached by path, size, mtimes, inode and device, so a 3 GB checkpoint is hashed once, not every run) and a hub
model by the snapshot commit it resolves to in the Hugging Face cache (a commit's files never change).
"""
from __future__ import annotations

import logging
from pathlib import Path

from harness.cache import FileHashCache
from harness.engine.results import versions
from harness.hub import hub_snapshot
from harness.hashing import digest

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
