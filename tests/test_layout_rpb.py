"""rpb and decomposed_rpb on rows of images in one call, against an oracle that never runs the layer:
each image's softmax attention in float64 with the bias of posattn.reference's pair-by-pair formulas
(relative_position_bias, decomposed_relative_position_bias), in a plain loop over the images; outputs
and gradients on padded and packed layouts with a key mask, and every distinct grid's resampled table."""
import math

import pytest
import torch
from einops import rearrange

from posattn import Attention, ImageLayout, TokenGrid
from posattn.positions import token_positions
from posattn.reference import decomposed_relative_position_bias, relative_position_bias

from conftest import assert_rows_match_each_image, random_key_mask, randomised

# A grid of rpb's table size (2, 3), others of no table's size, a 1 x W and an H x 1, one grid twice.
GRIDS = [(2, 3), (1, 4), (4, 1), (3, 3), (2, 3)]
DIM, HEADS = 8, 2
CASES = [('rpb', dict(table_size=(2, 3)), 0), ('rpb', dict(table_size=(2, 3)), 1),
         ('rpb', dict(table_size=(3, 2), prefix_entries=False), 1),
         ('decomposed_rpb', dict(table_size=(3, 2)), 0), ('decomposed_rpb', dict(table_size=(3, 2)), 1)]


def reference_bias(phi, q, height, width, prefix):
    """The Φp's bias on one image, (heads, N, N), from posattn.reference."""
    if phi.phi_name == 'rpb':
        return relative_position_bias(phi.relative_position_bias_table, phi.table_size, height, width, prefix)
    return decomposed_relative_position_bias(q, phi.rel_pos_h, phi.rel_pos_w, height, width, prefix)


def oracle(layer, tokens, grid, key_mask):
    """One image alone: proj(softmax(q k^T / sqrt(d) + b, keys key_mask keeps) v), tokens (N, C)."""
    q, k, v = rearrange(tokens @ layer.qkv.weight.t() + layer.qkv.bias, 'n (three h d) -> three h n d',
                        three=3, h=HEADS)
    logits = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    logits = logits + reference_bias(layer.phi, q, grid.height, grid.width, grid.num_prefix_tokens)
    attn = logits.masked_fill(~key_mask, float('-inf')).softmax(-1)
    return rearrange(attn @ v, 'h n d -> n (h d)') @ layer.proj.weight.t() + layer.proj.bias


@pytest.mark.parametrize('form', ['padded', 'packed'])
@pytest.mark.parametrize('phi,options,prefix', CASES, ids=str)
def test_rows_of_images_match_each_image_by_the_pair_formulas(phi, options, prefix, form):
    layer = randomised(Attention(DIM, HEADS, phi=phi, phi_cfg=options, num_prefix_tokens=prefix).double())
    assert layer.phi.runs_on_token_positions
    layout = getattr(ImageLayout, form)(GRIDS, prefix)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(layout.num_rows, layout.length, DIM, generator=generator, dtype=torch.float64)
    upstream = torch.randn(x.shape, generator=generator, dtype=torch.float64)
    key_mask = random_key_mask(layout, generator)
    inputs = [x.requires_grad_(), *layer.phi.parameters()]
    assert_rows_match_each_image(layer, layout, x, upstream, key_mask, inputs, oracle)


@pytest.mark.parametrize('prefix', [0, 1])
def test_every_distinct_grid_reads_its_own_resampled_table(prefix):
    """Each image's part of the layout's bias is its grid's offset table (bicubic by F.interpolate) read
    pair by pair, to rounding; on the table's own grid the resampling is the identity, exactly."""
    layer = randomised(Attention(DIM, HEADS, phi='rpb', phi_cfg=dict(table_size=(2, 3)),
                                 num_prefix_tokens=prefix).double())
    phi = layer.phi
    layout = ImageLayout.packed(GRIDS, prefix)
    positions = token_positions(layout, layout.num_rows, torch.device('cpu'))
    q = torch.zeros(positions.num_images, HEADS, positions.length, DIM // HEADS, dtype=torch.float64)
    bias = phi.logits_bias_at(q, q, positions)
    assert bias.shape == (positions.num_images, HEADS, positions.length, positions.length)
    for image, grid in enumerate(layout.grids):
        tokens = grid.num_tokens
        alone = phi.position_bias(grid)[0].detach()  # the grid path: F.interpolate of the table
        torch.testing.assert_close(bias[image, :, :tokens, :tokens], alone, rtol=0, atol=1e-12)
        if (grid.height, grid.width) == phi.table_size:
            table = relative_position_bias(phi.relative_position_bias_table, phi.table_size, grid.height,
                                           grid.width, prefix)
            assert torch.equal(bias[image, :, :tokens, :tokens], table)


@pytest.mark.parametrize('phi,options', [('rpb', dict(table_size=(3, 2))), ('decomposed_rpb', None)])
def test_the_bias_comes_in_the_queries_dtype(phi, options):
    layer = Attention(DIM, HEADS, phi=phi, phi_cfg=options, num_prefix_tokens=1)
    positions = token_positions(ImageLayout.padded(GRIDS, 1), len(GRIDS), torch.device('cpu'))
    q = torch.randn(positions.num_images, HEADS, positions.length, DIM // HEADS).bfloat16()
    bias = layer.phi.logits_bias_at(q, q, positions)
    assert bias.dtype == torch.bfloat16 and bias.shape == (len(GRIDS), HEADS, positions.length, positions.length)
    assert torch.isfinite(bias).all()


def test_images_of_one_grid_share_its_bias():
    """rpb's bias depends on the grid alone: two images of one grid read the same values."""
    layer = randomised(Attention(DIM, HEADS, phi='rpb', phi_cfg=dict(table_size=(3, 3)), num_prefix_tokens=1))
    positions = token_positions(ImageLayout.padded(GRIDS, 1), len(GRIDS), torch.device('cpu'))
    q = torch.zeros(positions.num_images, HEADS, positions.length, DIM // HEADS)
    bias = layer.phi.logits_bias_at(q, q, positions)
    tokens = TokenGrid(2, 3, 1).num_tokens
    assert torch.equal(bias[0, :, :tokens, :tokens], bias[4, :, :tokens, :tokens])
