"""The Φp interface's query/key and probability hooks, with two small Φp written for the test:
what the attention layer hands each hook, where it calls them, and which kernel runs."""
import pytest
import torch

import posattn
from posattn import Attention, TokenGrid
from posattn.phi import PositionalModule
from posattn.reference import softmax_attention


class ScaledKeys(PositionalModule):
    """Multiplies every grid key by (1 + its row), leaves the queries and prefix keys: position-dependent."""

    def queries_keys(self, q, k, grid):
        rows, _ = grid.positions(k.device)
        scale = torch.cat([k.new_ones(grid.num_prefix_tokens), 1.0 + rows.to(k.dtype)])  # (N,)
        return q, k * scale[:, None]


class UniformMixture(PositionalModule):
    """A = (1 - g) A_content + g U, U uniform over the unmasked keys, g = 0.25."""

    def mix_probabilities(self, attn, grid, key_mask=None):
        keys = torch.ones_like(attn) if key_mask is None else key_mask[:, None, None, :].to(attn.dtype).expand_as(attn)
        return 0.75 * attn + 0.25 * keys / keys.sum(-1, keepdim=True)


def manual_attention(x, layer, transform=None, mix=None):
    """The layer's math in float64, step by step."""
    batch, tokens, dim = x.shape
    heads, head_dim = layer.num_heads, layer.head_dim
    q, k, v = (x @ layer.qkv.weight.t() + layer.qkv.bias).reshape(batch, tokens, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
    if transform is not None:
        q, k = transform(q, k)
    attn = torch.softmax(q @ k.transpose(-1, -2) * head_dim ** -0.5, dim=-1)
    if mix is not None:
        attn = mix(attn)
    out = (attn @ v).transpose(1, 2).reshape(batch, tokens, dim)
    return out @ layer.proj.weight.t() + layer.proj.bias


def test_hooks_are_detected_by_override():
    assert ScaledKeys().transforms_queries_keys and not ScaledKeys().mixes_probabilities
    assert UniformMixture().mixes_probabilities and not UniformMixture().transforms_queries_keys
    for name in ('none', 'peg', 'alibi'):
        phi = posattn.build_phi(name, **({'dim': 8} if name == 'peg' else {'num_heads': 2} if name == 'alibi' else {}))
        assert not phi.transforms_queries_keys and not phi.mixes_probabilities


@pytest.mark.parametrize('prefix', [0, 1])
def test_query_key_hook_feeds_the_logits(prefix):
    torch.manual_seed(0)
    layer = Attention(8, 2, phi=ScaledKeys(), num_prefix_tokens=prefix).double()
    x = torch.randn(2, prefix + 12, 8, dtype=torch.float64)
    grid = TokenGrid(3, 4, prefix)
    expected = manual_attention(x, layer, transform=lambda q, k: layer.phi.queries_keys(q, k, grid))
    torch.testing.assert_close(layer(x, (3, 4)), expected, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(expected, softmax_attention(x, *_weights(layer), 2))  # the hook matters


def test_query_key_hook_keeps_the_fused_kernel(monkeypatch):
    layer = Attention(8, 2, phi=ScaledKeys())
    assert not layer._materialises_probabilities()
    formed = []
    monkeypatch.setattr(posattn.attention, 'attention_probs', lambda *a: formed.append(1))
    layer(torch.randn(1, 6, 8), (2, 3))
    assert not formed


def test_probability_hook_mixes_after_the_softmax():
    torch.manual_seed(1)
    layer = Attention(8, 2, phi=UniformMixture()).double()
    assert layer._materialises_probabilities()
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    expected = manual_attention(x, layer, mix=lambda a: 0.75 * a + 0.25 / 6)
    torch.testing.assert_close(layer(x, (2, 3)), expected, rtol=1e-12, atol=1e-12)


def test_probability_hook_gets_the_key_mask():
    layer = Attention(8, 2, phi=UniformMixture()).double()
    x = torch.randn(1, 6, 8, dtype=torch.float64)
    key_mask = torch.tensor([[True, True, True, False, False, True]])
    seen = []
    layer.phi.mix_probabilities = lambda attn, grid, key_mask=None: seen.append(key_mask) or attn
    layer(x, (2, 3), key_mask=key_mask)
    assert seen and torch.equal(seen[0], key_mask)


def _weights(layer):
    return layer.qkv.weight, layer.qkv.bias, layer.proj.weight, layer.proj.bias
