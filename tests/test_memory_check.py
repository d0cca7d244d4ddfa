"""An attention too large for the memory left fails at once, naming what it needs, before any of
the work (the Φp of a large grid alone can take minutes)."""
import pytest
import torch

import posattn._memory as memory
from posattn import Attention


def test_too_large_fails_before_the_phi_runs(monkeypatch):
    monkeypatch.setattr(memory, 'CHECK_ABOVE_BYTES', 0)
    monkeypatch.setattr(memory, 'available_bytes', lambda device: 1 << 20)
    layer = Attention(16, 2, phi='peripheral', num_prefix_tokens=1).eval()
    calls = []
    position_bias = layer.phi.position_bias
    layer.phi.position_bias = lambda *args: calls.append(1) or position_bias(*args)
    x = torch.randn(1, 1 + 20 * 20, 16)
    with pytest.raises(MemoryError, match=r'attention over 401 tokens \(20x20 grid with 1 extra token\) in 2 heads '
                                          r'needs at least 0.0 GiB on cpu, which has 0.0 GiB available: give it a '
                                          r'smaller input, or attend within windows'):
        layer(x, (20, 20))
    assert not calls
    layer(torch.randn(1, 1 + 4 * 4, 16), (4, 4))  # 2 * 2 heads * 17^2 * 4 bytes fit in 1 MiB


def test_the_estimate_counts_what_the_call_materialises(monkeypatch):
    seen = []
    monkeypatch.setattr(memory, 'check_fits', lambda nbytes, *args: seen.append(nbytes))
    monkeypatch.setattr('posattn.attention.check_fits', memory.check_fits)
    x = torch.randn(3, 1 + 5 * 6, 16)
    pairs = 2 * 31 * 31 * 4  # heads * N^2 * float32 bytes
    Attention(16, 2, phi='none', num_prefix_tokens=1)(x, (5, 6))
    Attention(16, 2, phi='peripheral', num_prefix_tokens=1)(x, (5, 6))
    Attention(16, 2, phi='irpe', phi_cfg=dict(on='kv'), num_prefix_tokens=1)(x, (5, 6))
    Attention(16, 2, phi='irpe', phi_cfg=dict(mode='bias', on='k'), num_prefix_tokens=1)(x, (5, 6))
    Attention(16, 2, phi='decomposed_rpb', num_prefix_tokens=1)(x, (5, 6))
    Attention(16, 2, phi='gpsa', num_prefix_tokens=1)(x, (5, 6))
    Attention(16, 2, phi='gpsa', num_prefix_tokens=1)(x, (5, 6), torch.ones(3, 31, dtype=torch.bool))
    # a bias that reads the tokens (contextual iRPE on k, decomposed_rpb) is one per image; the
    # probabilities are materialised for iRPE on v; gpsa mixes on the outputs, by two 1D attentions
    # over a whole grid and by its (B, heads, N, N) positional attention under a key mask
    assert seen == [0, 2 * pairs, (2 * 3 + 2 * 3) * pairs, 2 * pairs, 2 * 3 * pairs, 0, 2 * 3 * pairs]


def test_available_memory_is_read_on_the_cpu():
    available = memory.available_bytes(torch.device('cpu'))
    assert available is None or available > 0
    assert memory.available_bytes(torch.device('meta')) is None
