"""gpsa: ConViT's gated positional self-attention against the float64 formula, timm's offsets and
local init, the gate's limits, the key mask, gradients, training, the position cache, errors (the
meta device: tests/test_gpu_readiness.py)."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

import posattn
from posattn import Attention, TokenGrid
from posattn.functional import attention_probs
from posattn.phi.gpsa import GatedPositionalAttention, local_offsets, relative_offsets
from posattn.reference import gpsa_attention, gpsa_position_attention

from conftest import gradcheck_layer

GRIDS = [(3, 5), (4, 2), (1, 1), (1, 4)]


def drawn_gpsa_layer(dim=24, num_heads=3, prefix=0, seed=0):
    """A float64 layer with gpsa whose pos_proj and gates are drawn (the gates start at 1)."""
    torch.manual_seed(seed)
    layer = Attention(dim, num_heads, phi='gpsa', num_prefix_tokens=prefix).double()
    with torch.no_grad():
        layer.phi.pos_proj.weight.normal_(0, 0.5)
        layer.phi.pos_proj.bias.normal_()
        layer.phi.gating_param.copy_(torch.linspace(-2, 3, num_heads, dtype=torch.float64))
    return layer


def reference_output(layer, x, height, width):
    phi = layer.phi
    return gpsa_attention(x, layer.qkv.weight, layer.qkv.bias, layer.proj.weight, layer.proj.bias, layer.num_heads,
                          phi.pos_proj.weight, phi.pos_proj.bias, phi.gating_param, height, width,
                          layer.num_prefix_tokens)


# --- the formula ------------------------------------------------------------------------------

@pytest.mark.parametrize('height,width', GRIDS)
@pytest.mark.parametrize('prefix', [0, 1, 2])
def test_layer_output_matches_the_float64_reference(height, width, prefix):
    """The whole GPSA layer pair by pair (posattn.reference): content and positional attention mixed by
    the gate, renormalised; prefix queries keep their content attention."""
    layer = drawn_gpsa_layer(prefix=prefix)
    x = torch.randn(2, prefix + height * width, 24, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x, (height, width)), reference_output(layer, x, height, width),
                                   rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('height,width', [(3, 5), (4, 2)])
def test_position_attention_matches_the_pair_formula(height, width):
    phi = drawn_gpsa_layer(num_heads=4).phi
    got = phi.position_attention(height, width)
    assert got.shape == (4, height * width, height * width) and got.dtype == torch.float64
    expected = gpsa_position_attention(phi.pos_proj.weight.detach(), phi.pos_proj.bias.detach(), height, width)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-14)


def test_offsets_are_timms_rel_indices():
    """(dx, dy, dx² + dy²), key minus query, in timm's channel order, on the square grids timm takes."""
    convit = pytest.importorskip('timm.models.convit')
    gpsa = convit.GPSA(8, num_heads=2)
    for size in (1, 3, 4):
        timms = gpsa.get_rel_indices(size * size)[0]  # (N, N, 3)
        assert torch.equal(relative_offsets(size, size).permute(1, 2, 0), timms)


def test_offsets_on_a_non_square_grid_are_key_minus_query():
    dx, dy, squared = relative_offsets(2, 3)  # token 1 is (row 0, col 1), token 5 is (row 1, col 2)
    assert (dx[1, 5].item(), dy[1, 5].item(), squared[1, 5].item()) == (1, 1, 2)
    assert (dx[5, 0].item(), dy[5, 0].item(), squared[5, 0].item()) == (-2, -1, 5)


@pytest.mark.parametrize('prefix', [0, 1])
def test_rows_sum_to_one_and_prefix_queries_keep_their_content_attention(prefix):
    layer = drawn_gpsa_layer(prefix=prefix)
    grid = TokenGrid(3, 4, prefix)
    content = torch.rand(2, 3, grid.num_tokens, grid.num_tokens, dtype=torch.float64).softmax(-1)
    mixed = layer.phi.mix_probabilities(content, grid)
    torch.testing.assert_close(mixed.sum(-1), torch.ones(2, 3, grid.num_tokens, dtype=torch.float64),
                               rtol=0, atol=1e-14)
    torch.testing.assert_close(mixed[:, :, :prefix], content[:, :, :prefix], rtol=1e-15, atol=0)  # renormalised
    assert not torch.allclose(mixed[:, :, prefix:], content[:, :, prefix:])


