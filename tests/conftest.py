"""Shared fixtures. Tests run on a small CPU shared by several jobs: one intra-op thread per test process avoids the
OpenMP barrier stalls that make multi-threaded torch ops many times slower when a core is taken by someone else."""
from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model():
    """A random 6-layer Llama over the 128-id character vocabulary of `tiny_tokenizer`."""
    from hybridspec.tools.testing import tiny_llama

    return tiny_llama(vocab_size=128, num_layers=6, seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from hybridspec.tools.testing import tiny_tokenizer

    return tiny_tokenizer(128)
