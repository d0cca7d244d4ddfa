"""rope on rows of images in one call, against an oracle that never runs the layer: each image's
queries and keys rotated by posattn.reference.rope_rotate on its own grid, then plain softmax attention
in float64, in a loop over the images; outputs and the gradients of the input and of the mixed
frequencies, on padded and packed layouts with a key mask, for every option. Then what the per-token
form shares with the grid path: its tables to the bit, its dtypes, prefix tokens and padding untouched,
and the caching of axial tables per layout (mixed ones follow the frequencies)."""
import math

import pytest
import torch
from einops import rearrange

from posattn import Attention, ImageLayout, TokenGrid
from posattn.phi.rope import axial_rotation, layout_axial_rotation
from posattn.positions import token_positions
from posattn.reference import rope_rotate

from conftest import random_key_mask, randomised

# A grid of the reference grid (2, 3), others of no such size, a 1 x W and an H x 1, one grid twice.
GRIDS = [(2, 3), (1, 4), (4, 1), (3, 3), (2, 3)]
DIM, HEADS = 16, 2  # head_dim 8: two frequency bands per axis
CONFIGS = {
    'axial': dict(frequencies='axial'),
    'axial_every_option': dict(frequencies='axial', temperature=100.0, position_offset=1.0, reference_grid=(2, 3),
                               axis_order='xy', pairing='halves'),
    'mixed': dict(frequencies='mixed'),
    'mixed_every_option': dict(frequencies='mixed', temperature=100.0, position_offset=0.5, reference_grid=(2, 3),
                               axis_order='xy', pairing='halves'),
}


def rope_layer(options, prefix, dtype=torch.float64):
    """An attention layer with rope; mixed frequencies drawn large, so that every pair turns well."""
    layer = randomised(Attention(DIM, HEADS, phi='rope', phi_cfg=options, num_prefix_tokens=prefix)).to(dtype)
    if layer.phi.freqs is not None:
        with torch.no_grad():
            layer.phi.freqs.normal_(generator=torch.Generator().manual_seed(1))
    return layer


def rotation_options(phi, prefix):
    return dict(num_prefix_tokens=prefix, mixed_frequencies=phi.freqs, temperature=phi.temperature,
                position_offset=phi.position_offset, reference_grid=phi.reference_grid,
                axis_order=phi.axis_order, pairing=phi.pairing)


def second_channels(phi):
    """(d,) bool: the channels v of the pairs (u, v)."""
    channel = torch.arange(phi.head_dim)
    return channel % 2 == 1 if phi.pairing == 'interleaved' else channel >= phi.head_dim // 2


def pairs(x, phi):
    """The (u, v) channels of every pair of x (..., d): two (..., d / 2)."""
    second = second_channels(phi)
    return x[..., ~second], x[..., second]


def coordinates(phi, grid):
    """(a, b) of every token, zero at prefix tokens, as posattn.reference.rope_rotate reads them: (N,) each."""
    ref_height, ref_width = phi.reference_grid or (grid.height, grid.width)
    cells = [divmod(cell, grid.width) for cell in range(grid.height * grid.width)]
    y = [(row + phi.position_offset) * ref_height / grid.height for row, _ in cells]
    x = [(col + phi.position_offset) * ref_width / grid.width for _, col in cells]
    y, x = (torch.tensor([0.0] * grid.num_prefix_tokens + axis, dtype=torch.float64) for axis in (y, x))
    return (y, x) if phi.axis_order == 'yx' else (x, y)


