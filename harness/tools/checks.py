"""The machine checks the doctor and the GPU suite both run: parity of each decoding path against the reference
on tiny random models, decode speed against the memory-bandwidth bound, and what software is here."""
from __future__ import annotations

import gc
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import transformers

from harness.backends.base import state_nbytes
from harness.backends.base import GenRequest
from harness.backends.generation import left_pad
from harness.backends.hf import TransformersBackend
from harness.backends.kv_decode_graphs import GraphedKVDecode
from harness.backends.loading import load_backend
from harness.backends.vllm_backend import VLLMBackend, vllm_build
from harness.ops import kernels
from harness.ops.decode_attention import attention_op
from harness.models.decode_graphs import GraphedDecode
from harness.models.phi_mamba import PhiMambaConfig, PhiMambaForCausalLM
from harness.tiny import build_tokenizer, make_tiny_model
from harness.procs import python_result

TOL = 1e-3  # max |logit difference| on tiny random models (float32)


def _synchronizer(device):
    """Waits for queued GPU work before a clock is read (nothing to wait for on a CPU)."""
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)


def decode_cost(backend, length: int, steps: int, batch: int = 1) -> tuple[float, int]:
    """(seconds per decoding step, decoding-state bytes of the batch) after ``batch`` prompts of ``length``
    tokens."""
    vocab = backend.tokenizer.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (batch, length), generator=g).to(backend.device)
    mask = torch.ones_like(ids)
    sync = _synchronizer(backend.device)
    with torch.inference_mode():
        logits, state = backend.prefill(ids, mask)
        tok = logits.argmax(-1, keepdim=True)
        for _ in range(3):  # warm-up
            mask = torch.cat([mask, mask.new_ones(batch, 1)], 1)
            tok = backend.step(state, tok, mask).argmax(-1, keepdim=True)
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            mask = torch.cat([mask, mask.new_ones(batch, 1)], 1)
            tok = backend.step(state, tok, mask).argmax(-1, keepdim=True)
        sync()
        per_token = (time.perf_counter() - t0) / steps
    return per_token, state_nbytes(state)


# ------------------------------------------------------------------------------------------------ checks
def _tiny_phi_mamba(attn_layers, device, seed=0):
    torch.manual_seed(seed)
    cfg = PhiMambaConfig.tiny(vocab_size=97, d_model=64, n_layer=2, attn_layers=attn_layers, chunk_size=16)
    model = PhiMambaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.5)  # large enough that outputs depend on the whole prompt
    return model.to(device)


