"""The Φp interface's query/key and probability hooks, with two small Φp written for the test:
what the attention layer hands each hook, where it calls them, and which kernel runs."""
import pytest
import torch
from torch.nn.utils import prune

import posattn
from posattn import Attention, TokenGrid
from posattn.phi import PositionalModule
from posattn.reference import softmax_attention


class ScaledKeys(PositionalModule):
    """Multiplies every grid key by (1 + its row), leaves the queries and prefix keys: position-dependent."""

    def __init__(self):
        super().__init__(hooks=('queries_keys',))

    def queries_keys(self, q, k, grid):
        rows, _ = grid.positions(k.device)
        scale = torch.cat([k.new_ones(grid.num_prefix_tokens), 1.0 + rows.to(k.dtype)])  # (N,)
        return q, k * scale[:, None]


class UniformMixture(PositionalModule):
    """A = (1 - g) A_content + g U, U uniform over the unmasked keys, g = 0.25."""

    def __init__(self):
        super().__init__(hooks=('mix_probabilities',))

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


def test_hooks_are_read_from_the_declaration():
    assert ScaledKeys().transforms_queries_keys and not ScaledKeys().mixes_probabilities
    assert UniformMixture().mixes_probabilities and not UniformMixture().transforms_queries_keys
    declared = {'none': set(), 'peg': {'tokens'}, 'alibi': {'logits_bias'}}
    for name, hooks in declared.items():
        phi = posattn.build_phi(name, **({'dim': 8} if name == 'peg' else {'num_heads': 2} if name == 'alibi' else {}))
        assert phi.hooks == hooks


def test_options_change_the_declaration():
    """iRPE on the values alone overrides logits_bias (its class does) but gives no bias."""
    on_values = posattn.build_phi('irpe', num_heads=2, head_dim=4, on='v')
    assert on_values.hooks == {'value_term'} and on_values.needs_probabilities and not on_values.gives_logits_bias
    on_keys = posattn.build_phi('irpe', num_heads=2, head_dim=4, on='kv')
    assert on_keys.hooks == {'logits_bias', 'value_term'} and on_keys.bias_per_image
    bias_mode = posattn.build_phi('irpe', num_heads=2, head_dim=4, mode='bias', on='qk')
    assert bias_mode.hooks == {'logits_bias'} and not bias_mode.bias_per_image


def test_position_only_attention_refuses_a_phi_without_a_bias():
    with pytest.raises(ValueError, match="declares one .*IRPE with hooks \\['value_term'\\]"):
        Attention(16, 2, phi='irpe', phi_cfg={'on': 'v'}, content=False)
    Attention(16, 2, phi='irpe', phi_cfg={'on': 'k'}, content=False)  # a bias: accepted


def test_the_memory_check_counts_only_declared_biases(monkeypatch):
    """iRPE on v materialises the probabilities (2 B pair terms) and gives no bias (0 more)."""
    seen = []
    monkeypatch.setattr(posattn.attention, 'check_fits', lambda nbytes, *args: seen.append(nbytes))
    layer = Attention(16, 2, phi='irpe', phi_cfg={'on': 'v'})
    layer(torch.randn(3, 12, 16), (3, 4))
    assert seen == [2 * 3 * 2 * 12 * 12 * 4]
    seen.clear()
    Attention(16, 2, phi='alibi')(torch.randn(3, 12, 16), (3, 4))
    assert seen == [2 * 1 * 2 * 12 * 12 * 4]  # one batch-free bias and its computation


def test_an_undeclared_phi_is_refused_with_the_fix():
    class Forgotten(PositionalModule):
        def logits_bias(self, q, k, grid):
            return None

    with pytest.raises(TypeError, match=r'declares no hooks: pass the hooks it contributes'):
        Attention(8, 2, phi=Forgotten())
    with pytest.raises(ValueError, match='unknown Φp hook'):
        PositionalModule(hooks=('bias',))
    with pytest.raises(TypeError, match='not the string'):
        PositionalModule(hooks='logits_bias')


def test_a_declared_hook_that_is_not_defined_is_refused_when_built():
    class Undefined(PositionalModule):
        def __init__(self, hooks):
            super().__init__(hooks=hooks)

        def logits_bias(self, q, k, grid, **given):
            return None

    with pytest.raises(TypeError, match=r"declares the hook 'value_term' but does not define it: override "
                                        r"value_term\(...\), or leave it out of hooks"):
        Undefined(('logits_bias', 'value_term'))
    assert Undefined(('logits_bias',)).hooks == {'logits_bias'}


def test_every_form_of_a_declared_hook_must_take_the_call_inputs():
    class Narrow(PositionalModule):
        def __init__(self):
            super().__init__(hooks=('logits_bias',), call_inputs=('distance_embedding',))

        def logits_bias(self, q, k, grid, distance_embedding):
            return None

        def logits_bias_at(self, q, k, positions):
            return None

    with pytest.raises(TypeError, match=r'Narrow.logits_bias_at does not take distance_embedding, which it '
                                        r'declares in call_inputs: .* add them as keyword arguments, or \*\*given'):
        Narrow()


def test_a_phi_is_not_called_as_a_module():
    """The layer calls hooks by name: pruning, which works through a forward pre-hook, is refused;
    other hooks may be registered (tools hook every module) and never run."""
    phi = posattn.build_phi('rpb', num_heads=2, table_size=(2, 2))
    with pytest.raises(TypeError, match='calls its hooks by name'):
        phi(torch.zeros(1, 2, 4, 4), None, TokenGrid(2, 2))
    with pytest.raises(TypeError, match='prune recomputes its weight in a forward pre-hook.*parametrize'):
        phi.register_forward_pre_hook(prune.Identity())
    with pytest.raises(Exception) as raised:  # prune's own roll-back may fail after it: the reason comes with it
        prune.random_unstructured(phi, 'relative_position_bias_table', amount=0.5)
    reasons = [raised.value, raised.value.__context__]
    assert any(isinstance(e, TypeError) and 'parametrize' in str(e) for e in reasons)
    phi = posattn.build_phi('rpb', num_heads=2, table_size=(2, 2))
    calls = []
    phi.register_forward_hook(lambda *args: calls.append(1))
    layer = Attention(8, 2, phi=phi)
    layer(torch.randn(1, 4, 8), (2, 2))
    assert calls == []


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