def oracle(layer, tokens, grid, key_mask, upstream):
    """One image alone, tokens (N, C): proj(softmax(R q (R k)^T / sqrt(d), keys key_mask keeps) v) with R
    rope_rotate's rotation; its output, the gradients of sum(out * upstream) with respect to the tokens
    and (mixed) to the frequencies (f1, f2), which rope_rotate does not differentiate: the rotation by φ
    is linear, with transpose the rotation by -φ, and d(u', v')/dφ = (-v', u')."""
    phi, options = layer.phi, rotation_options(layer.phi, grid.num_prefix_tokens)
    tokens = tokens.detach().requires_grad_()
    q, k, v = rearrange(tokens @ layer.qkv.weight.t() + layer.qkv.bias, 'n (three h d) -> three 1 h n d',
                        three=3, h=HEADS)
    rotated_q, rotated_k = (rope_rotate(x, grid.height, grid.width, **options).requires_grad_() for x in (q, k))
    logits = rotated_q @ rotated_k.transpose(-2, -1) / math.sqrt(phi.head_dim)
    attn = logits.masked_fill(~key_mask, float('-inf')).softmax(-1)
    out = rearrange(attn @ v, '1 h n d -> n (h d)') @ layer.proj.weight.t() + layer.proj.bias
    loss = (out * upstream).sum()
    grad_q, grad_k = torch.autograd.grad(loss, [rotated_q, rotated_k], retain_graph=True)
    flip = torch.where(second_channels(phi), -1.0, 1.0).double()  # R(-φ) g = flip * R(φ) (flip * g)
    back_q, back_k = (flip * rope_rotate(flip * grad, grid.height, grid.width, **options) for grad in (grad_q, grad_k))
    surrogate = loss + (q * back_q).sum() + (k * back_k).sum()
    grad_tokens = torch.autograd.grad(surrogate, tokens)[0]
    if phi.freqs is None:
        return out.detach(), grad_tokens, None
    grad_angles = 0.0  # dL/dφ (heads, N, d / 2)
    for rotated, grad in ((rotated_q, grad_q), (rotated_k, grad_k)):
        (u, v), (grad_u, grad_v) = pairs(rotated.detach()[0], phi), pairs(grad[0], phi)
        grad_angles = grad_angles + grad_v * u - grad_u * v
    grad_freqs = torch.stack([(axis[:, None] * grad_angles).sum(1) for axis in coordinates(phi, grid)])
    return out.detach(), grad_tokens, grad_freqs


@pytest.mark.parametrize('form', ['padded', 'packed'])
@pytest.mark.parametrize('prefix', [0, 1])
@pytest.mark.parametrize('config', CONFIGS)
def test_rows_of_images_match_each_image_rotated_by_the_reference(config, prefix, form):
    layer = rope_layer(CONFIGS[config], prefix)
    assert layer.phi.runs_on_token_positions
    layout = getattr(ImageLayout, form)(GRIDS, prefix)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(layout.num_rows, layout.length, DIM, generator=generator, dtype=torch.float64)
    upstream = torch.randn(x.shape, generator=generator, dtype=torch.float64)
    key_mask = random_key_mask(layout, generator)
    x.requires_grad_()
    inputs = [x, *layer.phi.parameters()]
    out = layer(x, layout, key_mask)
    got = torch.autograd.grad((out * upstream).sum(), inputs)
    expected_freqs = 0.0
    for tokens, grid, mask, image_upstream, image_out, image_grad in zip(
            layout.images(x), layout.grids, layout.images(key_mask), layout.images(upstream), layout.images(out),
            layout.images(got[0])):
        expected_out, expected_grad, grad_freqs = oracle(layer, tokens, grid, mask, image_upstream)
        torch.testing.assert_close(image_out, expected_out, rtol=0, atol=1e-10)
        torch.testing.assert_close(image_grad, expected_grad, rtol=0, atol=1e-10)
        expected_freqs = expected_freqs + (0.0 if grad_freqs is None else grad_freqs)
    if layer.phi.freqs is not None:
        assert got[1].abs().max() > 1e-3, 'the frequencies should matter'
        torch.testing.assert_close(got[1], expected_freqs, rtol=0, atol=1e-10)


