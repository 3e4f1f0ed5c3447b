"""Session-scoped tiny models: random weights from configs, saved with save_pretrained and loaded back
through the registry path, with a real byte-level BPE tokenizer trained offline on the bundled text."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# trio (selenium's dependency, for the HTML report's browser tests) registers a Hypothesis plugin that fails to
# load (trio 0.35: no _hypothesis_plugin_setup); where Hypothesis is installed, its pytest plugin imports it at the
# end of the session and the run dies after its summary. This project registers no Hypothesis plugins.
os.environ.setdefault("HYPOTHESIS_NO_PLUGINS", "1")


def pytest_configure(config):
    """A parallel worker (pytest-xdist: two on two cores) computes on one thread, and so do the processes it
    starts: two workers of two OpenMP threads each oversubscribe the cores, and OpenMP's spinning threads then make
    the whole suite several times slower than running it serially."""
    if hasattr(config, "workerinput"):
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = "1"
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Under parallel workers, the modules that hold slow tests run first (each module's tests kept together and
    in order, so module fixtures are built once): the long tests start while there is work left to run beside
    them, instead of running alone at the end while the other worker idles."""
    if not hasattr(config, "workerinput"):
        return
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    slow = {m: sum(1 for i in its if i.get_closest_marker("slow")) for m, its in modules.items()}
    items[:] = [i for m in sorted(modules, key=lambda m: -slow[m]) for i in modules[m]]


@pytest.fixture(scope="session")
def warm_python():
    """This worker's warm interpreter (tests/helpers.py says why): ``warm_python.run(argv, env, cwd, timeout)``
    runs ``python *argv`` forked from it where ``env`` is ``warm_python.env``, else in a fresh interpreter."""
    from pathlib import Path

    from tests.helpers import WarmPython

    root = str(Path(__file__).resolve().parent.parent)
    warm = WarmPython({**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    yield warm
    warm.close()


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from harness.tiny import build_tokenizer

    return build_tokenizer()


def _model_dir(tmp_path_factory, tok, arch, **kw):
    from harness.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp(arch) / "ckpt", arch, tokenizer=tok, **kw))


@pytest.fixture(scope="session")
def tiny_phi_dir(tmp_path_factory, tiny_tokenizer):
    return _model_dir(tmp_path_factory, tiny_tokenizer, "phi")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny_tokenizer):
    return _model_dir(tmp_path_factory, tiny_tokenizer, "llama")


# switches a backend reads as it loads: a session backend outlives the test that first asked for it, so it is
# built with them at their defaults whatever that test set
LOAD_SWITCHES = ("ICR_CPU_FLASH", "ICR_KEPT_POSITIONS")


def _backend(model_dir):
    from harness.backends.loading import load_backend

    saved = {k: os.environ.pop(k) for k in LOAD_SWITCHES if k in os.environ}
    try:
        return load_backend(model_dir, device="cpu", dtype="float32")
    finally:
        os.environ.update(saved)


@pytest.fixture(scope="session")
def phi_backend(tiny_phi_dir):
    return _backend(tiny_phi_dir)


@pytest.fixture(scope="session")
def llama_backend(tiny_llama_dir):
    return _backend(tiny_llama_dir)


@pytest.fixture(scope="session")
def tiny_phi_mamba_dir(tmp_path_factory, tiny_tokenizer):
    return _model_dir(tmp_path_factory, tiny_tokenizer, "phi-mamba", layers=3)


@pytest.fixture(scope="session")
def tiny_hybrid_dir(tmp_path_factory, tiny_tokenizer):
    return _model_dir(tmp_path_factory, tiny_tokenizer, "hybrid-phi-mamba", layers=3)


@pytest.fixture(scope="session")
def phi_mamba_backend(tiny_phi_mamba_dir):
    return _backend(tiny_phi_mamba_dir)


@pytest.fixture(scope="session")
def hybrid_backend(tiny_hybrid_dir):
    return _backend(tiny_hybrid_dir)


# ------------------------------------------------------------------------------- a real GPT-2 byte-level BPE
WHISPER_SDIST = "openai-whisper==20250625"  # ships whisper/assets/gpt2.tiktoken (GPT-2's ranks, MIT)


@pytest.fixture(scope="session")
def gpt2_tokenizer():
    """GPT-2's real BPE, built once from the ranks file in the openai-whisper sdist fetched from the package
    index and cached under ~/.cache/icr-harness (never committed). Skipped, saying so, where no index answers."""
    from pathlib import Path

    from filelock import FileLock
    from transformers import PreTrainedTokenizerFast

    cache = Path(os.environ.get("ICR_CACHE", Path.home() / ".cache" / "icr-harness")) / "gpt2-bpe"
    cache.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache) + ".lock"):  # parallel test workers build it once, and never read it half-written
        _build_gpt2_bpe(cache)
    tok = PreTrainedTokenizerFast.from_pretrained(cache)
    assert len(tok) == 50257 and tok("Hello world")["input_ids"] == [15496, 995]  # GPT-2's own ids
    return tok


def _build_gpt2_bpe(cache):
    import subprocess
    import sys
    import tarfile
    import tempfile
    from pathlib import Path

    from harness.tiny import gpt2_tokenizer_from_tiktoken

    if not (cache / "tokenizer.json").is_file():
        with tempfile.TemporaryDirectory() as tmp:
            res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                                  "--no-build-isolation", "-q", "-d", tmp, WHISPER_SDIST],
                                 capture_output=True, text=True, timeout=300)
            sdists = list(Path(tmp).glob("*.tar.gz"))
            if res.returncode != 0 or not sdists:
                pytest.skip(f"GPT-2 BPE fixture: could not fetch {WHISPER_SDIST} from the package index "
                            f"({res.stderr.strip()[-300:]})")
            with tarfile.open(sdists[0]) as tar:
                member = next(m for m in tar.getmembers() if m.name.endswith("whisper/assets/gpt2.tiktoken"))
                ranks = Path(tmp) / "gpt2.tiktoken"
                ranks.write_bytes(tar.extractfile(member).read())
            gpt2_tokenizer_from_tiktoken(ranks).save_pretrained(cache)


@pytest.fixture(scope="session")
def gpt2_phi_dir(tmp_path_factory, gpt2_tokenizer):
    return _model_dir(tmp_path_factory, gpt2_tokenizer, "phi")
