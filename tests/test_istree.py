"""IsTree data, traces, the regex tool, the small models, training and the checkpoint round trip."""
import json
import random
from collections import deque

import pytest
import torch

from evals import istree
from evals.synthetic import loss_mask
from harness.models.istree import ARCHS, build_model, trainable_parameters

# its trained models are built once, in one worker (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("test_istree")


def _connected(n, edges):
    adj = {i: set() for i in range(n)}
    for u, v in edges:
        adj[u].add(v)
        adj[v].add(u)
    seen, todo = {0}, deque([0])
    while todo:
        for w in adj[todo.popleft()] - seen:
            seen.add(w)
            todo.append(w)
    return len(seen) == n


def _has_cycle(n, edges):
    """Independent of evals.istree: a graph has a cycle iff some component has as many edges as nodes."""
    adj = {i: set() for i in range(n)}
    for u, v in edges:
        adj[u].add(v)
        adj[v].add(u)
    seen = set()
    for s in range(n):
        if s in seen:
            continue
        comp, todo = {s}, [s]
        while todo:
            for w in adj[todo.pop()] - comp:
                comp.add(w)
                todo.append(w)
        seen |= comp
        if sum(len(adj[x]) for x in comp) // 2 >= len(comp):
            return True
    return False


@pytest.mark.parametrize("graph", istree.GRAPHS)
@pytest.mark.parametrize("n", [8, 16, 33])
def test_generator_properties(graph, n):
    rng = random.Random(n)
    labels = []
    for _ in range(400):
        g = istree.GENERATORS[graph](n, rng)
        assert all(u > v for u, v in g.edges) and len(set(g.edges)) == len(g.edges)
        connected, cyclic = _connected(n, g.edges), _has_cycle(n, g.edges)
        if g.is_tree:
            assert len(g.edges) == n - 1 and connected and not cyclic
        else:
            assert not (len(g.edges) == n - 1 and connected)  # fails one of the two
            assert cyclic or not connected
        labels.append(g.is_tree)
    assert 0.35 < sum(labels) / len(labels) < 0.65  # about half and half


def test_binary_negatives_are_hard():
    rng = random.Random(0)
    for _ in range(200):
        g = istree.binary_graph(16, rng)
        assert len(g.edges) == 15  # same edge count either way: the count gives the answer away never
        if not g.is_tree:
            assert _has_cycle(16, g.edges) and not _connected(16, g.edges)


def test_cot_trace_reaches_the_right_verdict_on_1000_graphs():
    rng = random.Random(1)
    for i in range(1000):
        n = rng.choice([4, 8, 16, 32])
        g = istree.GENERATORS[rng.choice(istree.GRAPHS)](n, rng)
        trace, verdict = istree.cot_trace(g)
        assert verdict == g.is_tree
        if g.is_tree:
            assert len(trace) == 2 * n - 1 and trace[0] == trace[-1] == "0"  # an Euler tour from the root


def test_retrieval_trace_verdict_and_every_query_replays_through_the_regex_tool():
    """Every gold query's answer is the tool's, searched in this process (no worker process is started)."""
    import multiprocessing

    rng = random.Random(2)
    queries = 0
    children = {p.pid for p in multiprocessing.active_children()}
    for i in range(1000):
        n = 8 if i % 4 else 16
        g = istree.GENERATORS[istree.GRAPHS[i % 2]](n, rng)
        trace, verdict = istree.retrieval_trace(g)
        assert verdict == g.is_tree
        tool = istree.IsTreeTool(" ".join(g.tokens()))
        for j, tok in enumerate(trace):
            if tok != istree.END:
                continue
            written = " ".join(trace[: j + 1])  # everything the model wrote up to the closing tag
            pattern = istree.IsTreeTool.compile_query(written[written.rfind(istree.START) + len(istree.START):
                                                              written.rfind(istree.END)])
            assert pattern is not None  # every query is a valid tool call
            assert tool(written) == f" {trace[j + 1]}"
            queries += 1
        assert all(c["status"] in ("ok", "no_match") for c in tool.log)
    assert queries > 20_000
    assert {p.pid for p in multiprocessing.active_children()} <= children


