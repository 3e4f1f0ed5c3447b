import json

import pytest
import torch

from harness.backends.base import GenRequest
from harness.models import resolve_model
from harness.models.phi_mamba import PhiMambaConfig, PhiMambaForCausalLM, ssd_chunked, ssd_step
from tests.helpers import assert_varied
from tests.helpers import EchoTool, diverse_prompts, reference_greedy


@pytest.mark.parametrize("length,chunk", [(37, 8), (64, 16), (5, 16), (130, 128)])
def test_chunked_scan_equals_recurrence(length, chunk):
    g = torch.Generator().manual_seed(length)
    b, h, p, n = 2, 3, 4, 5
    x, B, C = (torch.randn(b, length, h, k, generator=g) for k in (p, n, n))
    log_a = -torch.rand(b, length, h, generator=g)
    h0 = torch.randn(b, h, p, n, generator=g)
    y, hf = ssd_chunked(x, log_a, B, C, h0, chunk)
    state, ys = h0.clone(), []
    for t in range(length):
        yt, state = ssd_step(x[:, t], log_a[:, t], B[:, t], C[:, t], state)
        ys.append(yt)
    assert torch.allclose(y, torch.stack(ys, 1), atol=1e-4)
    assert torch.allclose(hf, state, atol=1e-4)


@pytest.mark.parametrize("attn_layers", [[], [1]])
def test_model_prefill_equals_token_by_token_logits(attn_layers):
    torch.manual_seed(0)
    m = PhiMambaForCausalLM(PhiMambaConfig.tiny(300, n_layer=3, attn_layers=attn_layers, chunk_size=8)).eval()
    ids = torch.randint(0, 300, (2, 29))  # not a multiple of the chunk size
    with torch.no_grad():
        full, _ = m(ids)
        state, steps = m.init_state(2), []
        for t in range(29):
            logits, state = m(ids[:, t:t + 1], torch.ones(2, t + 1, dtype=torch.long), state)
            steps.append(logits[:, 0])
    assert (full - torch.stack(steps, 1)).abs().max() < 1e-4


def test_all_attention_stack_equals_transformers_phi():
    """With every layer attention, the architecture is exactly Phi: load the same weights into
    transformers' PhiForCausalLM and compare logits. This pins the block layout, the rotary variant and
    the parameter naming of the hybrid's attention layers."""
    from transformers import PhiConfig, PhiForCausalLM

    torch.manual_seed(0)
    cfg = PhiMambaConfig.tiny(256, d_model=64, n_layer=2, attn_layers=[0, 1])
    ours = PhiMambaForCausalLM(cfg).eval()
    hf = PhiForCausalLM(PhiConfig(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                  num_attention_heads=4, partial_rotary_factor=0.5, rope_theta=10000.0,
                                  max_position_embeddings=512, attn_implementation="eager")).eval()
    mapping = {"model.embed_tokens.weight": "backbone.embedding.weight",
               "model.final_layernorm.weight": "backbone.final_layernorm.weight",
               "model.final_layernorm.bias": "backbone.final_layernorm.bias",
               "lm_head.weight": "lm_head.weight", "lm_head.bias": "lm_head.bias"}
    for i in range(2):
        for part in ("q_proj", "k_proj", "v_proj", "dense"):
            for t in ("weight", "bias"):
                mapping[f"model.layers.{i}.self_attn.{part}.{t}"] = f"backbone.layers.{i}.mixer.self_attn.{part}.{t}"
        for part in ("mlp.fc1", "mlp.fc2", "input_layernorm"):
            for t in ("weight", "bias"):
                mapping[f"model.layers.{i}.{part}.{t}"] = f"backbone.layers.{i}.{part}.{t}"
    ours_sd = ours.state_dict()
    hf.load_state_dict({k: ours_sd[v] for k, v in mapping.items()}, strict=True)
    ids = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        assert torch.allclose(ours(ids)[0], hf(ids).logits, atol=1e-4)