def rows_and_alone(phi, layout, dtype, seed=0):
    """The per-token form on random queries and keys (I, heads, M, d), and each image's grid form alone."""
    positions = token_positions(layout, layout.num_rows, torch.device('cpu'))
    generator = torch.Generator().manual_seed(seed)
    shape = (positions.num_images, HEADS, positions.length, DIM // HEADS)
    q, k = (torch.randn(shape, generator=generator).to(dtype) for _ in range(2))
    rows = phi.queries_keys_at(q, k, positions)
    alone = [phi.queries_keys(q[image:image + 1, :, :grid.num_tokens], k[image:image + 1, :, :grid.num_tokens], grid)
             for image, grid in enumerate(layout.grids)]
    return positions, (q, k), rows, alone


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('config', CONFIGS)
def test_each_image_is_rotated_as_alone_in_its_dtype_and_off_grid_tokens_are_untouched(config, dtype):
    """Each image's rows are the grid form's on its own grid, in the queries' dtype (to rounding: the
    product's vectorised and scalar paths may differ in the last bit); prefix tokens and padding as
    they were, exactly."""
    phi = rope_layer(CONFIGS[config], 1, torch.float32).phi
    layout = ImageLayout.padded(GRIDS, 1)
    positions, given, rows, alone = rows_and_alone(phi, layout, dtype)
    for got, before in zip(rows, given):
        assert got.dtype == dtype and got.shape == before.shape
        off_grid = ~positions.is_grid[:, None, :, None].expand_as(before)
        assert torch.equal(got[off_grid], before[off_grid])
    for image, (grid, image_alone) in enumerate(zip(layout.grids, alone)):
        for got, expected in zip(rows, image_alone):
            torch.testing.assert_close(got[image:image + 1, :, :grid.num_tokens], expected)


@pytest.mark.parametrize('dtype,precision', [(torch.bfloat16, torch.float32), (torch.float64, torch.float64)])
def test_axial_tables_are_the_grids_own_in_float32_at_least(dtype, precision):
    """Each token's cos and sin are its grid's cached table's, its row and column's entry, in float32 at
    least; off the grid cos 1 and sin 0. The tables are constants of the layout: made once."""
    phi = rope_layer(CONFIGS['axial_every_option'], 1, dtype).phi
    layout = ImageLayout.packed(GRIDS, 1)
    args = (phi.head_dim, phi.temperature, phi.position_offset, phi.reference_grid, phi.axis_order, precision,
            torch.device('cpu'))
    table = layout_axial_rotation(layout, layout.num_rows, *args)
    assert table.dtype == precision and table is layout_axial_rotation(layout, layout.num_rows, *args)
    positions = token_positions(layout, layout.num_rows, torch.device('cpu'))
    off_grid = ~positions.is_grid
    assert torch.equal(table[0][off_grid], torch.ones_like(table[0][off_grid]))
    assert not table[1][off_grid].any()
    for image, grid in enumerate(layout.grids):
        expected = axial_rotation(grid.height, grid.width, *args)  # (2, H W, d / 2)
        assert torch.equal(table[:, image, grid.num_prefix_tokens:grid.num_tokens], expected)


def test_mixed_rotations_follow_the_frequencies():
    """Mixed angles depend on the learned frequencies: a write to them, even through ``.data``, shows
    in the next call."""
    phi = rope_layer(CONFIGS['mixed'], 0).phi
    layout = ImageLayout.padded(GRIDS, 0)
    before = rows_and_alone(phi, layout, torch.float64)[2]
    phi.freqs.data.mul_(2.0)
    positions, given, after, alone = rows_and_alone(phi, layout, torch.float64)
    assert not torch.equal(after[0], before[0])
    for image, grid in enumerate(layout.grids):
        torch.testing.assert_close(after[0][image:image + 1, :, :grid.num_tokens], alone[image][0], rtol=0, atol=1e-12)


def test_queries_of_another_shape_name_it():
    phi = rope_layer(CONFIGS['axial'], 0).phi
    positions = token_positions(ImageLayout.padded(GRIDS, 0), len(GRIDS), torch.device('cpu'))
    q = torch.randn(len(GRIDS), 3, positions.length, DIM // HEADS)
    with pytest.raises(ValueError, match=r'rope built for 2 heads of 8 channels got queries of shape \(5, 3, 9, 8\)'):
        phi.queries_keys_at(q, q, positions)
