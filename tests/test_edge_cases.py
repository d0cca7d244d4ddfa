"""Inputs that are accepted must be right, and the rest must fail with an error that helps: grid
sizes, degenerate grids, biases and key masks, pickling, checkpoint files, scripting, and the
analysis of windowed models."""
import copy
import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import posattn
from posattn import Attention, TokenGrid
from posattn.analysis import collect_attention_maps
from posattn.functional import attention_probs, biased_attention
from posattn.models.pervit import PerViT
from posattn.reference import (irpe_attention, irpe_bucket_ids, peripheral_attention, peripheral_position_attention,
                               softmax_attention)
from posattn.window import GridWindows

from conftest import randomise_peripheral


@pytest.mark.parametrize('hw', [(4.9, 5.9), '45', (True, True), (4, 5.0), (torch.tensor(4.0), 5)])
def test_grid_sizes_must_be_integers(hw):
    layer = Attention(16, 2)
    with pytest.raises(TypeError, match='hw|integer'):
        layer(torch.randn(2, 20, 16), hw)


@pytest.mark.parametrize('hw', [(np.int64(4), np.int32(5)), (torch.tensor(4), torch.tensor(5))])
def test_integer_like_grid_sizes_are_accepted(hw):
    layer = Attention(16, 2)
    assert layer(torch.randn(2, 20, 16), hw).shape == (2, 20, 16)
    assert TokenGrid.of(hw) == TokenGrid(4, 5)


# iRPE on q, k and v (contextual mode): its logits terms and its value term.
DEGENERATE_PHI_CFGS = {'none': {}, 'peg': {}, 'peripheral': {}, 'irpe': dict(mode='ctx', on='qkv', num_prefix_tokens=1)}


def drawn_layer(phi, seed):
    """A float64 layer with a class token and every parameter drawn (the peripheral Φp's at the
    scales of conftest.randomise_peripheral, where its Φp stays representable)."""
    layer = Attention(16, 2, phi=phi, num_prefix_tokens=1, phi_cfg=DEGENERATE_PHI_CFGS[phi]).double()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64) * 0.5)
    if phi == 'peripheral':
        randomise_peripheral(layer.phi, seed)
    return layer


def peg_on_a_line(x, weight, bias, height, width):
    """CPVT's PEG, tokens + depthwise 3 x 3 convolution with zero padding, written out for a grid one
    token high or one token wide, where only the kernel's middle row (column) meets a token."""
    kernel = weight[:, 0, 1, :] if height == 1 else weight[:, 0, :, 1]  # (C, 3)
    tokens = x[:, 1:]  # (B, H*W, C)
    padded = F.pad(tokens, (0, 0, 1, 1))  # a zero token before the first and after the last
    conv = sum(padded[:, i:i + tokens.shape[1]] * kernel[:, i] for i in range(3)) + bias
    return torch.cat([x[:, :1], tokens + conv], 1)


def reference_output(phi, layer, x, height, width):
    """``layer(x, (height, width))`` by the plain float64 formulas of posattn.reference."""
    weights = (layer.qkv.weight, layer.qkv.bias, layer.proj.weight, layer.proj.bias, layer.num_heads)
    if phi == 'peripheral':
        position = peripheral_position_attention(height, width, layer.phi.weights())
        return peripheral_attention(x, *weights, position, num_prefix_tokens=1)
    if phi == 'irpe':
        tables = {target: [getattr(layer.phi, f'rpe_{target}').lookup_table_weight] for target in 'qkv'}
        ids = irpe_bucket_ids(height, width, 1, layer.phi.method, layer.phi.ratio)
        return irpe_attention(x, *weights, tables, ids, 'ctx')
    if phi == 'peg':
        x = peg_on_a_line(x, layer.phi.proj.weight, layer.phi.proj.bias, height, width)
    return softmax_attention(x, *weights)


