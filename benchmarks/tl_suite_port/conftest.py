"""conftest.py of the TransformerLens-suite port (replaces TransformerLens' conftests; the same file on both sides).

Hub names load the tiny seeded models of `tiny.py`; TransformerLens' session fixtures are rebuilt over them;
fixtures whose oracle is TransformerLens' frozen goldens skip as not portable.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny

tiny.patch_transformers()
SIDE = os.environ.get("TLS_SIDE", "tl")

from transformer_lens.model_bridge import TransformerBridge  # noqa: E402


def boot(name: str, compat: bool | None = None):
    bridge = TransformerBridge.boot_transformers(name, device="cpu")
    if compat is True:
        bridge.enable_compatibility_mode(disable_warnings=True)
    elif compat is False:
        bridge.enable_compatibility_mode(disable_warnings=True, no_processing=True)
    return bridge


@pytest.fixture(scope="session")
def gpt2_tokenizer():
    return tiny.tiny_tokenizer()


@pytest.fixture(scope="session")
def gpt2_bridge():
    return boot("gpt2")


@pytest.fixture(scope="session")
def gpt2_bridge_compat():
    return boot("gpt2", True)


@pytest.fixture(scope="session")
def gpt2_bridge_compat_no_processing():
    return boot("gpt2", False)


@pytest.fixture(scope="session")
def distilgpt2_bridge():
    return boot("distilgpt2")


@pytest.fixture(scope="session")
def distilgpt2_bridge_compat():
    return boot("distilgpt2", True)


@pytest.fixture(scope="session")
def distilgpt2_bridge_compat_no_processing():
    return boot("distilgpt2", False)


@pytest.fixture(scope="module")
def sample_tokens(request, bridge):
    return bridge.to_tokens("Hello world, this is a test.")


def _goldens():
    pytest.skip("NOT_PORTABLE: goldens (real-checkpoint activations)")


@pytest.fixture(scope="session")
def gpt2_goldens_processed():
    _goldens()


@pytest.fixture(scope="session")
def gpt2_goldens_unprocessed():
    _goldens()


@pytest.fixture(scope="session")
def distilgpt2_goldens_processed():
    _goldens()


@pytest.fixture(scope="session")
def distilgpt2_goldens_unprocessed():
    _goldens()


@pytest.fixture
def temp_dir(tmp_path):
    return tmp_path


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
