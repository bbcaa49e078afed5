"""Shared tiny checkpoints (written once per test session)."""

from __future__ import annotations

import pytest

from tiny_models import make_tiny_dflash_draft, make_tiny_llama, make_tiny_qwen3


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="session")
def llama_tied_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama_tied"), tie_word_embeddings=True)


@pytest.fixture(scope="session")
def random_draft_dir(tmp_path_factory, qwen3_dir):
    """An untrained draft: its proposals are almost always rejected."""
    return make_tiny_dflash_draft(
        tmp_path_factory.mktemp("draft_random"), qwen3_dir, num_layers=1, block_size=4, target_layer_ids=[1, 2]
    )
