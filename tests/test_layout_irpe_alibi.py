"""iRPE (every method, bias and contextual) and 2D ALiBi on a layout's images in one call, against an
oracle that never runs the layer: each image's attention in float64, in a plain loop over the images,
from posattn.reference's pair formulas (alibi_bias; irpe_bucket_ids and each table read pair by pair),
with the key mask; outputs and the gradients of iRPE's tables. Then the per-pair terms themselves:
the bucket ids and the biases are, bit for bit, those of each image's grid alone."""
import math

import pytest
import torch
from einops import rearrange

from posattn import Attention, ImageLayout
from posattn.phi.alibi import alibi_slopes
from posattn.phi.irpe import layout_bucket_ids, num_buckets
from posattn.positions import token_positions
from posattn.reference import alibi_bias, irpe_attention, irpe_bucket_ids, softmax_attention

from conftest import randomised

# 1xW and Hx1 grids, a grid twice, and a 5x3 grid whose row offsets reach iRPE's compressed buckets
GRIDS = [(2, 3), (1, 5), (4, 1), (5, 3), (2, 3)]
DIM, HEADS, RATIO = 8, 2, 1.0
IRPE = [(method, mode) for method in ('euc', 'quant', 'cross', 'product') for mode in ('bias', 'ctx')]


def build(phi, num_prefix_tokens, method=None, mode=None):
    options = None if phi == 'alibi' else dict(
        method=method, mode=mode, on='qk' if mode == 'bias' else 'qkv', ratio=RATIO,
        shared_head=method in ('euc', 'cross'), num_prefix_tokens=num_prefix_tokens)
    layer = Attention(DIM, HEADS, phi=phi, phi_cfg=options, num_prefix_tokens=num_prefix_tokens)
    return randomised(layer.double(), seed=5)


def layouts(num_prefix_tokens):
    """A padded layout, and a packed one with padding after its images and a key mask."""
    packed = ImageLayout.packed(GRIDS, num_prefix_tokens)
    packed = ImageLayout.packed(GRIDS, num_prefix_tokens, length=packed.length + 3)
    key_mask = torch.rand(packed.num_rows, packed.length, generator=torch.Generator().manual_seed(2)) > 0.3
    for image_mask in packed.images(key_mask):
        image_mask[-1] = True  # every query keeps a key
    return [(ImageLayout.padded(GRIDS, num_prefix_tokens), None), (packed, key_mask)]


def irpe_tables(phi):
    """{'q' | 'k' | 'v': [one table per id table]}, heads first, the release's shapes."""
    if phi.method == 'cross':
        return {on: [getattr(phi, f'rpe_{on}')[axis]() for axis in ('rp_rows', 'rp_cols')] for on in phi.on}
    return {on: [getattr(phi, f'rpe_{on}')()] for on in phi.on}


def table_entry(table, on, mode, bucket):
    """A table's entry for a bucket: the release keeps ctx tables on q and k as (heads, d, buckets)."""
    return table[:, :, bucket] if mode == 'ctx' and on != 'v' else table[:, bucket]