@pytest.mark.parametrize('height,width', [(1, 1), (1, 7), (7, 1)])
@pytest.mark.parametrize('phi', sorted(DEGENERATE_PHI_CFGS))
def test_degenerate_grids_give_the_reference_values_and_gradients(phi, height, width):
    """One token, one row, one column: every Φp's output and its gradients in the input and every
    parameter equal the plain formulas' (float64)."""
    layer = drawn_layer(phi, seed=10 * height + width)
    x = torch.randn(2, 1 + height * width, 16, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(2, 1 + height * width, 16, dtype=torch.float64)
    leaves = [x, *layer.parameters()]
    out, expected = layer(x, (height, width)), reference_output(phi, layer, x, height, width)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    got = torch.autograd.grad(out, leaves, upstream, allow_unused=True)
    want = torch.autograd.grad(expected, leaves, upstream, allow_unused=True)
    for leaf, g, w in zip(leaves, got, want):
        g, w = (torch.zeros_like(leaf) if t is None else t for t in (g, w))
        torch.testing.assert_close(g, w, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize('phi', posattn.list_phis())
def test_a_key_mask_that_is_no_tensor_is_refused_with_the_fix(phi):
    layer = Attention(dim=32, num_heads=2, phi=phi, num_prefix_tokens=1)
    with pytest.raises(TypeError, match=r'key_mask must be a bool tensor of shape \(B, N\) = \(2, 10\), got a list: '
                                        r'pass torch.tensor\(mask, dtype=torch.bool\)'):
        layer(torch.randn(2, 10, 32), (3, 3), key_mask=[[True] * 10] * 2)


@pytest.mark.parametrize('kernel', [biased_attention, attention_probs])
def test_a_bool_bias_is_refused_with_a_pointer_to_key_mask(kernel):
    q = torch.randn(2, 2, 6, 4)
    args = (q, q, q) if kernel is biased_attention else (q, q)
    with pytest.raises(TypeError, match='key_mask'):
        kernel(*args, torch.ones(1, 2, 6, 6, dtype=torch.bool))


def _masked_batch(layer, grid=(3, 4)):
    x = torch.randn(3, grid[0] * grid[1], layer.qkv.in_features, requires_grad=True)
    key_mask = torch.ones(3, grid[0] * grid[1], dtype=torch.bool)
    key_mask[1] = False  # sequence 1 has no key at all
    key_mask[2, :5] = False  # sequence 2 keeps some
    return x, key_mask


# Each route the layer can take: fused SDPA without a bias, the cached bias at eval, the tiled
# CPU backward with a bias gradient, and materialised probabilities (attention dropout).
ROUTES = {
    'none-eval': dict(phi='none', train=False, grad=False),
    'peripheral-eval-cached': dict(phi='peripheral', train=False, grad=False),
    'peripheral-train': dict(phi='peripheral', train=True, grad=True),
    'peripheral-probs': dict(phi='peripheral', train=True, grad=True, attn_drop=1e-9),
    'irpe-v-probs': dict(phi='irpe', phi_cfg=dict(mode='ctx', on='v'), train=True, grad=True),
}


@pytest.mark.parametrize('route', ROUTES)
def test_a_sequence_with_no_key_gets_zero_attention_and_finite_gradients(route):
    cfg = dict(ROUTES[route])
    train, grad = cfg.pop('train'), cfg.pop('grad')
    torch.manual_seed(0)
    layer = Attention(16, 2, **cfg).train(train)
    with torch.no_grad():
        layer.proj.bias.normal_()
    x, key_mask = _masked_batch(layer)
    with torch.set_grad_enabled(grad):
        out = layer(x, (3, 4), key_mask)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[1], layer.proj.bias.detach().expand(12, 16), rtol=0, atol=1e-6)
    if grad:
        out.square().sum().backward()
        grads = [x.grad] + [p.grad for p in layer.parameters() if p.grad is not None]
        assert all(torch.isfinite(g).all() for g in grads)
        assert torch.count_nonzero(x.grad[1]) == 0


def test_all_routes_agree_on_a_partly_masked_sequence():
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 2, 12, 4, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(1, 2, 12, 12, dtype=torch.float64, requires_grad=True)
    key_mask = torch.ones(3, 12, dtype=torch.bool)
    key_mask[1] = False
    key_mask[2, :5] = False
    through_probs = attention_probs(q, k, bias, key_mask) @ v
    fused = biased_attention(q, k, v, bias.detach(), key_mask)
    tiled = biased_attention(q, k, v, bias, key_mask)
    torch.testing.assert_close(fused, through_probs, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(tiled, through_probs, rtol=1e-10, atol=1e-12)
    assert torch.count_nonzero(through_probs[1]) == 0


@pytest.mark.parametrize('name', ['pervit_tiny', 'vit_tiny'])
def test_models_pickle_and_round_trip(name):
    torch.manual_seed(0)
    model = posattn.create_model(name, phi='peripheral') if name == 'vit_tiny' else posattn.create_model(name)
    model.eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        expected = model(x)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        assert torch.equal(restored(x), expected)
        assert torch.equal(copy.deepcopy(model)(x), expected)


@pytest.mark.parametrize('phi', posattn.list_phis())
def test_layers_of_every_phi_pickle(phi):
    layer = Attention(16, 2, phi=phi, num_prefix_tokens=1).eval()
    x = torch.randn(2, 13, 16)
    with torch.no_grad():
        expected = layer(x, (3, 4))
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    with torch.no_grad():
        assert torch.equal(torch.load(buffer, weights_only=False)(x, (3, 4)), expected)


def test_channel_and_dtype_mismatches_name_the_problem():
    layer = Attention(64, 4)
    with pytest.raises(ValueError, match='32 channels; this layer has dim 64'):
        layer(torch.randn(2, 20, 32), (4, 5))
    with pytest.raises(TypeError, match='float64 but the layer.s parameters are torch.float32'):
        layer(torch.randn(2, 20, 64, dtype=torch.float64), (4, 5))
    with torch.autocast('cpu', dtype=torch.bfloat16):  # autocast mixes dtypes on purpose
        assert layer(torch.randn(2, 20, 64), (4, 5)).dtype == torch.bfloat16


@pytest.mark.parametrize('content,message', [(b'', 'is empty'), (b'name,score\nx,1\n', 'not a PyTorch checkpoint')])
def test_a_file_that_is_not_a_checkpoint_says_so(tmp_path, content, message):
    path = tmp_path / 'weights.pth'
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        posattn.create_model('pervit_tiny', checkpoint=path)


def test_a_truncated_checkpoint_says_so(tmp_path):
    path = tmp_path / 'weights.pth'
    torch.save(posattn.create_model('pervit_tiny').state_dict(), path)
    path.write_bytes(path.read_bytes()[:100_000])
    with pytest.raises(ValueError, match='damaged or truncated'):
        posattn.create_model('pervit_tiny', checkpoint=path)


def test_torch_jit_script_is_refused_with_the_alternatives():
    with pytest.raises(RuntimeError, match='torch.jit.script.*torch.compile'):
        torch.jit.script(posattn.create_model('pervit_tiny'))


def test_analysis_of_a_windowed_model_gives_padded_keys_no_weight():
    torch.manual_seed(0)
    model = PerViT(embed_dims=(16, 24), depths=(1, 1), num_heads=2, stem_dims=(4, 8), num_classes=0,
                   window_size=3, global_blocks=(1,))
    images = torch.randn(2, 3, 16, 20)  # stride 4: a 4 x 5 grid, 3 x 3 windows with padding
    maps = collect_attention_maps(model, images)
    windowed = maps['blocks.0.attn']
    padded_keys = ~GridWindows(TokenGrid(4, 5), 3).key_mask(2)  # (windows, 9)
    assert padded_keys.any()
    for attention in (windowed.content, windowed.mixed):
        weight_on_padding = attention.masked_select(padded_keys[:, None, None, :].expand_as(attention))
        assert torch.count_nonzero(weight_on_padding) == 0
        torch.testing.assert_close(attention.sum(-1), torch.ones_like(attention.sum(-1)))
