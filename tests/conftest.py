"""Session-scoped tiny models: random weights from configs, saved with save_pretrained and loaded back
through the registry path, with a real byte-level BPE tokenizer trained offline on the bundled text."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


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


def _backend(model_dir):
    from harness.engine import load_backend

    return load_backend(model_dir, device="cpu", dtype="float32")


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