def image_attention(x, layer, height, width, key_mask):
    """One image (N, C) in float64: proj(softmax(q k^T / sqrt(d) + b, over the keys the mask keeps) V + t),
    b and t read pair by pair: ALiBi's -m_h ||p_i - p_j|| (0 at a prefix token), or iRPE's bias mode
    T_k[id(i, j)] + T_q[id(j, i)], ctx mode q_s[i] . T_k[id(i, j)] + k_s[j] . T_q[id(j, i)] and
    t_i = sum_j A[i, j] T_v[id(i, j)]."""
    phi, prefix = layer.phi, layer.num_prefix_tokens
    q, k, v = rearrange(x @ layer.qkv.weight.t() + layer.qkv.bias, 'n (three h d) -> three h n d', three=3, h=HEADS)
    q_s, k_s = q / math.sqrt(q.shape[-1]), k / math.sqrt(k.shape[-1])
    logits = q_s @ k.transpose(-1, -2)  # (heads, N, N)
    tokens = logits.shape[-1]
    per_pair = {}
    if phi.phi_name == 'alibi':
        grid_bias = alibi_bias(alibi_slopes(HEADS, torch.float64).tolist(), height, width)
        logits = logits + torch.nn.functional.pad(grid_bias, (prefix, 0, prefix, 0))
    else:
        ids = irpe_bucket_ids(height, width, prefix, phi.method, phi.ratio)  # (tables, N, N)
        for on, tables in irpe_tables(phi).items():  # [table][i][j]: (heads,) bias, (heads, d) ctx
            per_pair[on] = [[[table_entry(table.expand(HEADS, *table.shape[1:]), on, phi.mode, table_ids[i, j])
                              for j in range(tokens)] for i in range(tokens)] for table, table_ids in zip(tables, ids)]
        for table in per_pair.get('k', ()):
            logits = logits + torch.stack([torch.stack([
                table[i][j] if phi.mode == 'bias' else (q_s[:, i] * table[i][j]).sum(-1)
                for j in range(tokens)], -1) for i in range(tokens)], -2)
        for table in per_pair.get('q', ()):
            logits = logits + torch.stack([torch.stack([
                table[j][i] if phi.mode == 'bias' else (k_s[:, j] * table[j][i]).sum(-1)
                for j in range(tokens)], -1) for i in range(tokens)], -2)
    attn = logits.masked_fill(~key_mask, -math.inf).softmax(-1)
    out = attn @ v  # (heads, N, d)
    for table in per_pair.get('v', ()):
        out = out + torch.stack([sum(attn[:, i, j, None] * table[i][j] for j in range(tokens))
                                 for i in range(tokens)], -2)
    return rearrange(out, 'h n d -> n (h d)') @ layer.proj.weight.t() + layer.proj.bias


