"""PerViT-T/S/M: layout, initialisation, any input size, Φp recomputation and caching, precision,
torch.compile and errors; the tests that take ``device`` run the model on ``pytest --device``
(conftest.py). Parity with the release is in test_convert.py (on the device: test_on_device.py)."""
import copy
import time

import pytest
import torch
from torch import nn

import posattn
from posattn.models.pervit import PerViT
from posattn.phi.peripheral import PeripheralPhi

NAMES = ['pervit_tiny', 'pervit_small', 'pervit_medium']


@pytest.fixture(scope='module')
def tiny():
    torch.manual_seed(0)
    return posattn.create_model('pervit_tiny')


@pytest.fixture
def phi_calls(monkeypatch):
    """(height, width) of every Φp evaluation (cache hits do not evaluate)."""
    calls = []
    original = PeripheralPhi.log_position_attention

    def counted(self, height, width, *embedding):
        calls.append((height, width))
        return original(self, height, width, *embedding)
    monkeypatch.setattr(PeripheralPhi, 'log_position_attention', counted)
    return calls


@pytest.mark.parametrize('name,release_count', list(zip(NAMES, [7_591_000, 21_317_672, 43_723_936])))
def test_parameter_counts_are_the_release_s_without_its_cancelled_biases(name, release_count):
    """The release's count (the paper's) less the distance embedding's bias and the PP1 / PP2 biases
    of the 12 layers (4 * heads + 12 * (4 * heads + heads)); 294 - 25 state_dict entries."""
    model = posattn.create_model(name)
    heads = model.blocks[0].attn.num_heads
    assert sum(p.numel() for p in model.parameters()) == release_count - 4 * heads - 12 * 5 * heads
    assert len(model.state_dict()) == 294 - 25  # the release's entries, BatchNorm buffers included


def test_release_layout(tiny):
    widths = [block.norm1.normalized_shape[0] for block in tiny.blocks]
    assert widths == [128] * 2 + [192] * 2 + [224] * 6 + [280] * 2
    res = {i: (b.res.in_features, b.res.out_features) for i, b in enumerate(tiny.blocks) if isinstance(b.res, nn.Linear)}
    assert res == {1: (128, 192), 3: (192, 224), 9: (224, 280)}
    assert all(b.mlp.fc2.out_features == b.res(torch.zeros(1, widths[i])).shape[-1] for i, b in enumerate(tiny.blocks))
    for block in tiny.blocks:
        assert block.attn.qkv.bias is None and block.attn.proj.bias is not None
        assert block.attn.num_heads == 4 and block.mlp.act.approximate == 'none'
        assert block.norm1.eps == block.norm2.eps == 1e-6
        assert block.attn.phi.call_inputs == ('distance_embedding',) and block.attn.phi.distance_embedding is None
        assert not block.cpe.residual and block.cpe.proj.groups == block.cpe.proj.in_channels
    assert [k for k in tiny.state_dict() if 'distance_embedding' in k] == ['distance_embedding.weight']
    stem = [layer.conv.out_channels for layer in tiny.stem.layers]
    assert stem == [48, 64, 96, 128] and tiny.stem.proj.out_channels == 128 and tiny.norm.eps == 1e-6


