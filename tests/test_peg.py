"""PEG / CPE: the Twins PosCNN fixture, prefix tokens, and the attention token hook."""
import pytest
import torch
import torch.nn.functional as F

import posattn
from posattn import Attention, TokenGrid

from conftest import load_fixture
from release_fixtures import PEG, load_trimmed


@pytest.mark.parametrize('kind', ['trimmed', 'full'])
def test_matches_released_poscnn(kind):
    """The trimmed fixture keeps one image and 32 of the 192 channels (a depthwise conv keeps them apart)."""
    fixture = load_trimmed(PEG[1]) if kind == 'trimmed' else load_fixture(PEG[0])
    peg = posattn.build_phi('peg', dim=fixture['weight'].shape[0])
    with torch.no_grad():
        peg.proj.weight.copy_(fixture['weight'])
        peg.proj.bias.copy_(fixture['bias'])
        out = peg.tokens(fixture['x'], (fixture['H'], fixture['W']))
    torch.testing.assert_close(out, fixture['out'], rtol=0, atol=1e-5)


def naive_peg(x, weight, bias, height, width, prefix, residual):
    grid = x[:, prefix:].transpose(1, 2).reshape(x.shape[0], -1, height, width)
    out = F.conv2d(grid, weight, bias, padding=1, groups=grid.shape[1]) + (grid if residual else 0)
    return torch.cat([x[:, :prefix], out.flatten(2).transpose(1, 2)], 1)


@pytest.mark.parametrize('residual', [True, False])
def test_non_square_grid_with_prefix_tokens(residual):
    peg = posattn.build_phi('peg', dim=6, residual=residual).double()
    x = torch.randn(2, 2 + 5 * 3, 6, dtype=torch.float64)
    out = peg.tokens(x, TokenGrid(5, 3, 2))
    torch.testing.assert_close(out, naive_peg(x, peg.proj.weight, peg.proj.bias, 5, 3, 2, residual))
    assert torch.equal(out[:, :2], x[:, :2])


def test_zero_padding_encodes_position():
    """A constant input comes out different at the border than inside (CPVT Sec. 3.2)."""
    peg = posattn.build_phi('peg', dim=4)
    with torch.no_grad():
        out = peg.tokens(torch.ones(1, 16, 4), (4, 4))
    assert not torch.allclose(out[0, 0], out[0, 5])
    torch.testing.assert_close(out[0, 5], out[0, 6])


def test_as_attention_token_hook():
    layer = Attention(8, 2, phi='peg', num_prefix_tokens=1).double()
    x = torch.randn(2, 13, 8, dtype=torch.float64)
    mixed = naive_peg(x, layer.phi.proj.weight, layer.phi.proj.bias, 3, 4, 1, True)
    plain = Attention(8, 2, num_prefix_tokens=1).double()
    plain.load_state_dict({k: v for k, v in layer.state_dict().items() if not k.startswith('phi.')})
    torch.testing.assert_close(layer(x, (3, 4)), plain(mixed, (3, 4)))
    with pytest.raises(ValueError, match='got 12 tokens for a 3x4 grid with 1 extra token; expected 13'):
        layer(x[:, 1:], (3, 4))