@pytest.mark.parametrize('prefix', [0, 2])
def test_the_gate_at_its_limits_gives_pure_positional_or_pure_content_attention(prefix):
    layer = drawn_gpsa_layer(prefix=prefix)
    grid = TokenGrid(3, 4, prefix)
    x = torch.randn(2, grid.num_tokens, 24, dtype=torch.float64)
    content = torch.rand(2, 3, grid.num_tokens, grid.num_tokens, dtype=torch.float64).softmax(-1)
    with torch.no_grad():
        layer.phi.gating_param.fill_(float('inf'))
        positional = layer.phi.mix_probabilities(content, grid)
        position = layer.phi.position_attention(3, 4)
        torch.testing.assert_close(positional[:, :, prefix:, prefix:], position.expand(2, -1, -1, -1),
                                   rtol=0, atol=1e-15)
        assert torch.all(positional[:, :, prefix:, :prefix] == 0)
        layer.phi.gating_param.fill_(float('-inf'))
        torch.testing.assert_close(layer.phi.mix_probabilities(content, grid), content, rtol=1e-15, atol=0)
        plain = Attention(24, 3, phi='none', num_prefix_tokens=prefix).double()
        plain.load_state_dict({k: v for k, v in layer.state_dict().items() if not k.startswith('phi.')})
        torch.testing.assert_close(layer(x, grid), plain(x, grid), rtol=1e-13, atol=1e-14)


def test_key_mask_gives_masked_keys_no_weight_in_either_term():
    """Masked keys get 0; the positional softmax runs over the kept grid keys; a sequence with no grid
    key left keeps its content attention, one with no key at all a zero row."""
    layer = drawn_gpsa_layer(prefix=1)
    grid = TokenGrid(2, 3, 1)
    keep = torch.tensor([[1, 1, 0, 1, 1, 0, 1], [1, 0, 0, 0, 0, 0, 0], [0] * 7], dtype=torch.bool)
    q, k = (torch.randn(3, 3, 7, 8, dtype=torch.float64) for _ in range(2))
    content = attention_probs(q, k, None, keep)
    mixed = layer.phi.mix_probabilities(content, grid, keep)
    gate = torch.sigmoid(layer.phi.gating_param.detach())[:, None]
    position = layer.phi.position_attention(2, 3).detach()  # (heads, 6, 6)
    kept_grid = keep[0, 1:]
    expected = content[0].clone()
    masked_position = torch.zeros(3, 6, 7, dtype=torch.float64)
    masked_position[:, :, 1:][:, :, kept_grid] = (position[:, :, kept_grid]
                                                  / position[:, :, kept_grid].sum(-1, keepdim=True))
    for i in range(1, 7):
        expected[:, i] = (1 - gate) * content[0, :, i] + gate * masked_position[:, i - 1]
    torch.testing.assert_close(mixed[0], expected / expected.sum(-1, keepdim=True), rtol=0, atol=1e-14)
    assert torch.all(mixed[0][..., ~keep[0]] == 0)
    torch.testing.assert_close(mixed[1], content[1], rtol=0, atol=1e-15)  # the class token alone
    assert torch.all(content[1][..., 0] == 1)
    assert torch.equal(mixed[2], torch.zeros_like(mixed[2]))


# --- the mixture on the outputs -----------------------------------------------------------------

def content_and_values(batch, heads, tokens, key_mask=None, seed=3):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, tokens, 8, generator=generator, dtype=torch.float64) for _ in range(3))
    return attention_probs(q, k, None, key_mask), v