@pytest.mark.parametrize("n,edges,is_tree,expected", [
    # a cycle through the root: the root has no "0 ~" record, so its query answers [FAILED], and since the root
    # is visited the trace ends there (the paper's code; the project used to re-enter 0 and write "0 ~ 2")
    (3, [(0, 1), (1, 2), (2, 0)], False,
     "0 S 0 ~ E F S 0 - E 1 S 1 ~ E F 1 ~ 0 1 S 1 ~ E 0 S 1 - E 0 S 1 - 0 E 2 S 2 ~ E F 2 ~ 1 "
     "2 S 2 ~ E 1 S 2 - E 1 S 2 - 1 E 0 S 0 ~ E F"),
    # a cycle away from the root: node 1's record answers, so the trace ends with "1 ~ ... 0"
    (4, [(0, 1), (1, 2), (2, 3), (3, 1)], False,
     "0 S 0 ~ E F S 0 - E 1 S 1 ~ E F 1 ~ 0 1 S 1 ~ E 0 S 1 - E 0 S 1 - 0 E 2 S 2 ~ E F 2 ~ 1 "
     "2 S 2 ~ E 1 S 2 - E 1 S 2 - 1 E 3 S 3 ~ E F 3 ~ 2 3 S 3 ~ E 2 S 3 - E 2 S 3 - 2 E 1 S 1 ~ E 0"),
    # disconnected, no cycle: the search ends having seen 2 of 4 nodes
    (4, [(0, 1), (2, 3)], False,
     "0 S 0 ~ E F S 0 - E 1 S 1 ~ E F 1 ~ 0 1 S 1 ~ E 0 S 1 - E 0 S 1 - 0 E F 0 S 0 ~ E F S 0 - 1 E F"),
    # a tree: every branch is closed by a [FAILED] next-edge query
    (3, [(1, 0), (1, 2)], True,
     "0 S 0 ~ E F S 0 - E 1 S 1 ~ E F 1 ~ 0 1 S 1 ~ E 0 S 1 - E 0 S 1 - 0 E 2 S 2 ~ E F 2 ~ 1 "
     "2 S 2 ~ E 1 S 2 - E 1 S 2 - 1 E F 1 S 1 ~ E 0 S 1 - 2 E F 0 S 0 ~ E F S 0 - 1 E F"),
])
def test_retrieval_traces_of_hand_built_graphs(n, edges, is_tree, expected):
    """Known answers, checked by hand against Algorithm 2 and against the paper's generator (which, run on
    2,000 binary graphs at each of n = 4, 6, 16, 32 from this project's generator, gave identical traces)."""
    short = {istree.START: "S", istree.END: "E", istree.FAILED: "F"}
    trace, verdict = istree.retrieval_trace(istree.Graph(n, edges))
    assert " ".join(short.get(t, t) for t in trace) == expected
    assert verdict is is_tree


def test_sample_format_and_loss_mask():
    g = istree.Graph(4, [(3, 0), (2, 0), (1, 0)])
    toks = istree.sample_tokens(g, "retrieval")
    assert toks[0] == istree.BOS and toks[-1] == istree.TRUE and toks.count(istree.EOS) == 2
    mask = loss_mask(toks)
    first_eos = toks.index(istree.EOS)
    assert not any(mask[: first_eos + 1])
    for j, t in enumerate(toks):
        if j > first_eos:
            assert mask[j] == (0 if toks[j - 1] == istree.END else 1)  # retrieved results are not targets
    assert istree.sample_tokens(g, "direct") == [istree.BOS, "3", "-", "0", "2", "-", "0", "1", "-", "0",
                                                 istree.EOS, istree.TRUE]


@pytest.mark.parametrize("size", ["0.5M", "1M", "2M", "smoke"])
def test_parameter_counts_matched_within_10_percent(size):
    counts = {a: trainable_parameters(build_model(a, size, 16 + 17)) for a in ARCHS}
    for a in ARCHS:
        assert abs(counts[a] / counts["transformer"] - 1) <= 0.10, counts
    if size == "0.5M":
        assert counts == {"transformer": 525_376, "mamba": 523_328, "hybrid": 490_880}