def _probe_prompts() -> list[list[int]]:
    """Three fixed random prompts of different lengths: a left-padded batch with real padding."""
    return [torch.randint(1, 97, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (37, 20, 5)]


def _run_paths(model, seqs, steps: int, scan: str, device, graphs=None) -> tuple[torch.Tensor, list[torch.Tensor],
                                                                             list[list[int]]]:
    """Prefill a left-padded batch, then greedy-decode ``steps`` tokens (through ``graphs``, a GraphedDecode,
    when given); logits at real positions, per-step logits and tokens."""
    model.scan = scan
    ids, mask = left_pad(seqs, 0, device)
    with torch.inference_mode():
        logits, state = model(ids, mask)
        real = logits[mask.bool()]
        tok = logits[:, -1].argmax(-1, keepdim=True)
        step_logits, toks = [], [tok[:, 0].tolist()]
        for _ in range(steps):
            mask = torch.cat([mask, mask.new_ones(len(seqs), 1)], 1)
            if graphs is not None:
                last = graphs(state, tok, mask)
                if last is None:  # the graphs went off (a failed capture): the comparison must not pass silently
                    raise RuntimeError(f"decode graphs did not run this step: {graphs.describe()}")
            else:
                out, state = model(tok, mask, state)
                last = out[:, -1]
            step_logits.append(last)
            tok = last.argmax(-1, keepdim=True)
            toks.append(tok[:, 0].tolist())
    return real, step_logits, toks


def check_phi_mamba_reference(device="cpu") -> dict:
    """The reference path against itself: a left-padded batch equals each prompt alone."""
    worst = 0.0
    for attn in ([], [1]):
        model = _tiny_phi_mamba(attn, device)
        seqs = _probe_prompts()
        batch = _run_paths(model, seqs, 6, "torch", device)
        for i, s in enumerate(seqs):
            alone = _run_paths(model, [s], 6, "torch", device)
            worst = max(worst, max((a[0] - b[i]).abs().max().item() for a, b in zip(alone[1], batch[1])))
    return {"name": "phi-mamba reference: batched == alone", "max_diff": worst, "ok": worst < TOL}


def check_phi_mamba_kernels(device) -> dict:
    """mamba-ssm's kernels (prompt scan and decode step) against the reference path."""
    before = dict(kernels.CALLS)
    worst, same_tokens = 0.0, True
    for attn in ([], [1]):
        model = _tiny_phi_mamba(attn, device)
        seqs = _probe_prompts()
        ref = _run_paths(model, seqs, 4, "torch", device)
        ker = _run_paths(model, seqs, 4, "kernel", device)
        worst = max(worst, (ref[0] - ker[0]).abs().max().item(),
                    *((a - b).abs().max().item() for a, b in zip(ref[1], ker[1])))
        same_tokens &= ref[2] == ker[2]
    launched = {k: kernels.CALLS[k] - before[k] for k in kernels.CALLS}
    ok = worst < TOL and same_tokens and all(launched.values())
    return {"name": f"phi-mamba: mamba-ssm kernels == reference ({device})", "max_diff": worst,
            "same_tokens": same_tokens, "kernel_calls": launched, "ok": ok}


def check_cuda_graphs(device="cuda", compiled: bool = False, attention: str = "capacity") -> dict:
    """Decode steps replayed from CUDA graphs against the eager step: Phi-Mamba and the hybrid (a batch of 3:
    bucket 4; the hybrid's KV cache fixed-capacity and resident), and transformers' Phi and Llama through their
    backend (greedy generations of prompts of different lengths, batch 3, rows leaving the batch). ``compiled``:
    the compiled step's graphs (``--cuda-graphs compiled``) of the hybrid and of Phi instead, the compiled step
    still on at the end (its first-step check against the eager step did not turn it off). ``attention="filled"``:
    Phi's and Llama's graphs attending over the filled positions only (``harness.ops.decode_attention``), still on
    at the end. On a CPU the graphs' code runs with capture off (what a test can run)."""
    worst, same, capture = 0.0, True, torch.device(device).type == "cuda"
    filled = attention == "filled"
    for attn in () if filled else ([1],) if compiled else ([], [1]):
        model = _tiny_phi_mamba(attn, device)
        seqs = _probe_prompts()
        eager = _run_paths(model, seqs, 8, "auto", device)
        graphs = GraphedDecode(model, capture=capture, compile=compiled)
        graphed = _run_paths(model, seqs, 8, "auto", device, graphs=graphs)
        worst = max(worst, *((a - b).abs().max().item() for a, b in zip(eager[1], graphed[1])))
        same &= eager[2] == graphed[2] and not (compiled and graphs.compiled.disabled)
    texts = [f"Paragraph {i}: {'the river Karvell runs north ' * (1 + 3 * i)}Question: where is it?" for i in range(3)]
    with tempfile.TemporaryDirectory() as d:
        for arch in ("phi",) if compiled else ("phi", "llama"):
            path = str(make_tiny_model(f"{d}/{arch}", arch, tokenizer=build_tokenizer(), init_std=0.2))
            runs = {}
            for graphs in ("off", "on"):
                backend = load_backend(path, device, "float32", cuda_graphs="off")
                if graphs == "on":  # as --cuda-graphs builds them
                    backend.graphs = GraphedKVDecode(backend.model, capture=capture, compile=compiled,
                                                     attention=attention)
                reqs = [GenRequest(t, 8 + 4 * i) for i, t in enumerate(texts)]
                runs[graphs] = [r.token_ids for r in backend.generate(reqs, batch_size=3, prefix_reuse="none")]
                g = backend.graphs
                ran = g is not None and not g.disabled and g.cache.graphs
                if graphs == "on" and not (ran and (not compiled or not g.compiled.disabled)
                                           and (not filled or g.filled)):
                    same = False  # the graphs (or the compiled step, the filled attention) never ran
            same &= runs["on"] == runs["off"] and len({tuple(r) for r in runs["off"]}) > 1
    if filled:  # the kernel alone at a real shape (Phi-1.5's heads, 2k filled of a 2,560 capacity, 5 splits)
        worst = max(worst, filled_kernel_diff(device))
    what = "the compiled step's CUDA graphs == eager (hybrid, phi)" if compiled else \
        "decode from CUDA graphs over the filled positions == eager (phi, llama)" if filled else \
        "decode from CUDA graphs == eager (phi-mamba, hybrid, phi, llama)"
    return {"name": what, "max_diff": worst, "same_tokens": same, "ok": worst < TOL and same}


def filled_kernel_diff(device, heads: int = 32, dim: int = 64, capacity: int = 2560, last: int = 2047) -> float:
    """The filled positions' attention (``harness.ops.decode_attention``: the Triton kernel on a GPU) against SDPA
    over the whole capacity under the additive mask, float32, 4 rows (one left-padded): the largest difference
    relative to the output's largest value. Positions past ``last`` hold NaN: read, they would show."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(4, heads, 1, dim, generator=g).to(device)
    k, v = (torch.randn(4, heads, capacity, dim, generator=g).to(device) for _ in range(2))
    mask = torch.zeros(4, 1, 1, capacity, device=device)
    mask[0, ..., :100] = torch.finfo(torch.float32).min
    mask[..., last + 1:] = torch.finfo(torch.float32).min
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    k[..., last + 1:, :] = float("nan")
    v[..., last + 1:, :] = float("nan")
    got = attention_op(q, k, v, mask, torch.tensor([last], device=device), dim ** -0.5)
    diff = ((got - want).abs().max() / want.abs().max()).item()
    return diff if diff == diff else float("inf")  # NaN: a position past the filled part was read


def memory_bandwidth(device) -> float:
    """Bytes per second a large device-to-device copy moves (read + write): the bound a decode step that
    reads every weight once cannot beat."""
    n = (256 if torch.device(device).type == "cuda" else 64) * 2**20 // 4
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    sync = _synchronizer(device)
    dst.copy_(src)
    sync()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync()
    return 10 * 2 * n * 4 / (time.perf_counter() - t0)


def vllm_status() -> dict:
    """Which vLLM build is installed (from its metadata) and whether it imports, asked in a child process (a
    broken install can fail in ways that take the process with it)."""
    build = vllm_build()
    if build is None:
        return {"vllm": "not installed"}
    out, res = python_result("import json, vllm\nprint('RESULT ' + json.dumps(vllm.__version__))", timeout=300)
    why = "" if out is not None else (res.stderr or res.stdout).strip().splitlines()[-1:]
    return {"vllm": f"{build[0]} {build[1]} (runs on {build[2]})",
            "vllm_imports": True if out is not None else f"no: {why[0] if why else 'exit ' + str(res.returncode)}"}


def check_vllm(tmp: Path, device: str = "cuda") -> dict:
    """vLLM against the transformers backend: greedy tokens of a tiny random Llama (head size 32, which vLLM's
    CPU attention takes), the transformers side first (vLLM may re-decorate transformers' classes)."""
    path = str(make_tiny_model(tmp / "llama", "llama", tokenizer=build_tokenizer(), hidden=128))
    prompts = [f"Paragraph: Karvell\nKarvell is a town number {i}. Question: where?" for i in range(8)]
    hf = TransformersBackend(path, device=device, dtype="float32").generate([GenRequest(p, 16) for p in prompts])
    args = {"gpu_memory_utilization": 0.3} if device == "cuda" else {}
    vl = VLLMBackend(path, device=device, dtype="float32", engine_args=args)
    got = vl.generate([GenRequest(p, 16) for p in prompts])
    same = sum(a.token_ids == b.token_ids for a, b in zip(hf, got))
    return {"name": f"vllm == transformers (tiny llama, greedy, {device})", "same": f"{same}/{len(prompts)}",
            "ok": same == len(prompts)}


def decode_model(folder, arch: str, size: str, context: int, tok=None) -> str:
    """A random ``arch`` checkpoint for decode measurements: the released shapes (``real``: Phi-1.5's width and
    depth, the Phi-Mamba checkpoints' heads) or tiny ones, room for ``context`` tokens."""
    hidden, layers = (2048, 24) if size == "real" else (128, 4)
    return str(make_tiny_model(f"{folder}/{arch}", arch, tokenizer=tok or build_tokenizer(), hidden=hidden,
                               layers=layers, max_positions=context + 64, init_std=0.02, real_heads=size == "real"))


def decode_table(device, size: str, lengths=(512, 2048, 8192), steps: int = 16, batches=(1,),
                 archs=("phi-mamba", "hybrid-phi-mamba", "phi"), then=None) -> list[dict]:
    """``decode_rows``'s rows, all of them."""
    return list(decode_rows(device, size, lengths, steps, batches, archs, then))


def decode_rows(device, size: str, lengths=(512, 2048, 8192), steps: int = 16, batches=(1,),
                archs=("phi-mamba", "hybrid-phi-mamba", "phi"), then=None, modes=None):
    """Decode ms/token and state memory of ``archs`` (Phi-Mamba and the hybrid against Phi's KV cache; each
    also replayed from CUDA graphs on a GPU, then from graphs of the compiled step, last: its compiling may take
    what is left of a time limit) at 512 / 2k / 8k tokens, each with the memory-bandwidth bound: measured copy
    bandwidth over the bytes a step must read (every weight once, and the decoding state). ``then(arch,
    backend)``, where given, runs after each model's timings on the backend a run gets by default (graphs on a
    GPU) and on the compiled one: its rows are added to the table. Rows are yielded as measured (a caller killed
    at a time limit keeps those before). ``modes``: the ``--cuda-graphs`` settings to time (default: all three on
    a GPU, off on a CPU), and ``filled``: graphs whose attention reads the filled positions only (the
    transformers models'; a model without such graphs gets no row)."""
    dtype = "bfloat16" if device == "cuda" else "float32"
    bandwidth = memory_bandwidth(device)
    modes = modes or (("off", "on", "compiled") if device == "cuda" else ("off",))
    runs = [(a, graphs) for graphs in modes for a in archs]
    with tempfile.TemporaryDirectory() as d:
        tok = build_tokenizer()
        for arch, graphs in runs:
            backend = load_backend(decode_model(d, arch, size, max(lengths), tok), device, dtype,
                                   cuda_graphs="off" if graphs == "filled" else graphs)
            if graphs == "filled":
                # GraphedKVDecode covers the transformers backend's plain key/value families (the backend set
                # additive_masks from the same check); Phi-Mamba's graphs are its own: no row
                if not getattr(backend, "additive_masks", False):
                    del backend
                    free_memory()
                    continue
                backend.graphs = GraphedKVDecode(backend.model, capture=device == "cuda", attention="filled")
            label = arch + {"on": " (graphs)", "compiled": " (graphs, compiled)",
                            "filled": " (graphs, filled attention)"}.get(graphs, "")
            weights = sum(p.numel() * p.element_size() for p in backend.model.parameters())
            for b in batches:
                for n in lengths:
                    try:
                        sec, nbytes = decode_cost(backend, n, steps, batch=b)
                    except torch.cuda.OutOfMemoryError:
                        yield {"model": label, "batch": b, "context": n, "ms_per_step": "out of memory"}
                        torch.cuda.empty_cache()
                        continue
                    bound = b * bandwidth / (weights + nbytes)  # a step reads every weight once and every state
                    off = _graphs_off(backend, graphs)
                    yield {"model": f"{arch} ({off})" if off else label,
                           **({"batch": b} if len(batches) > 1 else {}), "context": n,
                           "ms_per_step": round(1e3 * sec, 3), "tokens_per_s": round(b / sec, 1),
                           "bound_tokens_per_s": round(bound, 1), "of_bound": round(b / sec / bound, 3),
                           "state_mib": round(nbytes / 2**20, 3),
                           **({"compile_s": round(backend.graphs.compiled.seconds, 1)}
                              if graphs == "compiled" and not off else {})}
            if then is not None and graphs in (("on", "filled", "compiled") if device == "cuda" else ("off",)):
                yield from then(arch, backend)
            del backend
            free_memory()


def _graphs_off(backend, mode: str) -> str | None:
    """Why a backend asked for graphs (or compiled ones) decoded otherwise: the row says so (None: it did not)."""
    graphs = getattr(backend, "graphs", None)
    if mode == "off" or graphs is None:
        return None if mode == "off" else "graphs off: not built"
    if graphs.disabled:
        return f"graphs off: {graphs.disabled}"
    if mode == "filled" and not graphs.filled:
        return f"graphs, filled attention off: {graphs.filled_off}"
    compiled = getattr(graphs, "compiled", None)
    if mode == "compiled" and compiled is not None and compiled.disabled:
        return f"graphs, compiled step off: {compiled.disabled}"
    return None


def free_memory() -> None:
    """Give back what dropped models held: a backend's model, its graphs and its caches can hold each other in
    reference cycles that only the collector frees (on an H100, 61 GiB of earlier checks' models were still
    held when the decode table started)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def environment() -> dict:
    env = {"python": platform.python_version(), **kernels.status(), "transformers": transformers.__version__,
           **vllm_status()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return env