@pytest.mark.parametrize("which", ["phi_mamba", "hybrid"])
def test_left_padded_batch_equals_each_prompt_alone(which, request):
    backend = request.getfixturevalue(f"{which}_backend")
    prompts = diverse_prompts(6, seed=5)
    batch = backend.generate([GenRequest(p, 12) for p in prompts])
    alone = [backend.generate([GenRequest(p, 12)])[0] for p in prompts]
    assert_varied([r.token_ids for r in batch])
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone]


@pytest.mark.parametrize("which", ["phi_mamba", "hybrid"])
def test_rows_that_join_a_running_batch_write_what_static_batches_write(which, request):
    """Continuous batching over Phi-Mamba's own state (the hybrid's KV buffers cut and left-padded at each join),
    the joining rows prefilled by each plan: rows of several budgets, with tool results of several lengths, write
    what static batches and each row alone write."""
    backend = request.getfixturevalue(f"{which}_backend")
    prompts = diverse_prompts(9, seed=21)

    def requests():
        return [GenRequest(p, 4 + 5 * (i % 3), tool=EchoTool(" ", i) if i % 2 else None)
                for i, p in enumerate(prompts)]

    seen = []
    join = backend.join
    backend.join = lambda states, cuts: seen.append(list(cuts)) or join(states, cuts)
    try:
        runs = {(batch, how, reuse): backend.generate_all(requests(), batch_size=batch, prefix_reuse=reuse,
                                                          batching=how)
                for batch, how, reuse in ((1, "static", "none"), (3, "static", "none"), (3, "continuous", "none"),
                                          (3, "continuous", "tree-rows"),
                                          (3, "continuous", "tree-block"))}  # each plan prefills the rows that join
        outs = {k: g.results(len(prompts)) for k, g in runs.items()}
    finally:
        del backend.join
    results = {k: [(r.token_ids, r.tool_spans) for r in out] for k, out in outs.items()}
    assert [g.plan.batching for g in runs.values()] == ["static"] * 2 + ["continuous"] * 3
    assert [g.plan.ran for g in runs.values()][2:] == ["none", "tree-rows", "tree-block"]
    alone = results[1, "static", "none"]
    assert_varied(alone)
    assert len({len(r.tool_spans) for r in outs[1, "static", "none"]}) > 1  # rows with calls beside rows without
    assert all(got == alone for got in results.values())
    assert any(cut > 0 for cuts in seen for _, cut, _ in cuts) and any(pad > 0 for cuts in seen for _, _, pad in cuts)


@pytest.mark.parametrize("which", ["phi_mamba", "hybrid"])
def test_a_joined_batch_steps_as_each_row_alone(which, request):
    """The join itself, to float32 rounding: a running batch whose long row has left (its leading columns masked
    in every row left, so they are cut) joined to a batch of longer prompts (so it is left-padded), then stepped:
    each row's logits are those of its sequence run alone. (The tiny hybrid's attention moves logits too little
    to change its greedy tokens, so tokens alone would not see a misplaced key.)"""
    from harness.backends.generation import join_masks, left_pad

    backend = request.getfixturevalue(f"{which}_backend")
    tok = backend.tokenizer
    ids = [tok(p)["input_ids"] for p in diverse_prompts(4, seed=3)]
    ids[0], ids[1] = ids[0] + ids[1], ids[1][:40]  # the first batch's long row leaves; the second's are longer
    with torch.no_grad():
        first, first_mask = left_pad(ids[:2], 0, "cpu")
        _, state = backend.prefill(first, first_mask)
        state, first_mask = backend.select(state, torch.tensor([1])), first_mask[1:]
        second, second_mask = left_pad(ids[2:], 0, "cpu")
        mask, cuts = join_masks([first_mask, second_mask])
        assert cuts[0][1] > 0 and cuts[0][2] > 0, cuts  # the first batch is cut and padded
        state = backend.join([state, backend.prefill(second, second_mask)[1]], cuts)
        nxt = torch.tensor([[5], [6], [7]])
        got = backend.step(state, nxt, torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1))
        for row, seq in enumerate(ids[1:]):
            alone = backend.model(torch.tensor([seq + [5 + row]]))[0][0, -1]
            assert torch.allclose(got[row], alone, atol=1e-4), (row, (got[row] - alone).abs().max())


