"""rope: 2D rotary position embedding (axial, EVA-02; mixed, RoPE-ViT) against the float64 rotation
pair by pair, its properties (norms kept, logits depend on offsets only), timm's tables and
initialisation, gradients, training, the caches, errors (the meta device: tests/test_gpu_readiness.py)."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

import posattn
from posattn import Attention, TokenGrid
from posattn.phi.rope import RotaryPositionEmbedding, axial_rotation, mixed_frequencies_init
from posattn.reference import rope_rotate

from conftest import gradcheck_layer

GRIDS = [(3, 5), (4, 7), (1, 1), (1, 6), (5, 1)]
# The defaults (EVA-02's axial layout without a reference grid) and every other option at once.
OPTIONS = [dict(), dict(temperature=100.0, position_offset=1.0, reference_grid=(5, 7), axis_order='xy',
                        pairing='halves')]


def rope(frequencies='axial', num_heads=2, head_dim=8, **options):
    """A float64 rope Φp; mixed frequencies drawn large, so that every pair turns well."""
    phi = posattn.build_phi('rope', head_dim=head_dim, num_heads=num_heads, frequencies=frequencies,
                            **options).double()
    if phi.freqs is not None:
        with torch.no_grad():
            phi.freqs.normal_()
    return phi


def queries_keys(phi, height, width, prefix, batch=2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, phi.num_heads, prefix + height * width, phi.head_dim)
    return (torch.randn(shape, generator=generator, dtype=torch.float64),
            torch.randn(shape, generator=generator, dtype=torch.float64))


def reference_options(phi):
    return dict(mixed_frequencies=phi.learned_frequencies, temperature=phi.temperature,
                position_offset=phi.position_offset, reference_grid=phi.reference_grid,
                axis_order=phi.axis_order, pairing=phi.pairing)


# --- the formula ------------------------------------------------------------------------------

@pytest.mark.parametrize('height,width', GRIDS)
@pytest.mark.parametrize('prefix', [0, 2])
@pytest.mark.parametrize('frequencies', ['axial', 'mixed'])
@pytest.mark.parametrize('options', OPTIONS, ids=['defaults', 'every_option'])
def test_rotation_matches_the_float64_formula(height, width, prefix, frequencies, options):
    """Token by token and pair by pair (posattn.reference.rope_rotate); prefix tokens untouched."""
    phi = rope(frequencies, **options)
    q, k = queries_keys(phi, height, width, prefix)
    grid = TokenGrid(height, width, prefix)
    got_q, got_k = phi.queries_keys(q, k, grid)
    for got, given in ((got_q, q), (got_k, k)):
        assert got.shape == given.shape and got.dtype == torch.float64
        torch.testing.assert_close(got, rope_rotate(given, height, width, prefix, **reference_options(phi)),
                                   rtol=0, atol=1e-12)
        assert torch.equal(got[:, :, :prefix], given[:, :, :prefix])


@pytest.mark.parametrize('frequencies', ['axial', 'mixed'])
def test_the_real_form_a_compiler_gets_is_the_same_rotation(frequencies, monkeypatch):
    """Inside torch.compile / torch.export the interleaved pairs turn in real arithmetic, not as
    complex numbers: the same values."""
    phi = rope(frequencies)
    q, k = queries_keys(phi, 3, 5, 1)
    expected = rope_rotate(q, 3, 5, 1, **reference_options(phi))
    monkeypatch.setattr(torch.compiler, 'is_compiling', lambda: True)
    torch.testing.assert_close(phi.queries_keys(q, k, TokenGrid(3, 5, 1))[0], expected, rtol=0, atol=1e-12)


def test_queries_whose_pairs_are_not_a_complex_view_are_rotated_alike():
    """Channel pairs at an odd storage offset (a slice of a wider tensor) are copied first."""
    phi = rope()
    wide = torch.randn(2, 2, 13, 9, dtype=torch.float64)
    q = wide[..., 1:]
    assert q.storage_offset() % 2 == 1
    rotated, _ = phi.queries_keys(q, q, TokenGrid(3, 4, 1))
    torch.testing.assert_close(rotated, rope_rotate(q, 3, 4, 1, **reference_options(phi)), rtol=0, atol=1e-12)


@pytest.mark.parametrize('frequencies', ['axial', 'mixed'])
def test_layer_output_is_softmax_attention_of_the_rotated_queries_and_keys(frequencies):
    torch.manual_seed(0)
    layer = Attention(24, 3, phi='rope', phi_cfg=dict(frequencies=frequencies), num_prefix_tokens=1).double()
    x = torch.randn(2, 1 + 4 * 3, 24, dtype=torch.float64)
    with torch.no_grad():
        q, k, v = F.linear(x, layer.qkv.weight, layer.qkv.bias).unflatten(-1, (3, 3, 8)).permute(2, 0, 3, 1, 4)
        options = reference_options(layer.phi)
        q, k = rope_rotate(q, 4, 3, 1, **options), rope_rotate(k, 4, 3, 1, **options)
        attn = (q @ k.transpose(-1, -2) / math.sqrt(8)).softmax(-1)
        expected = F.linear((attn @ v).transpose(1, 2).flatten(2), layer.proj.weight, layer.proj.bias)
        torch.testing.assert_close(layer(x, (4, 3)), expected, rtol=1e-10, atol=1e-12)


def test_axial_halves_encode_one_axis_each_in_every_head():
    """EVA-02's layout: with rows first, the first half of the pairs turns by the row alone (a token's
    column changes nothing there), the second by the column; every head alike."""
    phi = rope(num_heads=3)
    cos, sin = phi.rotation(TokenGrid(3, 4), torch.float64)  # (HW, pairs): pairs 0, 1 then 2, 3
    angles = torch.atan2(sin, cos).reshape(3, 4, 4)  # (H, W, pairs)
    rows, cols = torch.arange(3.0, dtype=torch.float64), torch.arange(4.0, dtype=torch.float64)
    bands = torch.tensor([1.0, 0.01], dtype=torch.float64)  # 10000^(-f / 2)
    torch.testing.assert_close(angles[..., :2], (rows[:, None, None] * bands).expand(3, 4, 2), rtol=0, atol=1e-15)
    torch.testing.assert_close(angles[..., 2:], (cols[None, :, None] * bands).expand(3, 4, 2), rtol=0, atol=1e-15)


# --- properties -------------------------------------------------------------------------------

@pytest.mark.parametrize('frequencies', ['axial', 'mixed'])
@pytest.mark.parametrize('options', OPTIONS, ids=['defaults', 'every_option'])
def test_rotations_keep_every_tokens_norm(frequencies, options):
    phi = rope(frequencies, **options)
    q, k = queries_keys(phi, 4, 5, 1)
    rotated, _ = phi.queries_keys(q, k, TokenGrid(4, 5, 1))
    torch.testing.assert_close(rotated.norm(dim=-1), q.norm(dim=-1), rtol=1e-14, atol=0)


@pytest.mark.parametrize('frequencies', ['axial', 'mixed'])
@pytest.mark.parametrize('options', OPTIONS, ids=['defaults', 'every_option'])
@pytest.mark.parametrize('shift', [(1, 0), (0, 2), (2, 1)])
def test_logits_depend_on_the_offset_between_positions_only(frequencies, options, shift):
    """One query vector at every position and one key vector at every position: the logit of
    positions (p_i, p_j) equals that of (p_i + t, p_j + t) for every translation t."""
    phi = rope(frequencies, **options)
    height, width, (dy, dx) = 4, 5, shift
    q, k = queries_keys(phi, 1, 1, 0, batch=1)
    tokens = height * width
    rotated_q, rotated_k = phi.queries_keys(q.expand(-1, -1, tokens, -1), k.expand(-1, -1, tokens, -1),
                                            TokenGrid(height, width))
    logits = (rotated_q @ rotated_k.transpose(-1, -2))[0].reshape(phi.num_heads, height, width, height, width)
    moved = logits[:, dy:, dx:, dy:, dx:]
    kept = logits[:, :height - dy, :width - dx, :height - dy, :width - dx]
    torch.testing.assert_close(moved, kept, rtol=0, atol=1e-12)
    assert (logits - logits[:, :1, :1, :1, :1]).abs().max() > 1e-2  # the positions do change the logits


def test_rotation_is_batch_free_and_keeps_the_dtype():
    phi = posattn.build_phi('rope', head_dim=8, num_heads=2, frequencies='mixed')
    q = torch.randn(3, 2, 13, 8, dtype=torch.bfloat16)
    rotated, _ = phi.queries_keys(q, q, TokenGrid(3, 4, 1))
    single, _ = phi.queries_keys(q[1:2], q[1:2], TokenGrid(3, 4, 1))
    assert rotated.dtype == torch.bfloat16 and torch.equal(rotated[1:2], single)


def test_bf16_autocast_runs_the_layer():
    layer = Attention(32, 2, phi='rope', phi_cfg=dict(frequencies='mixed'), num_prefix_tokens=1)
    x = torch.randn(2, 1 + 3 * 4, 32)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = layer(x, (3, 4))
    out.float().square().mean().backward()
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert layer.phi.freqs.grad is not None and torch.isfinite(layer.phi.freqs.grad).all()


# --- timm's tables and initialisation --------------------------------------------------------

@pytest.mark.parametrize('options', OPTIONS, ids=['defaults', 'every_option'])
def test_axial_tables_are_timms_rotary_embedding_cat(options):
    """The cos / sin of timm's RotaryEmbeddingCat as EVA builds it (in_pixels=False), bit for bit: (HW, d)
    in timm, each pair's value on both of its channels."""
    pytest.importorskip('timm')
    from timm.layers import RotaryEmbeddingCat
    phi = posattn.build_phi('rope', head_dim=16, num_heads=2, **options)
    theirs = RotaryEmbeddingCat(16, temperature=phi.temperature, in_pixels=False, ref_feat_shape=phi.reference_grid,
                                grid_offset=phi.position_offset, grid_indexing='ij' if phi.axis_order == 'yx' else 'xy',
                                rotate_half=phi.pairing == 'halves')
    for height, width in [(3, 5), (6, 2)]:
        sin, cos = theirs.get_embed((height, width)).chunk(2, -1)
        first = (slice(None), slice(0, None, 2)) if phi.pairing == 'interleaved' else (slice(None), slice(0, 8))
        assert torch.equal(phi.rotation(TokenGrid(height, width)), torch.stack([cos[first], sin[first]]))