@pytest.mark.parametrize('height,width', GRIDS + [(5, 3)])
@pytest.mark.parametrize('prefix', [0, 2])
@pytest.mark.parametrize('masked', [False, True], ids=['whole_grid', 'key_mask'])
def test_the_mixture_on_the_outputs_is_the_mixed_probabilities_times_the_values(height, width, prefix, masked):
    """mix_outputs(A v, v) = mix_probabilities(A) v: P v as two 1D attentions over a whole grid (P is
    separable), the dense masked P under a key mask (the second sequence keeps no grid key, the third
    no key at all)."""
    layer = drawn_gpsa_layer(prefix=prefix)
    grid = TokenGrid(height, width, prefix)
    keep = None
    if masked:
        keep = torch.rand(3, grid.num_tokens, generator=torch.Generator().manual_seed(1)) > 0.3
        keep[0, -1] = True
        keep[1, prefix:] = False
        keep[1, 0] = True
        keep[2] = False
    attn, v = content_and_values(3, 3, grid.num_tokens, keep)
    expected = layer.phi.mix_probabilities(attn, grid, keep) @ v
    torch.testing.assert_close(layer.phi.mix_outputs(attn @ v, v, grid, keep), expected, rtol=0, atol=1e-14)


def test_rows_of_images_mix_on_the_outputs_as_their_probabilities_do():
    """mix_outputs_at = mix_probabilities_at(A) v on rows of images: a tall image lies transposed on the
    canvas; with the layout's own padding mask (canvas) and with a key mask of the caller's (dense)."""
    from posattn import ImageLayout
    from posattn.positions import token_positions
    layer = drawn_gpsa_layer(prefix=1)
    layout = ImageLayout.padded([TokenGrid(3, 5, 1), TokenGrid(5, 2, 1), TokenGrid(1, 1, 1), TokenGrid(4, 4, 1)], 1)
    positions = token_positions(layout, layout.num_rows, torch.device('cpu'))
    user_mask = positions.valid & (torch.rand(positions.valid.shape, generator=torch.Generator().manual_seed(2)) > .3)
    user_mask[:, 0] = True
    for key_mask in (positions.valid, user_mask):
        attn, v = content_and_values(positions.num_images, 3, positions.length, key_mask)
        expected = layer.phi.mix_probabilities_at(attn, positions, key_mask) @ v
        got = layer.phi.mix_outputs_at(attn @ v, v, positions, key_mask)
        valid = positions.valid[:, None, :, None].expand_as(got)  # padding rows are dropped by the layer
        torch.testing.assert_close(got[valid], expected[valid], rtol=0, atol=1e-14)


def test_the_layer_keeps_its_fused_kernel_unless_something_reads_the_probabilities():
    """gpsa mixes on the outputs; attention dropout while training, or a value term beside it in a
    stack, needs the probabilities: the layer then forms them, and gives the same output."""
    layer = drawn_gpsa_layer(prefix=1)
    assert layer.phi.mixes_outputs and not layer.phi.needs_probabilities
    assert not layer._materialises_probabilities()
    layer.attn_drop.p = 0.1
    assert layer.train()._materialises_probabilities() and not layer.eval()._materialises_probabilities()
    stack = Attention(24, 3, phi=['gpsa', 'irpe'], phi_cfg=[None, dict(on='v')],
                      num_prefix_tokens=1).double()
    assert stack.phi.mixes_outputs and stack.phi.needs_probabilities and stack._materialises_probabilities()
    twice = Attention(24, 3, phi=['gpsa', 'gpsa'], num_prefix_tokens=1).double()
    assert twice.phi.mixes_outputs and not twice._materialises_probabilities()
    x = torch.randn(2, 13, 24, dtype=torch.float64)
    fused = twice(x, (3, 4))
    twice.attn_drop.p = 1e-300  # forms the probabilities while training, drops nothing
    torch.testing.assert_close(twice.train()(x, (3, 4)), fused, rtol=1e-13, atol=1e-14)


