"""What a step backend's tokens cost in memory, measured on the backend itself: the decoding state one sequence
holds (``state_bytes``, recorded per row), the peak one prefilled token takes on a GPU, and from both the token
budget of ``--batch-size auto``. Each measurement is taken once per backend and kept here, not on the backend."""
from __future__ import annotations

import os
import weakref

import torch

from harness.backends.base import StepModel, probe_ids, state_nbytes

_STATE_FITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # backend -> (bytes, bytes per token) | None
_PREFILL_PEAKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # backend -> bytes per prefilled token


@torch.inference_mode()
def state_bytes(backend: StepModel, tokens: int) -> int | None:
    """Bytes of decoding state one sequence of ``tokens`` tokens holds (KV cache at its length, conv and SSM
    state, both for hybrids): fitted once from two real prefills as a constant plus a per-token part (exact
    for both kinds of state). None where the backend cannot prefill a state of its own."""
    if backend not in _STATE_FITS:
        try:
            sizes = []
            for n in (8, 24):
                ids = probe_ids(backend, 1, n)
                sizes.append(state_nbytes(backend.prefill(ids, torch.ones_like(ids))[1]))
            per_token = (sizes[1] - sizes[0]) / 16
            _STATE_FITS[backend] = (sizes[0] - 8 * per_token, per_token)
        except NotImplementedError:
            _STATE_FITS[backend] = None
    fit = _STATE_FITS[backend]
    return None if fit is None else int(round(fit[0] + fit[1] * tokens))


def token_budget(backend: StepModel) -> int:
    """Tokens (batch x sequence length) one batch may hold; used by ``--batch-size auto``. A token costs the
    larger of what its cache holds while decoding (``bytes_per_token``) and what a prefill needs per token,
    measured."""
    if backend.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(backend.device)
        per_token = max(backend.bytes_per_token(), prefill_bytes_per_token(backend))
        return max(2048, int(free * 0.5 / max(1, per_token)))
    # On a CPU a batch's decode step reads the weights once for all its rows, so the tree's rows decode faster
    # together (24 rows of 2.4k tokens, tiny Phi: 41 ms a step at once against 4 x 15 ms in batches of 6). A
    # CPU keeps no allocator statistics to measure a prefill's peak by, so a token is priced at the larger of
    # its cache and 32 activations of the model's width (a layer's widest moment in a padded prefill: the MLP's
    # 4x-wide activation with its temporaries, the projections, the residual), against an eighth of the free
    # memory; never below the former fixed 16,384 tokens (what large models still get), never above 262,144.
    free, width = available_memory(), _hidden_size(backend)
    if free is None or width is None:
        return CPU_TOKENS[0]
    per_token = max(backend.bytes_per_token(), 32 * width * torch.finfo(backend.dtype).bits // 8)
    return max(CPU_TOKENS[0], min(CPU_TOKENS[1], free // 8 // per_token))


CPU_TOKENS = (16384, 262144)  # a CPU batch's token budget: at least, at most


def _hidden_size(backend) -> int | None:
    cfg = getattr(getattr(backend, "model", None), "config", None)
    width = next((getattr(cfg, k) for k in ("hidden_size", "n_embd", "d_model") if hasattr(cfg, k)), None)
    return width if isinstance(width, int) and width > 0 else None


def available_memory() -> int | None:
    """Bytes of memory the system could give this process now (Linux's MemAvailable, else the free pages),
    or None where neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


@torch.inference_mode()
def prefill_bytes_per_token(backend: StepModel, length: int = 2048) -> int:
    """Peak CUDA memory one prefilled token takes (activations, the kernels' scratch, its cache), measured once
    on one prompt of ``length`` tokens. A recurrent model's cache is small but its prefill is not: on an H100 a
    Phi-Mamba batch sized by its cache alone ran out of memory."""
    if backend not in _PREFILL_PEAKS:
        n = min(length, backend.max_context or length)
        ids = torch.full((1, n), backend.tokenizer.eos_token_id or 0, device=backend.device)
        torch.cuda.synchronize(backend.device)
        base = torch.cuda.memory_allocated(backend.device)
        torch.cuda.reset_peak_memory_stats(backend.device)
        out = backend.prefill(ids, torch.ones_like(ids))
        torch.cuda.synchronize(backend.device)
        _PREFILL_PEAKS[backend] = -(-(torch.cuda.max_memory_allocated(backend.device) - base) // n)
        del out
        torch.cuda.empty_cache()
    return _PREFILL_PEAKS[backend]
