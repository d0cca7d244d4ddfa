"""Rows of images in one call against an oracle that never runs the layer: each image's attention
computed in float64 from posattn.reference's pair-by-pair formulas, in a plain loop over the images,
for every Φp whose terms are per token or per pair; outputs, and the gradients of the Φp's parameters
where the formula is differentiable, on padded and packed layouts of grids other than any table's,
with a class token."""
import pytest
import torch
from einops import rearrange

from posattn import Attention, ImageLayout
from posattn.phi.alibi import alibi_slopes
from posattn.reference import (alibi_bias, decomposed_attention, gpsa_attention, irpe_attention, irpe_bucket_ids,
                               relative_position_bias, rope_rotate, softmax_attention)

from conftest import randomised

GRIDS = [(2, 3), (3, 2), (1, 4), (4, 1), (3, 3)]
DIM, HEADS, PREFIX = 8, 2, 1


def weights(layer):
    return layer.qkv.weight, layer.qkv.bias, layer.proj.weight, layer.proj.bias, HEADS


def rope_reference(x, layer, height, width):
    phi = layer.phi
    q, k, v = rearrange(x @ layer.qkv.weight.t() + layer.qkv.bias, 'b n (three h d) -> three b h n d',
                        three=3, h=HEADS)
    options = dict(num_prefix_tokens=PREFIX, mixed_frequencies=phi.freqs, temperature=phi.temperature,
                   position_offset=phi.position_offset, reference_grid=phi.reference_grid,
                   axis_order=phi.axis_order, pairing=phi.pairing)
    q, k = rope_rotate(q, height, width, **options), rope_rotate(k, height, width, **options)
    attn = ((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5).softmax(-1)
    return rearrange(attn @ v, 'b h n d -> b n (h d)') @ layer.proj.weight.t() + layer.proj.bias


def irpe_reference(x, layer, height, width):
    phi = layer.phi
    axes = ['rp_rows', 'rp_cols'] if phi.method == 'cross' else [None]
    tables = {on: [getattr(phi, f'rpe_{on}')[axis]() if axis else getattr(phi, f'rpe_{on}')() for axis in axes]
              for on in phi.on}
    ids = irpe_bucket_ids(height, width, PREFIX, phi.method, phi.ratio)
    return irpe_attention(x, *weights(layer), tables, ids, phi.mode)


REFERENCES = {
    'rpb': (dict(table_size=(2, 2), prefix_entries=False), lambda x, layer, h, w: softmax_attention(
        x, *weights(layer), relative_position_bias(layer.phi.relative_position_bias_table, (2, 2), h, w),
        PREFIX)),
    'alibi': (None, lambda x, layer, h, w: softmax_attention(
        x, *weights(layer), alibi_bias(alibi_slopes(HEADS, torch.float64).tolist(), h, w), PREFIX)),
    'decomposed_rpb': (dict(table_size=(2, 3)), lambda x, layer, h, w: decomposed_attention(
        x, *weights(layer), layer.phi.rel_pos_h, layer.phi.rel_pos_w, h, w, PREFIX)),
    'gpsa': (None, lambda x, layer, h, w: gpsa_attention(
        x, *weights(layer), layer.phi.pos_proj.weight, layer.phi.pos_proj.bias, layer.phi.gating_param, h, w,
        PREFIX)),
    'rope': (dict(frequencies='mixed', reference_grid=(3, 3), position_offset=0.5), rope_reference),
    'irpe': (dict(mode='ctx', method='product', on='qkv', num_prefix_tokens=PREFIX), irpe_reference),
}


@pytest.mark.parametrize('form', ['padded', 'packed'])
@pytest.mark.parametrize('phi', REFERENCES)
def test_rows_of_images_match_the_pair_formulas_image_by_image(phi, form):
    options, reference = REFERENCES[phi]
    layer = randomised(Attention(DIM, HEADS, phi=phi, phi_cfg=options, num_prefix_tokens=PREFIX).double())
    assert layer.phi.runs_on_token_positions
    layout = getattr(ImageLayout, form)(GRIDS, PREFIX)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(layout.num_rows, layout.length, DIM, generator=generator, dtype=torch.float64)
    upstream = torch.randn(x.shape, generator=generator, dtype=torch.float64)
    phi_params = list(layer.phi.parameters())
    out = layer(x, layout)
    got = torch.autograd.grad((out * upstream).sum(), phi_params) if phi_params else ()
    expected_out, loss = [], 0.0
    for tokens, grid, image_upstream in zip(layout.images(x), layout.grids, layout.images(upstream)):
        image_out = reference(tokens[None], layer, grid.height, grid.width)[0]
        expected_out.append(image_out.detach())
        loss = loss + (image_out * image_upstream).sum()
    # rpb's and rope's references read their tables value by value: outputs only there
    expected = torch.autograd.grad(loss, phi_params, allow_unused=True) if phi_params else ()
    for image, image_out in enumerate(expected_out):
        torch.testing.assert_close(layout.images(out)[image], image_out, rtol=0, atol=1e-10)
    for grad, expected_grad in zip(got, expected):
        if expected_grad is not None:
            torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-10)