def test_a_masked_layer_has_finite_gradients():
    layer = drawn_gpsa_layer(prefix=1)
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    keep = torch.tensor([[1, 0, 1, 1, 0, 1, 1], [0] * 7], dtype=torch.bool)
    layer(x, (2, 3), key_mask=keep).square().sum().backward()
    for param in layer.phi.parameters():
        assert torch.all(torch.isfinite(param.grad))


# --- timm's initialisation --------------------------------------------------------------------

@pytest.mark.parametrize('num_heads', [4, 5, 9, 16])
@pytest.mark.parametrize('locality_strength', [1.0, 0.5])
def test_local_init_is_timms(num_heads, locality_strength):
    """timm's GPSA.local_init writes the first k² rows of pos_proj (k = floor(sqrt(heads))); the bias
    is zero (timm's ConViT init) and every gate 1."""
    convit = pytest.importorskip('timm.models.convit')
    timms = convit.GPSA(num_heads * 2, num_heads=num_heads, locality_strength=locality_strength)
    timms.local_init()
    phi = posattn.build_phi('gpsa', num_heads=num_heads, locality_strength=locality_strength)
    local = math.isqrt(num_heads) ** 2
    torch.testing.assert_close(phi.pos_proj.weight[:local], timms.pos_proj.weight[:local], rtol=0, atol=0)
    assert torch.all(phi.pos_proj.bias == 0) and torch.all(phi.gating_param == 1)
    assert torch.all(phi.pos_proj.weight[local:].abs() < 0.1 * locality_strength)  # drawn, std 0.02