def test_release_initialisation(tiny):
    sizes = torch.linspace(-5, 4, 12)
    strengths = torch.linspace(3, 0.01, 12)
    for i, block in enumerate(tiny.blocks):
        phi = block.attn.phi
        assert torch.allclose(phi.norm2_bias, sizes[i].expand(4)) and torch.allclose(phi.norm2_weight, strengths[i].expand(4))
        assert torch.all(phi.proj1_weight == 0.02) and torch.all(phi.proj2_weight == 0.02)
    assert torch.all(tiny.distance_embedding.weight == -0.02)
    linears = [m for m in tiny.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 12 * 4 + 3 + 1  # qkv, proj, fc1, fc2; 3 res; head
    weights = torch.cat([m.weight.flatten() for m in linears])
    assert abs(weights.std().item() - 0.02) < 5e-4
    assert all(torch.all(m.bias == 0) for m in linears if m.bias is not None)


def test_drop_path_rises_linearly():
    model = posattn.create_model('pervit_small', drop_path_rate=0.1)
    rates = [block.drop_path1.drop_prob for block in model.blocks]
    assert rates == pytest.approx(torch.linspace(0, 0.1, 12).tolist())
    with pytest.raises(TypeError, match="num_heads: set by the model name 'pervit_small'; build PerViT directly"):
        posattn.create_model('pervit_small', num_heads=4)


@pytest.mark.parametrize('height,width', [(160, 224), (320, 320), (120, 200)])
def test_any_input_size_builds_phi_for_its_grid(tiny, phi_calls, height, width):
    tiny.eval()
    images = torch.randn(1, 3, height, width)
    grid = (-(-height // 16), -(-width // 16))
    with torch.no_grad():
        features = tiny.forward_features(images)
        logits = tiny.forward_head(features)
    assert features.shape == (1, 280, *grid) and logits.shape == (1, 1000)
    assert phi_calls == [grid] * 12 and torch.isfinite(logits).all()


@pytest.mark.slow
def test_large_non_square_input(tiny, phi_calls):
    tiny.eval()
    with torch.no_grad():
        maps = tiny.forward_intermediates(torch.randn(1, 3, 512, 640), [3, 11], intermediates_only=True)
    assert [m.shape for m in maps] == [(1, 224, 32, 40), (1, 280, 32, 40)]
    assert set(phi_calls) == {(32, 40)}


def test_phi_is_computed_once_per_layer_and_forward_unless_cached(phi_calls):
    model = posattn.create_model('pervit_tiny', num_classes=10)
    images = torch.randn(2, 3, 64, 96)
    model.train()
    model(images).sum().backward()
    model(images).sum().backward()
    assert phi_calls == [(4, 6)] * 24
    model.eval()
    with torch.no_grad():
        first = model(images)
        assert len(phi_calls) == 36
        with posattn.cache_positions(model):
            model(images)
            second = model(images)
            assert len(phi_calls) == 48  # the second forward in the cache reads it
            model(torch.randn(1, 3, 32, 32))
    assert phi_calls[48:] == [(2, 2)] * 12
    torch.testing.assert_close(first, second, rtol=0, atol=0)


def test_gradients_reach_every_layer_through_the_shared_distance_embedding():
    model = posattn.create_model('pervit_tiny', num_classes=10)
    model(torch.randn(2, 3, 64, 64)).logsumexp(-1).sum().backward()
    assert model.distance_embedding.weight.grad.abs().sum() > 0
    for block in model.blocks:
        assert block.attn.phi.norm2_bias.grad.abs().sum() > 0
        assert block.attn.qkv.weight.grad.abs().sum() > 0 and block.cpe.proj.weight.grad.abs().sum() > 0


def test_features_and_intermediates(tiny):
    tiny.eval()
    images = torch.randn(2, 3, 96, 64)
    with torch.no_grad():
        features = tiny.forward_features(images)
        final, maps = tiny.forward_intermediates(images, [11, 1, 3, 9])
        last = maps[-1].permute(0, 2, 3, 1)
        torch.testing.assert_close(features, tiny.norm(last).permute(0, 3, 1, 2))
        torch.testing.assert_close(final, features)
        torch.testing.assert_close(tiny(images), tiny.head(features.mean((2, 3))))
        normed = tiny.forward_intermediates(images, 2, norm=True, intermediates_only=True)
        torch.testing.assert_close(normed[-1], features)
        torch.testing.assert_close(normed[0], tiny.forward_intermediates(images, [10], intermediates_only=True)[0])
    assert [m.shape for m in maps] == [(2, 192, 6, 4), (2, 224, 6, 4), (2, 280, 6, 4), (2, 280, 6, 4)]
    with pytest.raises(ValueError, match=r'indices \[3, 12\] must name blocks in 0..11 \(or -12..-1\)'):
        tiny.forward_intermediates(images, [3, 12])


def test_headless_model_returns_pooled_features():
    model = posattn.create_model('pervit_tiny', num_classes=0).eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 32, 48)).shape == (1, 280)


def test_bad_input_errors(tiny):
    with pytest.raises(ValueError, match=r'expected images \(B, 3, H, W\), got shape \(2, 1, 64, 64\); '
                                         r'convert them to RGB'):
        tiny(torch.randn(2, 1, 64, 64))
    with pytest.raises(ValueError, match=r'expected images \(B, 3, H, W\), got shape \(3, 64, 64\)'):
        tiny(torch.randn(3, 64, 64))
    with pytest.raises(ValueError, match='input of 8x224 pixels is too small for the stem, which downsamples '
                                         'by 16: each side needs at least 16 pixels'):
        tiny(torch.randn(1, 3, 8, 224))
    grey = PerViT(in_chans=1, num_classes=0).eval()
    with torch.no_grad():
        assert grey(torch.randn(1, 1, 32, 32)).shape == (1, 280)
    with pytest.raises(ValueError, match=r'expected images \(B, 1, H, W\), got shape \(1, 3, 32, 32\)$'):
        grey(torch.randn(1, 3, 32, 32))
    with pytest.raises(ValueError, match=r'stage widths \[130\] are not divisible by num_heads 4'):
        PerViT(embed_dims=(128, 130, 224, 280))
    with pytest.raises(ValueError, match="unknown model 'pervit_large'; known: .*pervit_medium"):
        posattn.create_model('pervit_large')


def test_bf16_autocast_keeps_phi_finite(device):
    model = posattn.create_model('pervit_tiny', num_classes=10)
    with torch.no_grad():  # a sharp Φp: sigmoid underflows to 0 far from the query; its log does not
        for block in model.blocks:
            block.attn.phi.norm2_weight.fill_(40.0)
    model.to(device)
    images = torch.randn(2, 3, 64, 80).to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        logits = model(images)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    logits.float().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        logits = model(images)
        bias = model.blocks[0].attn.phi.logits_bias(torch.zeros(1, 4, 20, 32, dtype=torch.bfloat16, device=device),
                                                    None, posattn.TokenGrid(4, 5),
                                                    distance_embedding=model.distance_embedding)
    assert bias.dtype == torch.bfloat16 and torch.isfinite(bias).all() and bias.min() < -30
    # bf16 keeps 8 significant bits, u = 2^-8; through the 12 blocks of this model the logits land
    # 1.25-2.42 u of max|logits| off float64 over six seeds (fp32 is within 1e-6 of float64 here, and
    # 30 times faster): 6 u (2.3%) leaves 2.5x headroom.
    with torch.no_grad():
        expected = model(images)
    error = (logits.float() - expected).abs().max() / expected.abs().max()
    assert error <= 6 * 2.0 ** -8, f'{error / 2.0 ** -8:.2f} u'


@pytest.mark.slow
def test_torch_compile_matches_eager(tiny, device):
    model = copy.deepcopy(tiny).to(device).eval()
    images = torch.randn(2, 3, 224, 224).to(device)
    with torch.no_grad():
        eager = model(images)
        compiled = torch.compile(model)
        start = time.perf_counter()
        out = compiled(images)
        print(f'torch.compile of pervit_tiny: first call {time.perf_counter() - start:.1f} s')
        torch.testing.assert_close(out, eager, rtol=0, atol=1e-4)
        torch.testing.assert_close(compiled(images), eager, rtol=0, atol=1e-4)
