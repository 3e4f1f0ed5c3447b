"""The Hugging Face hub when it may be out of reach: one quick probe decides, and what is not on this machine
fails in seconds with the commands that get it, instead of a minute of retries.

``HF_HUB_OFFLINE=1`` skips the probe. Loads pass ``local_files_only`` (transformers' and huggingface_hub's public
switch) when the hub is unreachable, so a model already in the HF cache loads without a network round trip."""
from __future__ import annotations

import functools
import logging
import os
import socket
from pathlib import Path
from urllib.parse import urlparse


log = logging.getLogger("harness")

PROBE_SECONDS = 3.0


class HubUnreachableError(OSError):
    """Something must come from the hub, the hub cannot be reached, and it is not in the HF cache."""


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=1)
def offline() -> bool:
    """True under ``HF_HUB_OFFLINE`` or when the hub's host does not answer within a few seconds (asked once)."""
    if _truthy("HF_HUB_OFFLINE"):
        return True
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (443 if endpoint.scheme != "http" else 80)
    try:
        socket.create_connection((host, port), timeout=PROBE_SECONDS).close()
        return False
    except OSError as e:
        log.warning("the Hugging Face hub (%s) is unreachable (%s): using the local HF cache only (set "
                    "HF_HUB_OFFLINE=1 to skip this check)", host, e)
        return True


def is_local(name: str) -> bool:
    return Path(name).expanduser().is_dir()


def load_kwargs(name: str) -> dict:
    """Extra ``from_pretrained`` arguments for ``name``: cache only when the hub is out of reach."""
    return {"local_files_only": True} if not is_local(name) and offline() else {}


def in_cache(repo_id: str) -> bool:
    return hub_snapshot(repo_id) is not None


def missing(*needed: tuple[str | None, str]) -> list[tuple[str, str]]:
    """The ``(repo_id, role)`` pairs that would have to come from an unreachable hub (local folders and cached ids
    are there)."""
    return [(r, role) for r, role in needed if r is not None and not is_local(r) and offline() and not in_cache(r)]


def unreachable_error(absent: list[tuple[str, str]], also: str = "", why: str = "") -> HubUnreachableError:
    """One error naming everything absent, with the commands that get it; ``also``: another thing missing
    (e.g. the data), already phrased with its own fix; ``why``: why something is needed at all."""
    names = " and ".join(f"{role} {r!r}" for r, role in absent)
    commands = "\n".join(f"    hf download {r}" for r, _ in absent)
    flags = " / ".join(f"--{role} DIR" for _, role in absent)
    offline_note = " (HF_HUB_OFFLINE is set)" if _truthy("HF_HUB_OFFLINE") else " (HF_HUB_OFFLINE=1 skips the probe)"
    text = (f"{names} {'is' if len(absent) == 1 else 'are'} not on this machine and the Hugging Face hub is "
            f"unreachable{offline_note}. Download where the hub is reachable and copy the HF cache "
            f"(~/.cache/huggingface/hub) here:\n{commands}\nor download into a folder (hf download NAME --local-dir "
            f"DIR) and pass {flags}.")
    return HubUnreachableError((f"{why}\n" if why else "") + text + (f"\nAlso missing: {also}" if also else ""))


def require(*needed: tuple[str | None, str]) -> None:
    """Raise the error of ``unreachable_error`` when any of ``needed`` must come from an unreachable hub."""
    absent = missing(*needed)
    if absent:
        raise unreachable_error(absent)


def hub_snapshot(repo_id: str) -> Path | None:
    """The snapshot folder the HF cache resolves ``repo_id`` to (its name is the commit), or None if not cached."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        hit = try_to_load_from_cache(repo_id, "config.json")
        if not isinstance(hit, str):
            hit = try_to_load_from_cache(repo_id, "tokenizer_config.json")
    except Exception:  # noqa: BLE001  a malformed id: the model load reports it
        return None
    return Path(hit).parent if isinstance(hit, str) else None
