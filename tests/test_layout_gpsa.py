"""gpsa on rows of images in one call, against an oracle that never runs the layer: each image's
ConViT attention in float64 from posattn.reference's pair-by-pair positional attention
(gpsa_position_attention) and gated mixture (gpsa_attention), in a plain loop over the images;
outputs and gradients on padded and packed layouts, with and without a key mask."""
import math

import pytest
import torch
from einops import rearrange

from posattn import Attention, ImageLayout
from posattn.positions import token_positions
from posattn.reference import gpsa_attention, gpsa_position_attention

from conftest import assert_rows_match_each_image, random_key_mask, randomised

# A 3 x 3 grid (gpsa has no table size: no grid is special), a 1 x W and an H x 1, one grid twice.
GRIDS = [(2, 3), (1, 4), (4, 1), (3, 3), (2, 3)]
DIM, HEADS = 8, 4


def gpsa_layer(prefix):
    """A float64 gpsa layer whose positional attention is far from uniform and whose gates differ."""
    layer = randomised(Attention(DIM, HEADS, phi='gpsa', num_prefix_tokens=prefix).double())
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        layer.phi.pos_proj.weight.copy_(torch.randn(HEADS, 3, generator=generator, dtype=torch.float64) * 0.7)
        layer.phi.pos_proj.bias.copy_(torch.randn(HEADS, generator=generator, dtype=torch.float64))
        layer.phi.gating_param.copy_(torch.randn(HEADS, generator=generator, dtype=torch.float64))
    return layer


def oracle(layer, tokens, grid, key_mask):
    """One image alone, tokens (N, C): proj(A v) with A_h = (1 - σ(λ_h)) C_h + σ(λ_h) P_h for a grid
    query, C_h for a prefix query. C: the content softmax over the keys ``key_mask`` keeps (a zero row
    where it keeps none); P: gpsa_position_attention over the grid, restricted to the kept grid keys
    and renormalised (a grid query with no kept grid key keeps C). Without a key mask, the
    reference's gpsa_attention itself."""
    phi, prefix = layer.phi, grid.num_prefix_tokens
    if key_mask is None:
        return gpsa_attention(tokens[None], layer.qkv.weight, layer.qkv.bias, layer.proj.weight, layer.proj.bias,
                              HEADS, phi.pos_proj.weight, phi.pos_proj.bias, phi.gating_param, grid.height,
                              grid.width, prefix)[0]
    q, k, v = rearrange(tokens @ layer.qkv.weight.t() + layer.qkv.bias, 'n (three h d) -> three h n d',
                        three=3, h=HEADS)
    logits = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~key_mask, float('-inf'))
    content = logits.softmax(-1) if key_mask.any() else torch.zeros_like(logits)  # (heads, N, N)
    grid_keys = key_mask[prefix:]
    attn = content.clone()
    if grid_keys.any():
        position = gpsa_position_attention(phi.pos_proj.weight, phi.pos_proj.bias, grid.height, grid.width)
        position = position * grid_keys
        position = position / position.sum(-1, keepdim=True)  # (heads, HW, HW)
        gate = torch.sigmoid(phi.gating_param)[:, None, None]
        attn[:, prefix:, prefix:] = (1 - gate) * content[:, prefix:, prefix:] + gate * position
        attn[:, prefix:, :prefix] = (1 - gate) * content[:, prefix:, :prefix]
    return rearrange(attn @ v, 'h n d -> n (h d)') @ layer.proj.weight.t() + layer.proj.bias


def key_mask_of(layout, prefix, generator):
    """A random key mask (B, L) that keeps each image's first token; the second image keeps its prefix
    token alone (its grid queries no grid key), or, without prefix tokens, no key at all."""
    mask = random_key_mask(layout, generator)
    row, start = layout.rows[1], layout.starts[1]
    mask[row, start:start + layout.grids[1].num_tokens] = False
    mask[row, start:start + prefix] = True
    return mask


@pytest.mark.parametrize('masked', [False, True], ids=['no_mask', 'key_mask'])
@pytest.mark.parametrize('form', ['padded', 'packed'])
@pytest.mark.parametrize('prefix', [0, 1])
def test_rows_of_images_match_each_image_by_the_pair_formulas(prefix, form, masked):
    layer = gpsa_layer(prefix)
    assert layer.phi.runs_on_token_positions
    layout = getattr(ImageLayout, form)(GRIDS, prefix)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(layout.num_rows, layout.length, DIM, generator=generator, dtype=torch.float64)
    upstream = torch.randn(x.shape, generator=generator, dtype=torch.float64)
    key_mask = key_mask_of(layout, prefix, generator) if masked else None
    inputs = [x.requires_grad_(), *layer.phi.parameters(), layer.qkv.weight]
    assert_rows_match_each_image(layer, layout, x, upstream, key_mask, inputs, oracle)

def test_mixture_on_rows_keeps_the_probabilities_dtype_and_masked_keys_at_zero():
    """In bfloat16 probabilities with float32 weights, as the grid path: the result in attn's dtype,
    exactly 0 at every key the mask removes, finite everywhere."""
    layer = gpsa_layer(1).float()
    layout = ImageLayout.padded(GRIDS, 1)
    positions = token_positions(layout, layout.num_rows, torch.device('cpu'))
    generator = torch.Generator().manual_seed(7)
    key_mask = positions.valid & (torch.rand(positions.valid.shape, generator=generator) > 0.3)
    key_mask[:, 0] = True  # every image keeps a key, so that the content softmax is finite
    logits = torch.randn(positions.num_images, HEADS, positions.length, positions.length, generator=generator)
    attn = logits.masked_fill(~key_mask[:, None, None, :], float('-inf')).softmax(-1).bfloat16()
    mixed = layer.phi.mix_probabilities_at(attn, positions, key_mask)
    assert mixed.dtype == torch.bfloat16 and mixed.shape == attn.shape
    assert torch.isfinite(mixed).all()
    assert (mixed.masked_select(~key_mask[:, None, None, :]) == 0).all()