def test_embedding_is_frozen_sinusoidal_and_tied():
    from harness.models.istree import sinusoidal_table

    for arch in ARCHS:
        m = build_model(arch, "smoke", 25)
        emb = m.get_input_embeddings().weight
        assert not emb.requires_grad and torch.allclose(emb, sinusoidal_table(25, emb.shape[1]))
        assert trainable_parameters(m) == sum(p.numel() for n, p in m.named_parameters() if "embed" not in n)


def test_the_hybrids_unmasked_pass_is_its_causal_pass():
    """With no mask (the trainer's padded rows) the hybrid's attention runs SDPA's causal path: the same logits
    as an all-ones mask, and at every real position of a right-padded row the same as the row alone."""
    torch.manual_seed(0)
    m = build_model("hybrid", "smoke", 30).eval()
    ids = torch.randint(0, 30, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        unmasked = m(input_ids=ids).logits
        masked = m(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        alone = m(input_ids=ids[:1, :25]).logits
    assert unmasked.std() > 0 and (unmasked[0, :25] - unmasked[1, :25]).abs().max() > 1e-3  # rows differ
    torch.testing.assert_close(unmasked, masked)
    torch.testing.assert_close(unmasked[:1, :25], alone)


def _tool_free_reference(model, ids, n, eos=None):
    """Uncached greedy decoding; stops before ``eos`` as the harness does (the EOS token is not kept)."""
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax())
            if nxt == eos:
                break
            out.append(nxt)
    return out


@pytest.mark.parametrize("arch", ["mamba", "hybrid"])
def test_recurrent_stepper_blocks_and_padding_are_exact(arch):
    from harness.backends.base import GenRequest
    from harness.backends.generation import left_pad, right_pad
    from harness.backends.hf import TransformersBackend

    torch.manual_seed(0)
    model = build_model(arch, "smoke", 25).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and p.dim() > 1:
                p.normal_(0, 0.3)
    tok = istree.build_tokenizer(8)
    backend = TransformersBackend("mem", model=model, tok=tok, device="cpu", dtype="float32")
    rng = random.Random(0)
    prompts = [[rng.randrange(16, 25) for _ in range(rng.randrange(5, 20))] for _ in range(5)]
    # left-padded batch == each alone == full recompute
    batch = backend.generate([GenRequest("", 8, prompt_ids=p) for p in prompts])
    for p, r in zip(prompts, batch):
        assert r.token_ids == backend.generate([GenRequest("", 8, prompt_ids=p)])[0].token_ids
        assert r.token_ids == _tool_free_reference(model, p, 8, eos=tok.eos_token_id)
    # a right-padded multi-token block after a saved state == a fresh pass over the concatenation
    with torch.no_grad():
        ids, mask = left_pad(prompts[:3], tok.pad_token_id, "cpu")
        _, state = backend.prefill(ids, mask)
        blocks = [[17, 18, 19], [20], [21, 22]]
        b_ids, b_mask = right_pad(blocks, tok.pad_token_id, "cpu")
        got = backend.step(state, b_ids, torch.cat([mask, b_mask], 1))
        for row in range(3):
            fresh = model(input_ids=torch.tensor([prompts[row] + blocks[row]])).logits[0, -1]
            # float32: a fresh pass (full scan) and a saved state stepped token by token sum in different orders;
            # the logits here reach ~70, and differ by ~2e-4 at most
            assert torch.allclose(got[row], fresh, atol=5e-4)
        # and decoding goes on correctly from there
        mask2 = torch.cat([mask, b_mask, torch.ones(3, 1, dtype=torch.long)], 1)
        nxt = got.argmax(-1, keepdim=True)
        got2 = backend.step(state, nxt, mask2)
        for row in range(3):
            seq = prompts[row] + blocks[row] + [int(nxt[row])]
            assert torch.allclose(got2[row], model(input_ids=torch.tensor([seq])).logits[0, -1], atol=1e-4)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One tiny run per architecture: CoT at n=6, a hundred steps on the CPU (its loss falls to 0.33-0.39 of the
    first step's)."""
    from harness.training.config import TrainConfig
    from harness.training.trainer import train_one

    root = tmp_path_factory.mktemp("train")
    out = {}
    for arch in ARCHS:
        cfg = TrainConfig(arch=arch, size="smoke", nodes=6, setup="cot", samples=100 * 16, batch_size=16,
                          warmup=320, lr=3e-3, eval_every=800, eval_samples=40, eval_batch_size=40,
                          report_to="none", output=str(root / arch)).resolved()
        out[arch] = (cfg, train_one(cfg, progress=False))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_a_hundred_steps_reduce_the_loss(trained, arch):
    cfg, res = trained[arch]
    assert res["steps"] == 100
    assert res["final_loss"] < 0.6 * res["first_loss"], res
    assert res["trainable_parameters"] == trainable_parameters(build_model(arch, "smoke", 6 + 17))
    log = [json.loads(l) for l in open(f"{cfg.output}/train_log.jsonl")]
    assert log[-1]["loss"] < log[0]["loss"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_round_trip_into_the_eval_cli(trained, arch, tmp_path, capsys):
    from harness.eval import main as eval_main
    from harness.models import resolve_model

    cfg, res = trained[arch]
    assert resolve_model(cfg.output).backend == "transformers"
    out = tmp_path / "eval"
    rc = eval_main(["--model", cfg.output, "--task", "istree", "--batch-size", "8", "--device", "cpu",
                    "--dtype", "float32", "--output", str(out), "--no-progress"])
    assert rc == 0
    again = json.loads((out / "results.json").read_text())
    assert again["config"]["task_args"]["nodes"] == 6 and again["config"]["task_args"]["setup"] == "cot"
    assert again["metrics"]["n=6"]["n"] == 40
    assert again["metrics"]["n=6"]["accuracy"] == pytest.approx(res["accuracy"])  # same engine, same samples
    assert "| n=6" in capsys.readouterr().out


@pytest.mark.slow
def test_istree_scores_through_the_vllm_logic(trained, tmp_path):
    """IsTree's verdict is its stop string: the vLLM path must set it and score exactly as the stepped one."""
    from harness.backends.loading import load_backend
    from harness.engine import run_eval
    from harness.engine.config import RunConfig
    from tests.helpers import fake_vllm_backend

    cfg, _ = trained["transformer"]
    inner = load_backend(cfg.output, device="cpu", dtype="float32")
    args = json.loads(open(f"{cfg.output}/icr_task.json").read())["args"]

    def run(backend, out):
        rc = RunConfig(model=cfg.output, task="istree", task_args=args,
                       batch_size="8", device="cpu", dtype="float32", output=str(out))
        res = run_eval(rc, backend=backend, progress=False)
        return res, [json.loads(l) for l in open(out / "samples.jsonl")]

    stepped, a = run(inner, tmp_path / "stepped")
    chunked, b = run(fake_vllm_backend(inner), tmp_path / "vllm")
    assert [(r["generation"], r["prediction"]) for r in a] == [(r["generation"], r["prediction"]) for r in b]
    assert chunked["metrics"]["n=6"]["accuracy"] == stepped["metrics"]["n=6"]["accuracy"] > 0.5
    assert chunked["metrics"]["n=6"]["answer_found"] > 0.9  # verdicts found: the stop string was kept


@pytest.mark.slow
def test_a_fresh_process_evaluates_a_trained_hybrid(trained, tmp_path):
    """Regression: the hybrid's config type was registered only when the trainer's models were imported, so
    ``harness.eval`` in a new process could not load a hybrid checkpoint."""
    import subprocess
    import sys
    from pathlib import Path

    cfg, _ = trained["hybrid"]
    res = subprocess.run([sys.executable, "-m", "harness.eval", "--model", cfg.output, "--task", "istree",
                          "--limit", "4", "--device", "cpu", "--output", str(tmp_path / "e"), "--no-progress"],
                         cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((tmp_path / "e" / "results.json").read_text())["metrics"]["n=6"]["n"] == 4