@pytest.mark.parametrize("which", ["phi_mamba", "hybrid"])
def test_greedy_equals_full_recompute(which, request):
    """The cached/recurrent loop against greedy by full passes over the growing sequence (no state reuse)."""
    backend = request.getfixturevalue(f"{which}_backend")

    class _Shim:  # reference_greedy expects an HF-style model returning .logits
        def __init__(self, m):
            self.m = m

        def __call__(self, input_ids):
            return type("O", (), {"logits": self.m(input_ids)[0]})

    shim = type("B", (), {"tokenizer": backend.tokenizer, "model": _Shim(backend.model)})
    for p in diverse_prompts(3, seed=9):
        with torch.no_grad():
            assert backend.generate([GenRequest(p, 8)])[0].token_ids == reference_greedy(shim, p, 8)


@pytest.mark.parametrize("which", ["phi_mamba", "hybrid"])
def test_decode_from_saved_state_after_appending_tokens(which, request):
    """Prefill a prompt, save the state, append tokens (as the retrieval tool does) as one right-padded block
    in a batch with a shorter row, and compare the next logits with a fresh pass over the concatenation."""
    backend = request.getfixturevalue(f"{which}_backend")
    m, tok = backend.model, backend.tokenizer
    a, b = diverse_prompts(2, seed=13)
    ids_a, ids_b = tok(a)["input_ids"][:50], tok(b)["input_ids"][:30]
    extra_a, extra_b = tok(" <result>Karvell: a town</result>")["input_ids"], tok(" so")["input_ids"]
    with torch.no_grad():
        from harness.backends.generation import left_pad, right_pad

        ids, mask = left_pad([ids_a, ids_b], 0, "cpu")
        _, state = backend.prefill(ids, mask)
        block, bmask = right_pad([extra_a, extra_b], 0, "cpu")
        got = backend.step(state, block, torch.cat([mask, bmask], 1))
        for row, seq in enumerate((ids_a + extra_a, ids_b + extra_b)):
            fresh = m(torch.tensor([seq]))[0][0, -1]
            assert torch.allclose(got[row], fresh, atol=1e-4)