def test_mixed_tables_and_initialisation_are_timms():
    """RoPE-ViT's initialisation (timm's init_random_2d_freqs, the same draws) and timm's
    RotaryEmbeddingMixed tables for a layer of its frequencies."""
    pytest.importorskip('timm')
    from timm.layers import RotaryEmbeddingMixed
    from timm.layers.pos_embed_sincos import init_random_2d_freqs
    torch.manual_seed(5)
    ours = mixed_frequencies_init(16, 3, 10.0)
    torch.manual_seed(5)
    torch.testing.assert_close(ours, init_random_2d_freqs(16, 1, 3, temperature=10.0)[:, 0], rtol=0, atol=0)
    theirs = RotaryEmbeddingMixed(48, depth=2, num_heads=3)
    phi = posattn.build_phi('rope', head_dim=16, num_heads=3, frequencies='mixed', axis_order='xy')
    with torch.no_grad():
        phi.freqs.copy_(theirs.freqs[:, 1])
    sin, cos = theirs.get_embed((3, 5))[1].chunk(2, -1)  # (heads, HW, d) each, interleaved
    assert torch.equal(phi.rotation(TokenGrid(3, 5)), torch.stack([cos[..., ::2], sin[..., ::2]]))


def test_initial_mixed_frequencies_are_rope_vits():
    """Per head: pair f and pair F + f have the magnitude 10^(-f / F), at right angles; one random
    direction per head."""
    freqs = posattn.build_phi('rope', head_dim=16, num_heads=4, frequencies='mixed').freqs.detach().double()
    first, second = freqs[..., :4], freqs[..., 4:]  # (2, heads, F)
    magnitudes = 10.0 ** (-torch.arange(4, dtype=torch.float64) / 4)
    torch.testing.assert_close(first.norm(dim=0), magnitudes.expand(4, 4), rtol=1e-6, atol=0)
    torch.testing.assert_close(second.norm(dim=0), magnitudes.expand(4, 4), rtol=1e-6, atol=0)
    torch.testing.assert_close((first * second).sum(0), torch.zeros(4, 4, dtype=torch.float64), rtol=0, atol=1e-6)
    directions = torch.atan2(first[1], first[0])  # (heads, F): one angle per head
    torch.testing.assert_close(directions, directions[:, :1].expand(4, 4), rtol=0, atol=1e-6)
    assert directions[:, 0].unique().numel() == 4


