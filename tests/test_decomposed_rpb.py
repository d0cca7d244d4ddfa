"""decomposed_rpb: MViTv2's and SAM's decomposed relative position embeddings against the float64
formula and SAM's own code, their linear resampling, gradients, training, errors (the meta device:
tests/test_gpu_readiness.py)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import posattn
from posattn import Attention, TokenGrid
from posattn.phi.decomposed_rpb import DecomposedRelativePositionBias
from posattn.reference import decomposed_attention, decomposed_relative_position_bias, linear_resize

from conftest import gradcheck_layer

GRIDS = [(3, 5), (4, 2), (1, 1), (1, 4)]


def drawn(head_dim=8, seed=0, **cfg):
    """A float64 decomposed_rpb whose embeddings are drawn (they start at zero)."""
    phi = posattn.build_phi('decomposed_rpb', head_dim=head_dim, **cfg).double()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for table in (phi.rel_pos_h, phi.rel_pos_w):
            table.copy_(torch.randn(table.shape, generator=generator, dtype=torch.float64))
    return phi


def queries(height, width, prefix, batch=2, heads=3, head_dim=8, seed=1, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, prefix + height * width, head_dim, generator=generator, dtype=dtype)


# --- the formula ------------------------------------------------------------------------------

@pytest.mark.parametrize('height,width', GRIDS)
@pytest.mark.parametrize('prefix', [0, 1])
@pytest.mark.parametrize('table_size', ['grid', (4, 4), (2, 6)])
def test_bias_matches_the_float64_formula(height, width, prefix, table_size):
    """Pair by pair (posattn.reference): each query read against the embeddings of its row and column
    offsets, resampled where the grid is not the table's; zero wherever the class token is."""
    table_size = (height, width) if table_size == 'grid' else table_size
    phi = drawn(table_size=table_size, num_prefix_tokens=prefix)
    q = queries(height, width, prefix)
    got = phi.logits_bias(q, None, TokenGrid(height, width, prefix))
    expected = decomposed_relative_position_bias(q, phi.rel_pos_h.detach(), phi.rel_pos_w.detach(), height, width,
                                                 prefix)
    assert got.shape == (2, 3, prefix + height * width, prefix + height * width)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize('height,width', [(3, 3), (4, 5)])