@torch.no_grad()
def test_kv_cache_is_written_in_place_and_grows_rarely():
    """300 decode steps after a 40-token prompt: the KV buffer is reallocated twice (prefill, then one growth
    by >= 256 positions), logits equal a full recompute, and the state's size counts only filled positions."""
    torch.manual_seed(0)
    model = PhiMambaForCausalLM(PhiMambaConfig.tiny(97, d_model=32, n_layer=2, attn_layers=(1,))).eval()
    ids = torch.randint(0, 97, (1, 40))
    mask = torch.ones_like(ids)
    _, state = model(ids, mask)
    buffers, seq = set(), ids
    for _ in range(300):
        nxt = torch.randint(0, 97, (1, 1))
        seq, mask = torch.cat([seq, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
        logits, state = model(nxt, mask, state)
        buffers.add(state.layers[1]["k"].data_ptr())
    assert len(buffers) == 2 and state.layers[1]["len"] == 340 and state.layers[1]["k"].shape[2] >= 340
    full, _ = model(seq, torch.ones_like(seq))
    assert torch.allclose(logits[:, -1], full[:, -1], atol=1e-4)
    kv = 2 * 340 * 32 * 4  # k and v, 340 positions, d_model 32, float32
    recurrent = sum(v.numel() * 4 for v in state.layers[0].values())
    assert state.nbytes() == kv + recurrent


def _graph_test_model(attn_layers):
    torch.manual_seed(0)
    model = PhiMambaForCausalLM(PhiMambaConfig.tiny(97, d_model=32, n_layer=2, attn_layers=attn_layers)).eval()
    for p in model.parameters():
        if p.dim() >= 2:
            p.normal_(0.0, 0.5)
    return model


def _assert_same_state(plain, graphed):
    for a, b in zip(plain.layers, graphed.layers):
        if "k" in a:  # a KV cache: its filled part (the buffers' capacities differ)
            assert a["len"] == b["len"]
            for name in ("k", "v"):
                assert torch.allclose(a[name][:, :, : a["len"]], b[name][:, :, : b["len"]], atol=1e-4, rtol=1e-4)
        else:
            assert all(torch.allclose(a[k], b[k], atol=1e-4, rtol=1e-4) for k in a)
    assert torch.equal(plain.pos, graphed.pos)


def _step_both(model, decode, plain, graphed, tok, mask):
    """One decode step on both paths; the graphed logits must equal the plain step's (up to the rounding of
    GEMMs over a batch padded to its bucket, and of attention over a masked fixed capacity)."""
    want, plain = model(tok, mask, plain)
    got = decode(graphed, tok, mask)
    assert torch.allclose(got, want[:, -1], atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want[:, -1].argmax(-1))
    _assert_same_state(plain, graphed)
    return want[:, -1].argmax(-1, keepdim=True)


@torch.no_grad()
@pytest.mark.parametrize("attn_layers", [[], [1]])
def test_graphed_decode_buffers_equal_the_plain_step(attn_layers):
    """The CUDA-graph decoder's static-buffer logic, run eagerly: a left-padded batch of 3 (bucket 4), then 2
    rows (bucket 2), then 1, gives the plain step's logits and state; only capture/replay needs CUDA."""
    from harness.backends.generation import left_pad
    from harness.models.decode_graphs import GraphedDecode

    model = _graph_test_model(attn_layers)
    ids, mask = left_pad([[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15]], 0, "cpu")
    _, plain = model(ids, mask)
    _, graphed = model(ids, mask)
    decode = GraphedDecode(model, capture=False)
    tok = torch.tensor([[1], [2], [3]])
    seen = set()
    for keep in (None, torch.tensor([0, 2]), torch.tensor([1])):
        if keep is not None:
            plain, graphed, tok, mask = plain.select(keep), graphed.select(keep), tok[keep], mask[keep]
        for _ in range(3):
            mask = torch.cat([mask, torch.ones_like(tok)], 1)
            tok = _step_both(model, decode, plain, graphed, tok, mask)
            seen.update(tok[:, 0].tolist())
    assert len(seen) > 3  # the compared steps decode different tokens, not one repeated token
    assert sorted(rows for rows, _ in decode.cache.graphs) == [1, 2, 4]


def test_kv_capacity_buckets_are_few_and_tight():
    from harness.cuda_graphs import capacity_bucket

    caps = [capacity_bucket(n) for n in range(1, 8193)]
    assert all(c >= n and c % 64 == 0 for n, c in enumerate(caps, 1))
    assert all(c <= 1.25 * n for n, c in enumerate(caps, 1) if n > 256)
    assert caps == sorted(caps) and len(set(caps)) == 21


@torch.no_grad()
def test_graphed_hybrid_kv_cache_resident_grown_and_handed_over():
    """The hybrid's fixed-capacity KV cache: after the first step the state's cache *is* the static cache (no
    per-step copy); a multi-token eager block (a tool result, right-padded with a hole in one row) writes into
    it in place; crossing 256 positions grows it to the next capacity bucket; and a second state taking the
    graphs over leaves the first one intact (its cache is copied out first)."""
    from harness.backends.generation import left_pad
    from harness.models.decode_graphs import GraphedDecode

    model = _graph_test_model([1])
    decode = GraphedDecode(model, capture=False)
    g = torch.Generator().manual_seed(3)
    ids, mask = left_pad([torch.randint(1, 97, (n,), generator=g).tolist() for n in (240, 200)], 0, "cpu")
    _, plain = model(ids, mask)
    _, graphed = model(ids, mask)
    tok, seen = torch.tensor([[1], [2]]), set()
    for _ in range(4):
        mask = torch.cat([mask, torch.ones_like(tok)], 1)
        tok = _step_both(model, decode, plain, graphed, tok, mask)
        seen.update(tok[:, 0].tolist())
    static_k = decode.buffers.kv(1, "k")
    assert graphed.layers[1]["k"].data_ptr() == static_k.data_ptr()  # resident: views of the static cache
    static_ssm = decode.buffers.state.layers[0]["ssm"]
    assert graphed.layers[0]["ssm"].data_ptr() == static_ssm.data_ptr()  # the recurrent state too

    # a tool result: row 0 gets 3 tokens, row 1 one token and 2 pads, through the eager model step
    block = torch.tensor([[tok[0, 0], 7, 8], [tok[1, 0], 0, 0]])
    mask = torch.cat([mask, torch.tensor([[1, 1, 1], [1, 0, 0]])], 1)
    want, plain = model(block, mask, plain)
    got, graphed = model(block, mask, graphed)
    assert torch.allclose(got, want, atol=1e-4) and graphed.layers[1]["k"].data_ptr() == static_k.data_ptr()
    tok = torch.stack([want[0, -1].argmax(), want[1, 0].argmax()])[:, None]  # each row's last real position

    # a second state (one row) takes the graphs over between two steps of the first
    other_ids = torch.randint(1, 97, (1, 30), generator=g)
    _, other_plain = model(other_ids)
    _, other_graphed = model(other_ids)
    other_mask, other_tok = torch.ones(1, 30, dtype=torch.long), torch.tensor([[4]])
    for _ in range(20):  # 240 + 4 + 3 + 20 > 256: the first state's steps cross into the next bucket (320)
        mask = torch.cat([mask, torch.ones_like(tok)], 1)
        tok = _step_both(model, decode, plain, graphed, tok, mask)
        other_mask = torch.cat([other_mask, torch.ones_like(other_tok)], 1)
        other_tok = _step_both(model, decode, other_plain, other_graphed, other_tok, other_mask)
        seen.update(tok[:, 0].tolist())
    assert len(seen) > 3
    # growing the static cache dropped the graphs over the old one; the second state's were captured again
    assert decode.buffers.capacity == 320 and set(decode.cache.graphs) == {(2, 320), (1, 256)}
    with pytest.raises(ValueError, match="attention mask covers"):
        decode(graphed, tok, mask[:, 1:])


@torch.no_grad()
@pytest.mark.parametrize("which", ["phi_mamba", "hybrid"])
def test_graphed_decode_in_the_generation_loop_gives_the_eager_tokens(which, request):
    """The backend's decode loop with the static-buffer decoder (run eagerly) gives the eager tokens, through
    what a run does to a state: a shared prefix copied into every row, rows prefilled through the prefix tree
    and merged, tool results fed as multi-token blocks, and rows leaving the batch at different lengths."""
    from harness.models.decode_graphs import GraphedDecode
    from retrieval import RetrievalTool
    from tests.helpers import UNITS

    backend = request.getfixturevalue(f"{which}_backend")
    base = diverse_prompts(1, seed=21)[0]
    prompts = [base + s for s in ("alpha", "beta gamma", "delta", "epsilon zeta", "eta")]
    limits = (10, 24, 16, 24, 6)
    free = backend.generate([GenRequest(p, 24) for p in prompts])

    def reqs():
        return [GenRequest(p, n, tool=RetrievalTool(UNITS, call_open=f.text[0:2], call_close=f.text[5:8]))
                for p, n, f in zip(prompts, limits, free)]

    eager = backend.generate(reqs(), prefix_reuse="batch")
    backend.graphs = GraphedDecode(backend.model, capture=False)
    try:
        graphed = backend.generate(reqs(), prefix_reuse="batch")
        buckets = sorted(rows for rows, _ in backend.graphs.cache.graphs)
        tree = backend.generate(reqs(), prefix_reuse="tree-rows")
        tree_block = backend.generate(reqs(), prefix_reuse="tree-block")
    finally:
        backend.graphs = None
    assert_varied([r.token_ids for r in eager])
    assert [r.token_ids for r in graphed] == [r.token_ids for r in eager] == [r.token_ids for r in tree] == \
        [r.token_ids for r in tree_block]
    assert sum(len(r.tool_spans) for r in eager) >= 2
    assert len(buckets) >= 2  # the batch shrank through buckets


@torch.no_grad()
@pytest.mark.parametrize("which", ["phi_mamba", "hybrid"])
def test_one_graphed_backend_serves_batch_sizes_and_contexts_in_turn(which, request):
    """One graphed decoder through batch 1, then a larger batch and longer prompts (its buffers grow, its graphs
    are dropped), then batch 1 again: eager's tokens every time, and every new set of buffers captures into a
    new memory pool (capturing into a dropped set's pool crashed PyTorch's allocator on an H200)."""
    from harness.models.decode_graphs import GraphedDecode

    backend = request.getfixturevalue(f"{which}_backend")
    prompts = diverse_prompts(9, seed=5)
    runs = [prompts[:1], prompts[1:9], [p * 3 for p in prompts[1:3]], prompts[8:9]]
    eager = [[r.token_ids for r in backend.generate([GenRequest(p, 12) for p in run])] for run in runs]
    backend.graphs = decoder = GraphedDecode(backend.model, capture=torch.cuda.is_available()
                                             and backend.device.type == "cuda")
    try:
        pools = []
        for run, want in zip(runs, eager):
            assert [r.token_ids for r in backend.generate([GenRequest(p, 12) for p in run])] == want
            pools.append(decoder.cache.pools)
    finally:
        backend.graphs = None
    assert_varied([t for run in eager for t in run])
    assert pools[1] > pools[0] and pools[3] == pools[2]  # grown: a new pool; reused at batch 1: the same one


def test_hybrid_places_attention_at_configured_layers(tiny_hybrid_dir):
    cfg = json.loads(open(f"{tiny_hybrid_dir}/config.json").read())
    assert [cfg[k]["CoreType"] for k in sorted(k for k in cfg if k.startswith("Block"))] == \
        ["modules.mixers.discrete_mamba2", "modules.mixers.phi_attention"]
    m = PhiMambaForCausalLM.from_pretrained(tiny_hybrid_dir)
    kinds = ["attn" if blk.attention else "mamba" for blk in m.backbone.layers]
    assert kinds == ["mamba", "mamba", "attn"]
    c = PhiMambaConfig.tiny(64, n_layer=6, attn_layers=[1, 4])
    again = PhiMambaConfig.from_goombalab(c.to_goombalab())
    assert again.attn_layers == [1, 4] and again.n_layer == 6


def test_registry_routes_checkpoint_to_phi_mamba_backend(tiny_phi_mamba_dir, phi_mamba_backend):
    assert resolve_model(tiny_phi_mamba_dir).backend == "phi-mamba"
    assert phi_mamba_backend.max_context is None  # no attention: no position limit
    assert phi_mamba_backend.describe().scan == "pytorch reference"


@pytest.mark.parametrize("edit,message", [
    (lambda sd: sd.pop("backbone.layers.1.mixer.D"), "missing from the checkpoint: backbone.layers.1.mixer.D"),
    (lambda sd: sd.__setitem__("backbone.layers.0.mixer.extra", torch.zeros(1)), "unexpected in the checkpoint: backbone.layers.0.mixer.extra"),
    (lambda sd: sd.__setitem__("lm_head.bias", torch.zeros(3)), "shape mismatch: lm_head.bias"),
])
def test_strict_loading_names_the_bad_key(tiny_phi_mamba_dir, tmp_path, edit, message):
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path / "ckpt"
    shutil.copytree(tiny_phi_mamba_dir, d)
    sd = load_file(str(d / "model.safetensors"))
    edit(sd)
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        PhiMambaForCausalLM.from_pretrained(str(d))


def _real_config(hybrid: bool) -> dict:
    """The checkpoints' config.json layout: Phi-Mamba is one block of 24 discrete Mamba-2 layers; the hybrid
    splits the stack into runs with Phi attention cores (here 4 layers, as a stand-in placement: the real
    placement is read from the checkpoint's own config.json, never assumed by the code)."""
    mamba = {"BlockType": "modules.phi_block", "block_input": {"resid_dropout": 0.0},
             "CoreType": "modules.mixers.discrete_mamba2",
             "core_input": {"d_state": 64, "n_v_heads": 32, "n_qk_heads": 32, "d_conv": 4, "conv_bias": True,
                            "expand": 1, "chunk_size": 128, "activation": "identity", "bias": False}}
    attn = {"BlockType": "modules.phi_block", "block_input": {"resid_dropout": 0.0},
            "CoreType": "modules.mixers.phi_attention", "core_input": {}}
    cfg = {"LanguageModel": {"input": {"vocab_size": 51200, "pad_vocab_size_multiple": 8}},
           "MixerModel": {"input": {"d_model": 2048, "n_layer": 24, "lm_head_prenorm": "layer"}}}
    if not hybrid:
        cfg["Block1"] = {"n_layers": 24, **mamba}
    else:
        runs = [(mamba, 5), (attn, 1), (mamba, 5), (attn, 1), (mamba, 5), (attn, 1), (mamba, 5), (attn, 1)]
        for i, (kind, n) in enumerate(runs, 1):
            cfg[f"Block{i}"] = {"n_layers": n, **kind}
    return cfg


@pytest.mark.parametrize("hybrid", [False, True])
def test_real_1_5b_parameter_names_and_shapes(hybrid):
    cfg = PhiMambaConfig.from_goombalab(_real_config(hybrid))
    with torch.device("meta"):
        model = PhiMambaForCausalLM(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    expected_layer_mamba = {
        "input_layernorm.weight": (2048,), "input_layernorm.bias": (2048,),
        "mixer.in_proj.weight": (2 * 2048 + 2 * 32 * 64 + 32, 2048),  # x, z, B, C, per-head A_log
        "mixer.z_bias": (2048,), "mixer.conv1d.weight": (2048 + 2 * 32 * 64, 1, 4),
        "mixer.conv1d.bias": (2048 + 2 * 32 * 64,), "mixer.D": (32,), "mixer.out_proj.weight": (2048, 2048),
        "mlp.fc1.weight": (8192, 2048), "mlp.fc1.bias": (8192,), "mlp.fc2.weight": (2048, 8192), "mlp.fc2.bias": (2048,),
    }
    expected_layer_attn = {
        "input_layernorm.weight": (2048,), "input_layernorm.bias": (2048,),
        **{f"mixer.self_attn.{p}.{t}": ((2048, 2048) if t == "weight" else (2048,))
           for p in ("q_proj", "k_proj", "v_proj", "dense") for t in ("weight", "bias")},
        "mlp.fc1.weight": (8192, 2048), "mlp.fc1.bias": (8192,), "mlp.fc2.weight": (2048, 8192), "mlp.fc2.bias": (2048,),
    }
    attn_layers = {5, 11, 17, 23} if hybrid else set()
    expected = {"backbone.embedding.weight": (51200, 2048), "backbone.final_layernorm.weight": (2048,),
                "backbone.final_layernorm.bias": (2048,), "lm_head.weight": (51200, 2048), "lm_head.bias": (51200,)}
    for i in range(24):
        layer = expected_layer_attn if i in attn_layers else expected_layer_mamba
        expected.update({f"backbone.layers.{i}.{k}": v for k, v in layer.items()})
    assert shapes == expected
    n_params = sum(v.numel() for v in model.parameters())
    assert 1.3e9 < n_params < 1.6e9


def test_hybrid_attention_is_built_as_the_official_code_builds_it(caplog):
    """goombalab/phi-mamba builds attention from Phi-1.5's defaults whatever core_input says; so does the
    loader, naming what it ignores. The project's own checkpoints (marked) keep their core_input."""
    from harness.models.phi_mamba import OWN_MARKER, PhiMambaConfig

    own = PhiMambaConfig.tiny(vocab_size=100, d_model=64, n_layer=3, attn_layers=[1])
    cfg = own.to_goombalab()
    assert PhiMambaConfig.from_goombalab(cfg).num_attention_heads == 4  # marked: honoured
    official = {k: v for k, v in cfg.items() if k != OWN_MARKER}
    official["Block2"]["core_input"].update(num_attention_heads=16, rope_theta=500000.0)
    got = PhiMambaConfig.from_goombalab(official)
    assert (got.num_attention_heads, got.rope_theta, got.partial_rotary_factor, got.max_position_embeddings) == \
        (32, 10000.0, 0.5, 2048)
    assert got.ignored_core_input["num_attention_heads"] == 16 and got.ignored_core_input["rope_theta"] == 500000.0
    assert "num_attention_heads=16" in caplog.text and "rope_theta=500000.0" in caplog.text


def test_goombalab_folders_default_to_phi_tokenizer_and_take_tokenizer_flag(tiny_phi_mamba_dir, tmp_path, capsys):
    import shutil

    from harness.eval import main as eval_main
    from harness.models import TOKENIZER_FILES

    bare = tmp_path / "goombalab-style"
    shutil.copytree(tiny_phi_mamba_dir, bare)
    for f in TOKENIZER_FILES:
        (bare / f).unlink(missing_ok=True)
    assert resolve_model(str(bare)).tokenizer == "microsoft/phi-1_5"
    assert resolve_model(tiny_phi_mamba_dir).tokenizer is None  # has its own
    base = ["--model", str(bare), "--task", "hotpotqa", "--data", "fixture", "--limit", "2", "--max-new-tokens", "4", "--no-progress"]
    assert eval_main([*base, "--output", str(tmp_path / "a")]) == 2  # offline: Phi-1.5's tokenizer is not here
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "carries no tokenizer" in err and "--tokenizer" in err
    assert eval_main([*base, "--tokenizer", tiny_phi_mamba_dir, "--output", str(tmp_path / "b")]) == 0


def test_dtype_auto_is_float32_for_the_phi_mamba_family():
    from harness.backends import backend_class
    from harness.backends.base import resolve_dtype

    phi_mamba, hf = backend_class("phi-mamba"), backend_class("transformers")
    assert phi_mamba.float32_default and not hf.float32_default  # a capability of the class, asked by generic code
    assert resolve_dtype("auto", torch.device("cuda"), phi_mamba.float32_default) == torch.float32
    assert resolve_dtype("auto", torch.device("cpu"), hf.float32_default) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu"), phi_mamba.float32_default) == torch.bfloat16


def test_real_head_shapes_for_speed_measurements(tmp_path, tiny_tokenizer):
    """The decode benchmark's `real` models: the released checkpoints' heads, the hybrid's attention at layers
    5, 11, ... , written and read back through the goombalab format."""
    from harness.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "h", "hybrid-phi-mamba", tokenizer=tiny_tokenizer, hidden=128, layers=12,
                           max_positions=9000, real_heads=True)
    cfg = PhiMambaForCausalLM.from_pretrained(str(path)).config
    assert (cfg.attn_layers, cfg.n_qk_heads, cfg.n_v_heads, cfg.d_state, cfg.num_attention_heads) == ([5, 11], 32, 32,
                                                                                                      64, 32)
    assert cfg.max_position_embeddings == 9000 and not cfg.ignored_core_input
