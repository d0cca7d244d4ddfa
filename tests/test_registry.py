"""The Φp registry, and a Φp written outside the package plugging into the layer unchanged."""
import pytest
import torch

import posattn
from posattn import Attention, PositionalModule, TokenGrid, register_phi
from posattn.phi import registry


@pytest.fixture
def scratch_registry(monkeypatch):
    monkeypatch.setattr(registry, '_PHIS', dict(registry._PHIS))


def test_builtins_are_listed():
    assert {'none', 'peripheral'} <= set(posattn.list_phis())
    assert posattn.list_phis() == sorted(posattn.list_phis())


def test_build_phi_passes_options():
    phi = posattn.build_phi('peripheral', num_heads=3, layer_index=2, num_layers=4)
    assert phi.norm2_bias.shape == (3,)
    with pytest.raises(TypeError, match="takes: num_heads, layer_index, num_layers, shared_embedding"):
        posattn.build_phi('peripheral', num_heads=3, depth=4)


def test_registering_twice_or_a_non_phi_fails(scratch_registry):
    with pytest.raises(ValueError, match="'none' is already registered by NoPosition"):
        @register_phi('none')
        class Other(PositionalModule):
            pass
    with pytest.raises(TypeError, match='expects a PositionalModule subclass'):
        register_phi('plain')(torch.nn.Linear)


def test_user_phi_with_bias_tokens_and_value_term(scratch_registry):
    """A distance-penalty bias (ALiBi-like), a token hook and a value term: attention.py unchanged."""

    @register_phi('distance_penalty')
    class DistancePenalty(PositionalModule):
        def __init__(self, num_heads, head_dim, slope=1.0):
            super().__init__(hooks=('tokens', 'logits_bias', 'value_term'))
            self.slopes = torch.nn.Parameter(slope * torch.arange(1, num_heads + 1, dtype=torch.float32))
            self.value_offset = torch.nn.Parameter(torch.zeros(head_dim))

        def tokens(self, x, grid):
            return x * 2

        def logits_bias(self, q, k, grid):
            rows, cols = torch.meshgrid(torch.arange(grid.height), torch.arange(grid.width), indexing='ij')
            coords = torch.stack([rows, cols], -1).reshape(-1, 2).float()
            distance = torch.cdist(coords, coords)
            return -(self.slopes[:, None, None] * distance).unsqueeze(0).to(q.dtype)

        def value_term(self, attn, grid):
            return attn.sum(-1, keepdim=True) * self.value_offset

    layer = Attention(8, 2, phi='distance_penalty', phi_cfg=dict(slope=0.5))
    assert layer.phi.slopes.tolist() == [0.5, 1.0]
    with torch.no_grad():
        layer.phi.value_offset.fill_(0.25)
    x = torch.randn(2, 6, 8)
    q, k, v = layer.qkv(2 * x).reshape(2, 6, 3, 2, 4).permute(2, 0, 3, 1, 4)
    bias = layer.phi.logits_bias(q, k, TokenGrid(2, 3))
    attn = torch.softmax(q @ k.transpose(-1, -2) / 2 + bias, -1)
    expected = layer.proj(((attn @ v) + 0.25).transpose(1, 2).reshape(2, 6, 8))
    torch.testing.assert_close(layer(x, (2, 3)), expected)


def test_model_registry(monkeypatch):
    from posattn.models import registry as models
    monkeypatch.setattr(models, '_MODELS', dict(models._MODELS))

    @posattn.register_model('tiny_linear')
    def tiny_linear(num_classes=3):
        return torch.nn.Linear(4, num_classes)

    assert 'tiny_linear' in posattn.list_models()
    assert posattn.create_model('tiny_linear', num_classes=5).out_features == 5
    with pytest.raises(ValueError, match="unknown model 'tiny_linearr'; known: .*tiny_linear"):
        posattn.create_model('tiny_linearr')
    with pytest.raises(ValueError, match="'tiny_linear' is already registered by"):
        posattn.register_model('tiny_linear')(lambda: None)