@pytest.mark.parametrize('prefix', [0, 1])
def test_layer_output_matches_the_float64_attention(height, width, prefix):
    """The layer is softmax attention with the bias of its own queries added to the scaled logits."""
    torch.manual_seed(0)
    layer = Attention(24, 3, phi='decomposed_rpb', phi_cfg=dict(table_size=(3, 3)), num_prefix_tokens=prefix).double()
    with torch.no_grad():
        layer.phi.rel_pos_h.normal_(), layer.phi.rel_pos_w.normal_()
    x = torch.randn(2, prefix + height * width, 24, dtype=torch.float64)
    with torch.no_grad():
        expected = decomposed_attention(x, layer.qkv.weight, layer.qkv.bias, layer.proj.weight, layer.proj.bias, 3,
                                        layer.phi.rel_pos_h, layer.phi.rel_pos_w, height, width, prefix)
        torch.testing.assert_close(layer(x, (height, width)), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize('height,width', [(4, 4), (3, 5), (7, 2)])
def test_the_bias_is_sams(height, width):
    """SAM's own term (timm's ``get_decomposed_rel_pos_bias``, with its linear resampling of the
    embeddings for a grid other than the 4 x 4 they are learned for), head by head."""
    pytest.importorskip('timm')
    from timm.models.vision_transformer_sam import get_decomposed_rel_pos_bias
    phi = drawn(table_size=(4, 4))
    q = queries(height, width, 0)
    expected = get_decomposed_rel_pos_bias(q.flatten(0, 1), phi.rel_pos_h.detach(), phi.rel_pos_w.detach(),
                                           (height, width), (height, width))
    got = phi.logits_bias(q, None, TokenGrid(height, width))
    torch.testing.assert_close(got, expected.unflatten(0, (2, 3)), rtol=0, atol=1e-12)


def test_the_reference_resampling_is_pytorchs_linear():
    embeddings = torch.randn(7, 5, dtype=torch.float64)
    for length in (1, 3, 7, 13, 27):
        torch.testing.assert_close(linear_resize(embeddings, length),
                                   F.interpolate(embeddings.t()[None], size=length, mode='linear',
                                                 align_corners=False)[0].t(), rtol=0, atol=1e-12)


def test_on_the_tables_grid_the_embeddings_are_read_exactly():
    phi = drawn(table_size=(4, 7))
    along_rows, along_cols = phi.offset_embeddings(4, 7)
    assert torch.equal(along_rows, phi.rel_pos_h) and torch.equal(along_cols, phi.rel_pos_w)
    assert phi.table_size == (4, 7) and phi.rel_pos_h.shape == (7, 8) and phi.rel_pos_w.shape == (13, 8)


def test_each_query_reads_its_own_bias_linearly():
    """The bias of a batch is the bias of each image, and doubles with the queries."""
    phi = drawn(table_size=(3, 3), num_prefix_tokens=1)
    grid = TokenGrid(3, 4, 1)
    q = queries(3, 4, 1, batch=3)
    batched = phi.logits_bias(q, None, grid)
    for image in range(3):
        torch.testing.assert_close(phi.logits_bias(q[image:image + 1], None, grid)[0], batched[image], rtol=0, atol=1e-12)
    torch.testing.assert_close(phi.logits_bias(2 * q, None, grid), 2 * batched, rtol=0, atol=1e-12)
    assert torch.all(batched[:, :, 0] == 0) and torch.all(batched[:, :, :, 0] == 0)


def test_bias_is_in_the_queries_dtype():
    phi = posattn.build_phi('decomposed_rpb', head_dim=8, table_size=(3, 3), num_prefix_tokens=1)
    bias = phi.logits_bias(queries(4, 2, 1, dtype=torch.bfloat16), None, TokenGrid(4, 2, 1))
    assert bias.dtype == torch.bfloat16 and bias.shape == (2, 3, 9, 9)
    layer = Attention(24, 3, phi='decomposed_rpb', num_prefix_tokens=1)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        assert layer(torch.randn(2, 13, 24), (3, 4)).dtype == torch.bfloat16


def test_the_position_cache_computes_it_for_every_call():
    """The bias depends on the queries: inside cache_positions each call still gets its own."""
    layer = Attention(16, 2, phi='decomposed_rpb', phi_cfg=dict(table_size=(3, 3)), num_prefix_tokens=1).eval()
    torch.nn.init.normal_(layer.phi.rel_pos_h), torch.nn.init.normal_(layer.phi.rel_pos_w)
    x, other = torch.randn(2, 13, 16), torch.randn(2, 13, 16)
    with torch.no_grad():
        expected = layer(x, (3, 4)), layer(other, (3, 4))
        with posattn.cache_positions(layer) as cache:
            got = layer(x, (3, 4)), layer(other, (3, 4))
            assert cache.nbytes == 0
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


# --- gradients and training -------------------------------------------------------------------

def test_gradients_reach_every_embedding():
    layer = Attention(16, 2, phi='decomposed_rpb', phi_cfg=dict(table_size=(2, 3)), num_prefix_tokens=1)
    torch.nn.init.normal_(layer.phi.rel_pos_h), torch.nn.init.normal_(layer.phi.rel_pos_w)
    layer(torch.randn(2, 1 + 4 * 5, 16), (4, 5)).square().sum().backward()  # both axes resampled
    for table in (layer.phi.rel_pos_h, layer.phi.rel_pos_w):
        assert torch.all(table.grad.abs().sum(-1) > 0)


def test_gradcheck_in_float64_with_resampling():
    layer = Attention(8, 2, phi='decomposed_rpb', phi_cfg=dict(table_size=(2, 3)), num_prefix_tokens=1).double()
    with torch.no_grad():
        layer.phi.rel_pos_h.normal_(), layer.phi.rel_pos_w.normal_()
    assert gradcheck_layer(layer, torch.randn(1, 1 + 3 * 2, 8, dtype=torch.float64), (3, 2))


def test_a_training_step_of_a_vit_learns_the_embeddings():
    """Two blocks: the class token, which the head reads, gets no bias, so the first block's
    embeddings reach the loss through the second block's keys and values."""
    torch.manual_seed(0)
    model = posattn.create_model('vit_tiny', phi='decomposed_rpb', depth=2, num_classes=5).train()
    phi = model.blocks[0].attn.phi
    assert phi.rel_pos_h.shape == (27, 64) and torch.all(phi.rel_pos_h == 0) and torch.all(phi.rel_pos_w == 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = F.cross_entropy(model(torch.randn(2, 3, 64, 48)), torch.tensor([1, 3]))
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss) and phi.rel_pos_h.abs().sum() > 0 and phi.rel_pos_w.abs().sum() > 0


# --- a model's own embeddings -----------------------------------------------------------------

def test_of_tables_holds_the_models_parameters():
    rel_pos_h, rel_pos_w = nn.Parameter(torch.randn(5, 8)), nn.Parameter(torch.randn(9, 8))
    phi = DecomposedRelativePositionBias.of_tables(rel_pos_h, rel_pos_w)
    assert phi.rel_pos_h is rel_pos_h and phi.rel_pos_w is rel_pos_w
    assert phi.table_size == (3, 5) and phi.head_dim == 8 and list(phi.parameters()) == [rel_pos_h, rel_pos_w]


def test_of_tables_names_what_it_takes():
    with pytest.raises(ValueError, match=r'takes rel_pos_h as a Parameter \(2 L - 1, head_dim\), an odd number of '
                                         r'offsets .* got Parameter of shape \(4, 8\)'):
        DecomposedRelativePositionBias.of_tables(nn.Parameter(torch.zeros(4, 8)), nn.Parameter(torch.zeros(5, 8)))
    with pytest.raises(ValueError, match=r'takes rel_pos_w as a Parameter .* got Tensor of shape \(5, 8\)'):
        DecomposedRelativePositionBias.of_tables(nn.Parameter(torch.zeros(5, 8)), torch.zeros(5, 8))
    with pytest.raises(ValueError, match='rel_pos_h and rel_pos_w of the same head_dim, got 8 and 4'):
        DecomposedRelativePositionBias.of_tables(nn.Parameter(torch.zeros(5, 8)), nn.Parameter(torch.zeros(5, 4)))


# --- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize('table_size', [14, (0, 14), (14, 14, 1), (14.0, 14), 'ab'])
def test_a_bad_table_size_says_what_it_takes(table_size):
    with pytest.raises(ValueError, match=r'decomposed_rpb table_size must be a \(height, width\) pair of ints >= 1'):
        posattn.build_phi('decomposed_rpb', head_dim=8, table_size=table_size)


def test_bad_options_name_the_problem():
    with pytest.raises(ValueError, match='decomposed_rpb head_dim must be an int >= 1, got 0'):
        posattn.build_phi('decomposed_rpb', head_dim=0)
    with pytest.raises(ValueError, match='decomposed_rpb num_prefix_tokens .* must be an int >= 0, got -1'):
        posattn.build_phi('decomposed_rpb', head_dim=8, num_prefix_tokens=-1)


def test_a_grid_or_queries_that_do_not_fit_name_the_fix():
    phi = posattn.build_phi('decomposed_rpb', head_dim=8, num_prefix_tokens=1)
    with pytest.raises(ValueError, match='decomposed_rpb built with num_prefix_tokens=1 got a 3x4 grid with 2 extra '
                                         'tokens: build it with num_prefix_tokens=2'):
        phi.logits_bias(torch.zeros(1, 2, 14, 8), None, TokenGrid(3, 4, 2))
    with pytest.raises(ValueError, match='decomposed_rpb built with head_dim=8 got queries of 16 channels a head: '
                                         'build it with head_dim=16'):
        phi.logits_bias(torch.zeros(1, 2, 13, 16), None, TokenGrid(3, 4, 1))