# --- gradients and training -------------------------------------------------------------------

def test_gradients_reach_every_mixed_frequency():
    layer = Attention(16, 2, phi='rope', phi_cfg=dict(frequencies='mixed'), num_prefix_tokens=1)
    layer(torch.randn(2, 1 + 3 * 4, 16), (3, 4)).square().sum().backward()
    assert layer.phi.freqs.grad.shape == (2, 2, 4) and torch.all(layer.phi.freqs.grad.abs() > 0)


def test_gradcheck_in_float64_with_mixed_frequencies():
    layer = Attention(8, 2, phi='rope', phi_cfg=dict(frequencies='mixed', reference_grid=(2, 2)),
                      num_prefix_tokens=1).double()
    assert gradcheck_layer(layer, torch.randn(1, 1 + 3 * 2, 8, dtype=torch.float64), (3, 2))


def test_a_training_step_of_a_vit_learns_the_mixed_frequencies():
    torch.manual_seed(0)
    model = posattn.create_model('vit_tiny', phi='rope', phi_cfg=dict(frequencies='mixed'), depth=1,
                                 num_classes=5).train()
    freqs = model.blocks[0].attn.phi.freqs
    assert freqs.shape == (2, 3, 32)
    before = freqs.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    x, labels = torch.randn(4, 3, 64, 48), torch.tensor([1, 3, 0, 2])
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(math.isfinite(value) for value in losses) and losses[-1] < losses[0]
    assert (freqs.detach() - before).abs().sum() > 0


