"""posattn.Attention: the release's MPA formula, plain MHSA, gradients, caching and errors; the
tests that take ``device`` run the layer on ``pytest --device`` (conftest.py), the references on the CPU."""
import copy

import pytest
import torch

import posattn
from posattn import Attention, TokenGrid

from posattn.reference import peripheral_attention, peripheral_position_attention, softmax_attention

from conftest import gradcheck_layer, leaves_on, randomise_peripheral


def peripheral_layer(dim=16, num_heads=2, num_prefix_tokens=1, seed=0, dtype=torch.float64):
    layer = Attention(dim, num_heads, phi='peripheral', num_prefix_tokens=num_prefix_tokens).to(dtype)
    randomise_peripheral(layer.phi, seed)
    return layer


def release_phi(layer, height, width):
    """The layer's Φp computed the straightforward way (posattn.reference)."""
    with torch.no_grad():
        return peripheral_position_attention(height, width, layer.phi.weights())


def layer_weights(layer):
    return layer.qkv.weight, layer.qkv.bias, layer.proj.weight, layer.proj.bias


@pytest.mark.parametrize('height,width,prefix', [(4, 5, 1), (3, 3, 0), (1, 6, 2), (5, 2, 1)])
def test_peripheral_equals_release_formula(height, width, prefix, device):
    layer = peripheral_layer(num_prefix_tokens=prefix, seed=height + width)
    x = torch.randn(3, prefix + height * width, 16, dtype=torch.float64)
    expected = peripheral_attention(x, *layer_weights(layer), 2, release_phi(layer, height, width), prefix)
    out = layer.to(device)(x.to(device), (height, width))
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-10, atol=1e-12)


def test_none_equals_plain_softmax_attention(device):
    layer = Attention(16, 4).double()
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    expected = softmax_attention(x, *layer_weights(layer), 4)
    torch.testing.assert_close(layer.to(device)(x.to(device), (2, 5)).cpu(), expected, rtol=1e-10, atol=1e-12)
    assert isinstance(layer.phi, posattn.build_phi('none').__class__)


def test_gradcheck_through_layer_and_phi_parameters(device):
    """Gradients of the input and of every parameter, Φp included, on a 3 x 4 grid with a class token."""
    layer = peripheral_layer(dim=8, num_heads=2, num_prefix_tokens=1)
    assert gradcheck_layer(layer.to(device), torch.randn(2, 13, 8, dtype=torch.float64).to(device), (3, 4))


def test_phi_does_not_depend_on_the_batch():
    layer = peripheral_layer()
    x = torch.randn(4, 21, 16, dtype=torch.float64)
    together = layer(x, (4, 5))
    for i in range(4):
        torch.testing.assert_close(layer(x[i:i + 1], (4, 5)), together[i:i + 1], rtol=1e-12, atol=1e-12)
    q = torch.randn(4, 2, 21, 8, dtype=torch.float64)
    bias = layer.phi.logits_bias(q, q, TokenGrid(4, 5, 1))
    assert bias.shape == (1, 2, 21, 21)
    torch.testing.assert_close(bias, layer.phi.logits_bias(q[:1] * 3, q[1:2], TokenGrid(4, 5, 1)))
    assert torch.all(bias[:, :, 0, :] == 0) and torch.all(bias[:, :, :, 0] == 0)


def test_sharp_phi_stays_exact_where_release_formula_fails():
    """z around -60: the release's L1 normalisation clamps at 1e-12 and loses the rows."""
    layer = peripheral_layer(dim=16, num_heads=2, num_prefix_tokens=0, seed=4)
    with torch.no_grad():
        layer.phi.norm2_bias.fill_(-60.0)
        layer.phi.norm2_weight.fill_(2.0)
    x = torch.randn(2, 20, 16, dtype=torch.float64)
    log_phi = torch.log(release_phi(layer, 4, 5))
    assert log_phi.max() < -50
    expected = softmax_attention(x, *layer_weights(layer), 2, log_phi)
    layer32 = Attention(16, 2, phi='peripheral').float()
    layer32.load_state_dict({k: v.float() for k, v in layer.state_dict().items()})
    out32 = layer32(x.float(), (4, 5))
    assert torch.isfinite(out32).all()
    torch.testing.assert_close(out32.double(), expected, rtol=1e-4, atol=1e-5)
    release = peripheral_attention(x, *layer_weights(layer), 2, release_phi(layer, 4, 5), 0)
    assert (release - expected).abs().max() > 1e-2


def test_float32_layer_tracks_float64_layer(device):
    """The float32 layer on the device against the float64 layer on the CPU."""
    layer64 = peripheral_layer(dim=32, num_heads=4, num_prefix_tokens=1, seed=8)
    layer32 = Attention(32, 4, phi='peripheral', num_prefix_tokens=1)
    layer32.load_state_dict({k: v.float() for k, v in layer64.state_dict().items()})
    x = torch.randn(2, 1 + 14 * 14, 32, dtype=torch.float64)
    out32 = layer32.to(device)(x.float().to(device), (14, 14))
    error = (out32.cpu().double() - layer64(x, (14, 14))).abs().max()
    assert error < 1e-5


