import signal

import pytest
import torch

from hookloop.models.gpt import GPT, GPTConfig


def pytest_configure(config):
    # SIGTERM stops the tests as Ctrl-C does (a KeyboardInterrupt): each test's cleanup runs, and the
    # command a test waits for (tests/forked.py) and the fork server end with it.
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _one_thread():
    # Bitwise comparisons hold only at a fixed thread count.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def deterministic():
    """torch's deterministic algorithms for one test (bitwise resume comparisons need them)."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous)


def tiny_gpt(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=64, seq_len=16, n_layers=2, d_model=32, n_heads=2)
    cfg.update(overrides)
    return GPT(GPTConfig(**cfg))


def token_batches(n: int, batch: int = 2, seq_len: int = 16, vocab: int = 64, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)
        out.append((x[:, :-1], x[:, 1:]))
    return out