@pytest.mark.parametrize('frequencies', ['axial', 'mixed'])
def test_swapped_into_a_timm_deit_it_trains(frequencies):
    timm = pytest.importorskip('timm')
    model = timm.create_model('deit_tiny_patch16_224', img_size=(32, 48), patch_size=8, embed_dim=32, depth=2,
                              num_heads=2, num_classes=5)
    swapped = posattn.swap_attention(model, phi='rope', frequencies=frequencies).train()
    phis = [block.attn.phi for block in swapped.blocks]
    assert all(isinstance(phi, RotaryPositionEmbedding) and phi.head_dim == 16 for phi in phis)
    out = swapped(torch.randn(2, 3, 32, 48))
    out.square().mean().backward()
    assert out.shape == (2, 5) and torch.isfinite(out).all()
    assert swapped.blocks[0].attn.qkv.weight.grad.abs().sum() > 0
    if frequencies == 'mixed':
        assert all(phi.freqs.grad.abs().sum() > 0 for phi in phis)


# --- caches, copies --------------------------------------------------------------------------

def test_axial_tables_are_grid_constants():
    phi = posattn.build_phi('rope', head_dim=8, num_heads=2)
    first = phi.rotation(TokenGrid(3, 4, 1))
    again = posattn.build_phi('rope', head_dim=8, num_heads=2).rotation(TokenGrid(3, 4, 2))
    assert again is first and axial_rotation.cache_nbytes() >= first.numel() * 4  # the prefix plays no part
    assert not torch.equal(phi.rotation(TokenGrid(4, 3)), first)


def test_the_position_cache_serves_mixed_tables_until_the_frequencies_change():
    layer = Attention(16, 2, phi='rope', phi_cfg=dict(frequencies='mixed'), num_prefix_tokens=1).eval()
    grid = TokenGrid(3, 4, 1)
    with torch.no_grad(), posattn.cache_positions(layer) as cache:
        first = layer.phi.rotation(grid)
        assert layer.phi.rotation(grid) is first and len(cache) == 1
        layer.phi.freqs.add_(0.5)
        updated = layer.phi.rotation(grid)
        assert updated is not first and not torch.equal(updated, first)
        assert torch.equal(updated, layer.phi._mixed_rotation(grid, torch.float32, torch.device('cpu')))
    layer.train()
    assert layer.phi.rotation(grid) is not layer.phi.rotation(grid)  # outside the block: computed every call


# --- bad input --------------------------------------------------------------------------------

def test_a_head_dim_not_divisible_by_4_names_the_fix():
    with pytest.raises(ValueError, match='rope needs head_dim, the channels per head, to be a multiple of 4 .*got 6: '
                                         'pick num_heads'):
        Attention(12, 2, phi='rope')


@pytest.mark.parametrize('option,value,message', [
    ('num_heads', 0, 'rope num_heads must be an int >= 1, got 0'),
    ('frequencies', 'learned', "rope frequencies must be 'axial' .* or 'mixed' .*got 'learned'"),
    ('temperature', 0, 'rope temperature must be a number > 0, got 0'),
    ('position_offset', '1', "rope position_offset must be a number, got '1'"),
    ('reference_grid', (16, 0), r'rope reference_grid must be a \(height, width\) pair of ints >= 1, .* or None'),
    ('axis_order', 'ij', "rope axis_order must be 'yx' .* or 'xy' .*got 'ij'"),
    ('pairing', 'half', "rope pairing must be 'interleaved' .* or 'halves' .*got 'half'"),
])
def test_bad_options_name_the_problem(option, value, message):
    with pytest.raises(ValueError, match=message):
        posattn.build_phi('rope', **dict(dict(head_dim=8, num_heads=2), **{option: value}))


def test_queries_of_another_shape_name_it():
    phi = posattn.build_phi('rope', head_dim=8, num_heads=2)
    q = torch.zeros(1, 3, 13, 8)
    with pytest.raises(ValueError, match=r'rope built for 2 heads of 8 channels got queries of shape \(1, 3, 13, 8\)'):
        phi.queries_keys(q, q, TokenGrid(3, 4, 1))