# bf16 keeps 8 significant bits: u = 2^-8. Under autocast the layer rounds x and the qkv and proj
# weights to bf16 and its output too (u / 2 alone); against float64 it lands 0.95-1.33 u of
# max|out| off over eight seeds, so 4 u (1.6%) leaves 3x headroom for other CPUs' bf16 GEMMs.
BF16_TOLERANCE = 4 * 2.0 ** -8


def test_bf16_autocast_keeps_phi_finite(device):
    """bf16 autocast on the device against the float64 layer on the CPU."""
    layer = Attention(32, 4, phi='peripheral', phi_cfg=dict(layer_index=0, num_layers=12))
    x = torch.randn(2, 49, 32)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = copy.deepcopy(layer).to(device)(x.to(device), (7, 7)).cpu()
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    with torch.no_grad():
        expected = layer.double()(x.double(), (7, 7))
    error = (out.double() - expected).abs().max() / expected.abs().max()
    assert error <= BF16_TOLERANCE, f'{error / 2.0 ** -8:.2f} u'


def output_and_gradients(layer, x, upstream, attend):
    """``attend(layer, x)`` and its gradients in x, the qkv and proj weights and every Φp weight
    (zeros for those it does not use), all on the CPU."""
    (x,) = leaves_on(x.device, x)
    leaves = [x, *layer_weights(layer), *[w for w in layer.phi.weights() if w is not None]]
    out = attend(layer, x)
    grads = torch.autograd.grad(out, leaves, upstream.to(x.device), allow_unused=True)
    return [out.cpu()] + [torch.zeros_like(leaf).cpu() if g is None else g.cpu() for leaf, g in zip(leaves, grads)]


@pytest.mark.parametrize('height,width', [(1, 1), (1, 7), (7, 1), (6, 9)])
def test_any_grid_shape_trains(height, width, device):
    """Degenerate grids (one token, one row, one column) give the release formula's output and
    its gradients in the input and every parameter, Φp included (float64 reference on the CPU)."""
    layer = peripheral_layer(seed=10 * height + width)
    x = torch.randn(2, 1 + height * width, 16, dtype=torch.float64)
    upstream = torch.randn_like(x)

    def release(layer, x):
        phi = peripheral_position_attention(height, width, layer.phi.weights())
        return peripheral_attention(x, *layer_weights(layer), 2, phi, 1)
    expected = output_and_gradients(layer, x, upstream, release)
    got = output_and_gradients(copy.deepcopy(layer).to(device), x.to(device), upstream,
                               lambda layer, x: layer(x, (height, width)))
    torch.testing.assert_close(got[0], expected[0], rtol=1e-10, atol=1e-12)
    for got_grad, want in zip(got[1:], expected[1:]):
        assert torch.isfinite(got_grad).all()
        torch.testing.assert_close(got_grad, want, rtol=1e-8, atol=1e-10)


class TestErrors:
    def test_token_count_names_expected(self):
        layer = Attention(16, 2, phi='peripheral', num_prefix_tokens=1)
        with pytest.raises(ValueError, match=r'got 200 tokens for a 14x14 grid with 1 extra token; expected 197'):
            layer(torch.randn(1, 200, 16), (14, 14))
        with pytest.raises(ValueError, match=r'got 196 tokens for a 14x14 grid with 2 extra tokens; expected 198'):
            Attention(16, 2, num_prefix_tokens=2)(torch.randn(1, 196, 16), (14, 14))

    def test_dim_not_divisible_by_heads(self):
        with pytest.raises(ValueError, match='dim 100 is not divisible by num_heads 3'):
            Attention(100, 3)

    def test_unknown_phi_lists_known(self):
        with pytest.raises(ValueError, match=r"unknown Φp 'peripherals'; known: .*none.*peripheral"):
            Attention(16, 2, phi='peripherals')

    def test_unknown_phi_option(self):
        with pytest.raises(TypeError, match=r"Φp 'peripheral' got unknown option\(s\) 'heads' \(did you mean "
                                            r"'num_heads'\?\); it takes: num_heads"):
            Attention(16, 2, phi='peripheral', phi_cfg=dict(heads=3))
        with pytest.raises(TypeError, match=r"unknown option\(s\) 'colour', 'table_sise' \(did you mean 'table_size'"
                                            r"\?\); it takes"):
            Attention(16, 2, phi='rpb', phi_cfg=dict(table_sise=(3, 3), colour='red'))

    def test_empty_grid(self):
        layer = Attention(16, 2, phi='peripheral')
        with pytest.raises(ValueError, match='empty grid 0x5'):
            layer(torch.randn(1, 0, 16), (0, 5))

    def test_bad_hw_and_shapes(self):
        layer = Attention(16, 2)
        with pytest.raises(TypeError, match=r'hw must be a \(height, width\) pair, got 16'):
            layer(torch.randn(1, 16, 16), 16)
        with pytest.raises(ValueError, match=r'expected tokens \(B, N, C\), got shape \(16, 16\)'):
            layer(torch.randn(16, 16), (4, 4))
        with pytest.raises(ValueError, match='does not match this layer, which has 0 extra tokens'):
            layer(torch.randn(1, 17, 16), TokenGrid(4, 4, 1))

    def test_phi_cfg_with_built_module(self):
        with pytest.raises(ValueError, match='phi_cfg applies to a Φp given by name'):
            Attention(16, 2, phi=posattn.build_phi('none'), phi_cfg=dict(x=1))
