"""IsTree: decide whether a graph on n nodes is a tree (the paper's synthetic in-context retrieval task).

Formats follow the paper's public code (the facts: ``docs/istree.md``); sequences are whitespace-separated
tokens so one WordLevel tokenizer serves training (ids built directly) and the eval engine (text):

    direct     [BOS] u - v u - v ... [EOS] [TRUE]
    cot        [BOS] edges [EOS] DFS Euler tour (Algorithm 1) [EOS] [TRUE]
    retrieval  [BOS] edges [EOS] trace with [STARTSEARCH] query [ENDSEARCH] result ... [EOS] [TRUE]

Retrieval queries (Algorithm 2) and their meaning, each answered by one Python ``re`` search through the
project's retrieval machinery (``retrieval.RegexSearcher``, ``retrieval.parse_call``):
    v ~      the X of the first record "v ~ X" already in the trace (v's DFS parent), else [FAILED]
    v -      the other end of the first edge in the input list that contains v
    v - u    the other end of the next edge containing v after the edge {u, v}, else [FAILED]
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from evals.base import Instance, OptionError, TextInstance, ToolSpec, word_level_tokenizer
from evals.registry import register_task
from evals.synthetic import SyntheticTask
from retrieval.search import InProcessSearcher
from retrieval.tool import parse_call

SPECIAL = ["[", "]", ",", "-", "[PAD]", "[EOS]", "[TRUE]", "[FALSE]", "[SPACE]", "[NEWLINE]", "[UNK]", "[BOS]",
           "[STARTSEARCH]", "[ENDSEARCH]", "[FAILED]", "~"]  # 16, then node names 0..n: n + 17 tokens
BOS, EOS, PAD, TRUE, FALSE = "[BOS]", "[EOS]", "[PAD]", "[TRUE]", "[FALSE]"
START, END, FAILED = "[STARTSEARCH]", "[ENDSEARCH]", "[FAILED]"
SETUPS = ("direct", "cot", "retrieval")
GRAPHS = ("binary", "recursive")


def vocabulary(n: int) -> list[str]:
    return SPECIAL + [str(i) for i in range(n + 1)]


def build_tokenizer(n: int):
    return word_level_tokenizer(vocabulary(n))


# ------------------------------------------------------------------------------------------ graphs
@dataclass
class Graph:
    n: int
    edges: list[tuple[int, int]]  # (u, v) with u > v, in the (shuffled) order they are written

    @property
    def is_tree(self) -> bool:
        return is_tree(self.n, self.edges)

    def tokens(self) -> list[str]:
        return [t for u, v in self.edges for t in (str(u), "-", str(v))]


def is_tree(n: int, edges) -> bool:
    """n - 1 edges and no cycle (union-find), which together mean connected and acyclic."""
    if len(edges) != n - 1:
        return False
    parent = list(range(n))

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for u, v in edges:
        ru, rv = find(u), find(v)
        if ru == rv:
            return False
        parent[ru] = rv
    return True


def _finish(n, pairs, rng) -> Graph:
    edges = [(max(u, v), min(u, v)) for u, v in pairs]
    rng.shuffle(edges)
    return Graph(n, edges)


def binary_graph(n: int, rng: random.Random) -> Graph:
    """Two stars plus one edge between consecutive shuffled non-centres: a tree when it joins the stars,
    otherwise a triangle and two components (a hard negative: n - 1 edges either way)."""
    if n < 4:
        raise ValueError("binary IsTree graphs need at least 4 nodes")
    nodes = list(range(n))
    rng.shuffle(nodes)
    c1, c2 = nodes[0], nodes[1]
    pairs = [(x, rng.choice((c1, c2))) for x in nodes[2:]]
    i = rng.randint(2, n - 2)
    pairs.append((nodes[i], nodes[i + 1]))
    return _finish(n, pairs, rng)


def recursive_graph(n: int, rng: random.Random) -> Graph:
    """Half random recursive trees; half the same with one random edge moved inside one of the two parts its
    removal leaves, which closes a cycle and disconnects the graph (still n - 1 edges, so the label is
    tree-ness). Not the paper's second graph type ("random"): that one has up to n edges and labels a graph by
    whether it is connected, so a connected graph with a cycle is labelled a tree; it is not offered here."""
    nodes = list(range(n))
    rng.shuffle(nodes)
    pairs = [(nodes[i], nodes[rng.randrange(i)]) for i in range(1, n)]
    if rng.random() < 0.5:
        return _finish(n, pairs, rng)
    while True:
        cut = pairs.pop(rng.randrange(len(pairs)))
        part = _component(cut[0], pairs)
        side = part if len(part) >= 3 else set(nodes) - part
        present = {frozenset(p) for p in pairs}
        options = [(u, v) for u in side for v in side if u < v and frozenset((u, v)) not in present]
        if options:
            pairs.append(rng.choice(sorted(options)))
            return _finish(n, pairs, rng)
        pairs.append(cut)  # both parts too small to hold a cycle: cut another edge


def _component(start: int, pairs) -> set[int]:
    adj = _adjacency(pairs)
    seen, todo = {start}, [start]
    while todo:
        for w in adj.get(todo.pop(), []):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


GENERATORS = {"binary": binary_graph, "recursive": recursive_graph}


# ------------------------------------------------------------------------------------------ traces
def _adjacency(pairs, n: int = 0) -> dict[int, list[int]]:
    """Neighbours in the order their edges are listed (the DFS order of Algorithm 1)."""
    adj: dict[int, list[int]] = {i: [] for i in range(n)}
    for u, v in pairs:
        adj.setdefault(u, []).append(v)
        adj.setdefault(v, []).append(u)
    return adj


class _Cycle(Exception):
    pass


def cot_trace(g: Graph) -> tuple[list[str], bool]:
    """Algorithm 1: DFS from 0, neighbours in edge-list order; a node on entry and its parent again after each
    child returns; stop at the first visited non-parent neighbour. Verdict: no cycle and every node seen."""
    adj, seen, out = _adjacency(g.edges, g.n), {0}, []

    def visit(v, parent):
        out.append(str(v))
        for w in adj[v]:
            if w == parent:
                continue
            if w in seen:
                raise _Cycle
            seen.add(w)
            visit(w, v)
            out.append(str(v))

    try:
        visit(0, None)
        return out, len(seen) == g.n
    except _Cycle:
        return out, False


def first_neighbour(edges, v):
    for a, b in edges:
        if v in (a, b):
            return b if a == v else a
    return None


def next_neighbour(edges, v, u):
    after = False
    for a, b in edges:
        if after and v in (a, b):
            return b if a == v else a
        if {a, b} == {u, v}:
            after = True
    return None


def retrieval_trace(g: Graph) -> tuple[list[str], bool]:
    """Algorithm 2: the DFS of Algorithm 1 where every fact about the graph or the DFS so far is looked up
    with a query the tool answers; results are the gold answers of those queries."""
    out: list[str] = []
    records: dict[int, int] = {}

    def ask(query: list[str], answer) -> None:
        out.extend([START, *query, END, str(answer) if answer is not None else FAILED])

    def visit(v):
        p = records.get(v)
        prev = None
        while True:
            out.append(str(v))
            ask([str(v), "~"], p)
            while True:
                if prev is None:
                    w = first_neighbour(g.edges, v)
                    ask([str(v), "-"], w)
                else:
                    w = next_neighbour(g.edges, v, prev)
                    ask([str(v), "-", str(prev)], w)
                if w is None:
                    return
                if w == p:
                    prev = w
                    continue
                break
            pw = records.get(w)
            ask([str(w), "~"], pw)
            if pw is not None or w == 0:  # the root has no "0 ~" record: its query answers [FAILED], yet
                raise _Cycle              # it is visited, so reaching it again closes a cycle (as the paper's code)
            records[w] = v
            out.extend([str(w), "~", str(v)])
            visit(w)
            prev = w

    try:
        visit(0)
        return out, len(records) + 1 == g.n
    except _Cycle:
        return out, False


def sample_tokens(g: Graph, setup: str) -> list[str]:
    head = [BOS, *g.tokens(), EOS]
    label = TRUE if g.is_tree else FALSE
    if setup == "direct":
        return head + [label]
    trace, verdict = cot_trace(g) if setup == "cot" else retrieval_trace(g)
    assert verdict == g.is_tree, "trace verdict disagrees with the graph"
    return head + trace + [EOS, label]


# --------------------------------------------------------------------------------------------- tool
class IsTreeTool:
    """The retrieval tool for IsTree: each query becomes one ``re`` search (edge list or trace so far). The model
    writes a query, never a pattern: ``compile_query`` builds one of three patterns over whole-number words (a
    scan with no nested repetition; the next-edge one is at worst quadratic in the edge list's length), so the
    search runs in this process (``InProcessSearcher``) and no time limit applies; a row calls every ~7 tokens."""

    call_end = END
    waits = False  # called in turn by the decode loop (harness.backends.base.Tool)

    def __init__(self, edges_text: str, max_calls: int = 10_000):
        self.edges_text = " ".join(edges_text.split())
        self.max_calls = max_calls
        self.searcher = InProcessSearcher()
        self.log: list[dict] = []

    @staticmethod
    def compile_query(query: str) -> tuple[str, str] | None:
        """Query text → (regex, which text to search: 'edges' or 'trace'); None if not a valid query."""
        q = query.split()
        num = r"(\d+)"
        if len(q) == 2 and q[0].isdigit() and q[1] == "~":
            return rf"(?:^| ){q[0]} ~ {num}(?= |$)", "trace"
        if len(q) == 2 and q[0].isdigit() and q[1] == "-":
            v = q[0]
            return rf"(?:^| )(?:{v} - {num}|{num} - {v})(?= |$)", "edges"
        if len(q) == 3 and q[0].isdigit() and q[1] == "-" and q[2].isdigit():
            v, u = q[0], q[2]
            return rf"(?:^| )(?:{v} - {u}|{u} - {v})(?: \d+ - \d+)*? (?:{v} - {num}|{num} - {v})(?= |$)", "edges"
        return None

    def __call__(self, generated: str, start: int = 0) -> str:
        query, err = parse_call(generated[start:], START, END)
        compiled = self.compile_query(query) if query is not None else None
        if compiled is None:
            self.log.append({"pattern": query, "status": "error", "result": FAILED, "seconds": 0.0})
            return f" {FAILED}"
        pattern, where = compiled
        text = self.edges_text if where == "edges" else _trace_text(generated)
        out = self.searcher.capture(pattern, text)
        result = out.matches[0] if out.status == "ok" else FAILED
        self.log.append({"pattern": pattern, "status": out.status, "result": result, "seconds": round(out.seconds, 6)})
        return f" {result}"


def _trace_text(generated: str) -> str:
    """The trace as the model wrote it, without the open query at its end."""
    return " ".join(generated[: generated.rfind(START)].split()) if START in generated else " ".join(generated.split())


# --------------------------------------------------------------------------------------------- task
@dataclass
class IsTreeOptions:
    nodes: int = field(default=16, metadata={"help": "graph size n (paper: 16, 32, 64; a comma list sweeps it)",
                                             "sweep": True})
    setup: str = field(default="cot", metadata={"help": "direct, cot or retrieval (the tool is live)"})
    graph: str = field(default="binary", metadata={"help": "binary (the paper's) or recursive"})
    samples: int = field(default=5000, metadata={"help": "held-out graphs"})
    eval_seed: int = field(default=0, metadata={"help": "which held-out set"})

    def check(self) -> None:
        if self.setup not in SETUPS:
            raise OptionError(f"--task-arg setup={self.setup}: choose {', '.join(SETUPS)}")
        if self.graph == "random":
            raise OptionError("--task-arg graph=random: this project's second graph type is called 'recursive' "
                              "(random recursive trees, half with a cycle; labelled by tree-ness). The paper's "
                              "'random' type labels connectivity and is not offered")
        if self.graph not in GRAPHS:
            raise OptionError(f"--task-arg graph={self.graph}: choose {', '.join(GRAPHS)}")
        if self.nodes < 4 or self.samples < 1:
            raise OptionError("--task-arg nodes must be >= 4 and samples >= 1")


@register_task("istree")
class IsTree(SyntheticTask):
    """Held-out IsTree samples as an engine task (generation is greedy; the verdict is the first label)."""

    Options = IsTreeOptions
    default_template = "istree"
    retrieval_template = "istree"
    stop = [TRUE, FALSE]
    include_stop = True
    metrics = ("accuracy",)
    condition = "nodes"

    def __init__(self, data: str | None = None, split: str | None = None, **options):
        super().__init__(data, split, **options)
        o = self.options
        self.nodes, self.setup, self.graph, self.samples, self.eval_seed = o.nodes, o.setup, o.graph, o.samples, \
            o.eval_seed
        self.stop = [TRUE, FALSE]

    def max_new_tokens(self, as_tokens: bool) -> int:
        n = self.options.nodes
        return {"direct": 2, "cot": 4 * n + 4, "retrieval": 60 * n}[self.options.setup]

    # -- the trainer's protocol: a graph, written as the whole sample of its setup --------------------
    @classmethod
    def training_options(cls, cfg) -> dict:
        return {"nodes": cfg.nodes, "setup": cfg.setup, "graph": cfg.graph, **cfg.task_args}

    @classmethod
    def training_tag(cls, cfg) -> str:
        graph = "" if cfg.graph == "binary" else f"-{cfg.graph}"
        return f"n{cfg.nodes}{graph}-{cfg.setup}"

    def draw(self, rng: random.Random) -> Graph:
        return GENERATORS[self.graph](self.nodes, rng)

    def tokens(self, g: Graph) -> tuple[list[str], list[str]]:
        """The edge list, then what the model writes: its trace (none when direct) and the verdict."""
        sample = sample_tokens(g, self.setup)
        cut = sample.index(EOS) + 1
        return sample[:cut], sample[cut:]

    def vocabulary(self) -> list[str]:
        return vocabulary(self.nodes)

    def max_tokens(self) -> int:
        return {"direct": 4, "cot": 8, "retrieval": 64}[self.setup] * self.nodes

    def training_max_len(self) -> int:
        return self.max_tokens()

    def heldout_sequences(self, rows: list[dict]) -> list[list[str]]:
        return [sample_tokens(Graph(self.nodes, [tuple(e) for e in r["edges"]]), self.setup) for r in rows]

    def load(self) -> list[dict]:
        # A seed namespace of its own, so held-out graphs never come from a training stream's sequence.
        rng = random.Random(f"istree-eval:{self.graph}:{self.nodes}:{self.eval_seed}")
        rows = []
        for i in range(self.samples):
            g = self.draw(rng)
            rows.append({"_id": f"g{i:05d}", "edges": g.edges, "is_tree": g.is_tree})
        return rows

    def instances(self, rows, *, seed=0, pool_rows=None) -> list[Instance]:
        out = []
        for r in rows:
            g = Graph(self.nodes, [tuple(e) for e in r["edges"]])
            prompt = " ".join([BOS, *g.tokens(), EOS])
            out.append(TextInstance(id=r["_id"], condition=f"n={self.nodes}", text=prompt,
                                    answer=TRUE if r["is_tree"] else FALSE, meta={"n": self.nodes, "setup": self.setup}))
        return out

    def make_tool(self, instance: Instance, spec: ToolSpec):
        """The setup decides whether the tool is live (the model was trained with it); --max-tool-calls caps it."""
        if self.setup != "retrieval":
            return None
        limits = {"max_calls": spec.max_calls} if spec.max_calls is not None else {}
        return IsTreeTool(instance.text.replace(BOS, "").replace(EOS, ""), **limits)

    def score(self, instance: Instance, generation: str, answer_phrase: str | None = None) -> dict:
        m = re.search(r"\[(TRUE|FALSE)\]", generation)
        pred = f"[{m.group(1)}]" if m else ""
        return {"prediction": pred, "answer_found": bool(m), "accuracy": float(pred == instance.answer)}