def test_the_oracle_is_the_reference_where_no_key_is_masked():
    for phi, method, mode in [('alibi', None, None), ('irpe', 'cross', 'bias'), ('irpe', 'euc', 'ctx')]:
        layer = build(phi, 1, method, mode)
        x = torch.randn(1, 1 + 12, DIM, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        weights = layer.qkv.weight, layer.qkv.bias, layer.proj.weight, layer.proj.bias, HEADS
        if phi == 'alibi':
            expected = softmax_attention(x, *weights, alibi_bias(alibi_slopes(HEADS, torch.float64).tolist(), 4, 3), 1)
        else:
            expected = irpe_attention(x, *weights, irpe_tables(layer.phi), irpe_bucket_ids(4, 3, 1, method, RATIO),
                                      mode)
        got = image_attention(x[0], layer, 4, 3, torch.ones(13, dtype=torch.bool))
        torch.testing.assert_close(got, expected[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize('num_prefix_tokens', [0, 1])
@pytest.mark.parametrize('phi,method,mode', [('alibi', None, None)] + [('irpe', *options) for options in IRPE])
def test_a_layout_in_one_call_matches_the_pair_formulas_image_by_image(phi, method, mode, num_prefix_tokens):
    layer = build(phi, num_prefix_tokens, method, mode)
    assert layer.phi.runs_on_token_positions
    params = list(layer.phi.parameters())
    for layout, key_mask in layouts(num_prefix_tokens):
        generator = torch.Generator().manual_seed(7)
        x = torch.randn(layout.num_rows, layout.length, DIM, generator=generator, dtype=torch.float64)
        upstream = torch.randn(x.shape, generator=generator, dtype=torch.float64)
        out = layer(x, layout, key_mask)
        masks = layout.images(layout.valid() if key_mask is None else key_mask)
        expected_out, loss = [], 0.0
        for tokens, grid, image_mask, image_upstream in zip(layout.images(x), layout.grids, masks,
                                                            layout.images(upstream)):
            image_out = image_attention(tokens, layer, grid.height, grid.width, image_mask)
            expected_out.append(image_out.detach())
            loss = loss + (image_out * image_upstream).sum()
        for got, expected in zip(layout.images(out), expected_out):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)
        if params:
            got = torch.autograd.grad((out * upstream).sum(), params)
            for grad, expected in zip(got, torch.autograd.grad(loss, params)):
                torch.testing.assert_close(grad, expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize('num_prefix_tokens', [0, 1])
@pytest.mark.parametrize('method', ['euc', 'quant', 'cross', 'product'])
@pytest.mark.parametrize('ratio', [0.7, 1.9, 2.5])
def test_each_pair_gets_its_bucket_on_its_image_grid(method, ratio, num_prefix_tokens):
    layout = ImageLayout.packed(GRIDS + [(7, 2)], num_prefix_tokens, length=60)
    ids = layout_bucket_ids(layout, 1, method, ratio, torch.device('cpu'))  # (tables, I, M, M)
    for image, grid in enumerate(layout.grids):
        tokens = grid.num_tokens
        expected = irpe_bucket_ids(grid.height, grid.width, num_prefix_tokens, method, ratio)
        assert torch.equal(ids[:, image, :tokens, :tokens], expected)
    assert ids.min() >= 0 and ids.max() < num_buckets(method, ratio, num_prefix_tokens)  # padding pairs too


def grid_and_layout_biases(layer, dtype, num_prefix_tokens):
    layout = ImageLayout.packed(GRIDS, num_prefix_tokens, length=60)
    positions = token_positions(layout, 1, torch.device('cpu'))
    q = torch.randn(positions.num_images, HEADS, positions.length, DIM // HEADS, dtype=dtype)
    bias = layer.phi.logits_bias_at(q, q, positions)  # (I, heads or 1, M, M)
    for image, grid in enumerate(layout.grids):
        tokens = grid.num_tokens
        image_q = q[image:image + 1, :, :tokens]
        yield bias[image, :, :tokens, :tokens], layer.phi.logits_bias(image_q, image_q, grid)[0]


@pytest.mark.parametrize('dtype', [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize('phi,method', [('alibi', None), ('irpe', 'cross'), ('irpe', 'quant')])
def test_the_layout_bias_is_each_grids_bit_for_bit(phi, method, dtype):
    layer = build(phi, 1, method, 'bias').to(dtype)
    with torch.no_grad():
        for got, expected in grid_and_layout_biases(layer, dtype, 1):
            assert got.dtype == expected.dtype == dtype
            torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_alibi_gives_no_bias_at_a_prefix_token_the_negative_distance_elsewhere_and_masks_padding():
    layer = build('alibi', 1)
    positions = token_positions(ImageLayout.padded([(3, 4), (1, 2)], 1), 2, torch.device('cpu'))
    bias = layer.phi.logits_bias_at(torch.zeros(2, HEADS, 13, 4), None, positions)
    assert bias.shape == (2, HEADS, 13, 13) and bias.dtype == torch.float32
    keys = positions.valid[:, None, None, :].expand_as(bias)  # the second image has 3 tokens, then padding
    assert torch.isfinite(bias[keys]).all() and (bias[~keys] == float('-inf')).all()
    assert not bias[:, :, 0][keys[:, :, 0]].any() and not bias[:, :, :, 0].any()
    slopes = alibi_slopes(HEADS)
    torch.testing.assert_close(bias[0, :, 1 + 11, 1 + 0], -slopes * math.hypot(2, 3), rtol=1e-6, atol=0)
    assert layer.phi.logits_bias_at(torch.zeros(2, HEADS, 13, 4), None, positions) is bias  # made once a layout


def test_irpe_refuses_a_layout_of_another_prefix_count():
    layer = build('irpe', 1, 'product', 'bias')
    positions = token_positions(ImageLayout.padded(GRIDS, 0), len(GRIDS), torch.device('cpu'))
    q = torch.zeros(len(GRIDS), HEADS, positions.length, DIM // HEADS, dtype=torch.float64)
    with pytest.raises(ValueError, match='iRPE built with num_prefix_tokens=1 got a layout .*: build it with '
                                         'num_prefix_tokens=0'):
        layer.phi.logits_bias_at(q, q, positions)