def test_local_init_centres_each_head_on_its_offset():
    """9 heads tile the 3 x 3 neighbourhood: head h1 + 3 h2 peaks at (dy, dx) = (h1 - 1, h2 - 1)
    from the query, timm's local_init order."""
    phi = posattn.build_phi('gpsa', num_heads=9, locality_strength=2.0)
    attention = phi.position_attention(7, 7).detach()
    centre = 3 * 7 + 3
    expected = [(h % 3 - 1, h // 3 - 1) for h in range(9)]
    peaks = [divmod(attention[h, centre].argmax().item(), 7) for h in range(9)]
    assert [(row - 3, col - 3) for row, col in peaks] == expected
    assert local_offsets(9) == tuple((dx, dy) for dy, dx in expected)


def test_without_local_init_positional_attention_is_nearly_uniform():
    phi = posattn.build_phi('gpsa', num_heads=4, local_init=False)
    attention = phi.position_attention(3, 3).detach()
    torch.testing.assert_close(attention, torch.full_like(attention, 1 / 9), rtol=0.2, atol=0)
    assert torch.all(phi.pos_proj.weight.abs() < 0.1) and torch.all(phi.pos_proj.bias == 0)


# --- gradients, models, cache -----------------------------------------------------------------

def test_gradients_reach_the_gate_and_pos_proj():
    """pos_proj's bias shifts all of a head's positional logits alike, which its softmax ignores: its
    gradient is zero, as in timm's GPSA."""
    layer = drawn_gpsa_layer(prefix=1)
    layer(torch.randn(2, 13, 24, dtype=torch.float64), (3, 4)).square().sum().backward()
    for param in (layer.phi.gating_param, layer.phi.pos_proj.weight):
        assert param.grad.abs().min() > 0
    torch.testing.assert_close(layer.phi.pos_proj.bias.grad, torch.zeros(3, dtype=torch.float64), rtol=0, atol=1e-12)


def test_gradcheck_in_float64():
    layer = drawn_gpsa_layer(dim=8, num_heads=2, prefix=1)
    assert gradcheck_layer(layer, torch.randn(2, 7, 8, dtype=torch.float64), (2, 3))


def test_a_training_step_of_a_vit_moves_the_gates():
    # depth 2: the class token, which the head reads, sees the first block's grid tokens in the second
    model = posattn.create_model('vit_tiny', phi='gpsa', depth=2, num_classes=5).train()
    phi = model.blocks[0].attn.phi
    assert isinstance(phi, GatedPositionalAttention) and phi.num_prefix_tokens == 1 and phi.num_heads == 3
    before = [p.detach().clone() for p in (phi.gating_param, phi.pos_proj.weight)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = F.cross_entropy(model(torch.randn(2, 3, 64, 48)), torch.tensor([1, 3]))
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)
    assert all(not torch.equal(p, b) for p, b in zip((phi.gating_param, phi.pos_proj.weight), before))


def test_swapped_into_a_timm_deit_it_mixes_and_trains():
    timm = pytest.importorskip('timm')
    model = timm.create_model('deit_tiny_patch16_224', pretrained=False, img_size=32, patch_size=8, depth=2,
                              num_classes=5)
    swapped = posattn.swap_attention(copy.deepcopy(model), phi='gpsa')
    phis = [m for m in swapped.modules() if isinstance(m, GatedPositionalAttention)]
    assert len(phis) == 2 and all(phi.num_prefix_tokens == 1 for phi in phis)
    out = swapped(torch.randn(2, 3, 32, 32))
    F.cross_entropy(out, torch.tensor([0, 4])).backward()
    assert torch.all(torch.isfinite(out)) and phis[0].gating_param.grad.abs().min() > 0
    # the class token, which the head reads, keeps its content attention: the last layer's grid is unread
    assert torch.all(phis[1].gating_param.grad == 0)


def test_bf16_autocast_keeps_the_positional_attention_in_the_weights_dtype():
    layer = Attention(16, 2, phi='gpsa', num_prefix_tokens=1).eval()
    x = torch.randn(2, 13, 16)
    with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16):
        out = layer(x, (3, 4))
        assert layer.phi.position_logits(3, 4).dtype == torch.float32
    torch.testing.assert_close(out.float(), layer(x, (3, 4)).detach(), rtol=0.05, atol=0.05)


def test_the_position_cache_serves_the_attention_until_pos_proj_changes():
    layer = Attention(16, 2, phi='gpsa').eval()
    with torch.no_grad(), posattn.cache_positions(layer) as cache:
        first = layer.phi.position_attention(3, 4)
        assert layer.phi.position_attention(3, 4) is first and len(cache) == 1
        layer.phi.pos_proj.bias.add_(1.0)  # a softmax ignores a bias shared by all keys: move one weight
        layer.phi.pos_proj.weight[0, 0] += 1.0
        again = layer.phi.position_attention(3, 4)
        assert again is not first and not torch.equal(again, first)
        assert layer.double().phi.position_attention(3, 4).dtype == torch.float64  # converted weights
    assert layer.phi.position_cache is None


# --- errors -----------------------------------------------------------------------------------

@pytest.mark.parametrize('option,value,message', [
    ('num_heads', 0, 'gpsa num_heads must be an int >= 1, got 0'),
    ('locality_strength', -1.0, 'gpsa locality_strength must be a finite number > 0, got -1.0'),
    ('locality_strength', float('nan'), 'gpsa locality_strength must be a finite number > 0, got nan'),
    ('local_init', 'yes', "gpsa local_init must be True or False, got 'yes'"),
    ('num_prefix_tokens', -1, r'gpsa num_prefix_tokens \(extra tokens before the grid\) must be an int >= 0'),
])
def test_bad_options_name_the_problem(option, value, message):
    with pytest.raises(ValueError, match=message):
        posattn.build_phi('gpsa', **{'num_heads': 2, option: value})


def test_a_grid_with_another_prefix_count_names_the_fix():
    phi = posattn.build_phi('gpsa', num_heads=2)
    with pytest.raises(ValueError, match=r'gpsa built with num_prefix_tokens=0 got a 2x3 grid with 1 extra token: '
                                         r'build it with num_prefix_tokens=1'):
        phi.mix_probabilities(torch.full((1, 2, 7, 7), 1 / 7), TokenGrid(2, 3, 1))
