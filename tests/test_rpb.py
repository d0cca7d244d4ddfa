"""rpb: the learned relative position bias table of Swin and BEiT against the float64 formula, timm's
layouts and resampling, gradients, training, the position cache, errors (the meta device, compile and
torch.func: tests/test_gpu_readiness.py, tests/test_compile.py and tests/test_function_transforms.py,
which take every Φp)."""

import pytest
import torch
import torch.nn.functional as F

import posattn
from posattn import Attention, TokenGrid
from posattn.phi.rpb import num_offsets, relative_position_index
from posattn.reference import bicubic_resize, relative_position_bias, softmax_attention

from conftest import gradcheck_layer

GRIDS = [(3, 5), (4, 7)]


def drawn_rpb(num_heads=3, seed=0, **cfg):
    """A float64 rpb whose table is drawn (it starts at zero)."""
    phi = posattn.build_phi('rpb', num_heads=num_heads, **cfg).double()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        phi.relative_position_bias_table.copy_(
            torch.randn(phi.relative_position_bias_table.shape, generator=generator, dtype=torch.float64))
    return phi


def bias_of(phi, height, width, prefix, dtype=torch.float64):
    tokens = prefix + height * width
    return phi.logits_bias(torch.zeros(1, phi.num_heads, tokens, 8, dtype=dtype), None, TokenGrid(height, width, prefix))


# --- the formula ------------------------------------------------------------------------------

@pytest.mark.parametrize('height,width', GRIDS)
@pytest.mark.parametrize('prefix', [0, 1])
@pytest.mark.parametrize('table_size', ['grid', (14, 14), (2, 6)])
def test_bias_matches_the_float64_formula(height, width, prefix, table_size):
    """Pair by pair (posattn.reference): the table read at (dy + H - 1, dx + W - 1), resampled where
    the grid is not the table's; BEiT's extra entries for the class token."""
    table_size = (height, width) if table_size == 'grid' else table_size
    phi = drawn_rpb(table_size=table_size, num_prefix_tokens=prefix)
    got = bias_of(phi, height, width, prefix)
    expected = relative_position_bias(phi.relative_position_bias_table.detach(), table_size, height, width, prefix)
    assert got.shape == (1, 3, prefix + height * width, prefix + height * width)
    torch.testing.assert_close(got[0], expected, rtol=0, atol=1e-12)


def test_prefix_entries_are_beits_three_and_false_gives_zero():
    phi = drawn_rpb(table_size=(3, 5), num_prefix_tokens=2)
    table = phi.relative_position_bias_table.detach()
    assert table.shape == (num_offsets(3, 5) + 3, 3)
    bias = bias_of(phi, 3, 5, 2)[0]  # (heads, 17, 17)
    assert torch.equal(bias[:, :2, 2:], table[-3][:, None, None].expand(3, 2, 15))  # prefix query, grid key
    assert torch.equal(bias[:, 2:, :2], table[-2][:, None, None].expand(3, 15, 2))  # grid query, prefix key
    assert torch.equal(bias[:, :2, :2], table[-1][:, None, None].expand(3, 2, 2))   # prefix, prefix
    plain = drawn_rpb(table_size=(3, 5), num_prefix_tokens=2, prefix_entries=False)
    assert plain.relative_position_bias_table.shape == (num_offsets(3, 5), 3)
    plain_bias = bias_of(plain, 3, 5, 2)[0]
    assert torch.all(plain_bias[:, :2] == 0) and torch.all(plain_bias[:, :, :2] == 0)
    torch.testing.assert_close(plain_bias[:, 2:, 2:], bias_of(drawn_rpb(table_size=(3, 5)), 3, 5, 0)[0],
                               rtol=0, atol=0)  # the same draw: the grid rows come first in both tables


def test_without_prefix_tokens_the_table_is_swins():
    assert posattn.build_phi('rpb', num_heads=4).relative_position_bias_table.shape == (27 * 27, 4)
    assert posattn.build_phi('rpb', num_heads=4, num_prefix_tokens=1).relative_position_bias_table.shape == (
        27 * 27 + 3, 4)


@pytest.mark.parametrize('height,width', GRIDS)
def test_layer_output_matches_softmax_attention_with_the_bias(height, width, device):
    """Without prefix entries the bias is zero for the class token: the layer (on ``pytest --device``)
    is the float64 softmax attention with the reference's grid bias (on the CPU)."""
    torch.manual_seed(0)
    layer = Attention(24, 3, phi='rpb', phi_cfg=dict(table_size=(5, 5), prefix_entries=False),
                      num_prefix_tokens=1).double()
    with torch.no_grad():
        layer.phi.relative_position_bias_table.normal_()
    x = torch.randn(2, 1 + height * width, 24, dtype=torch.float64)
    grid_bias = relative_position_bias(layer.phi.relative_position_bias_table.detach(), (5, 5), height, width)
    with torch.no_grad():
        expected = softmax_attention(x, layer.qkv.weight, layer.qkv.bias, layer.proj.weight, layer.proj.bias, 3,
                                     grid_bias, num_prefix_tokens=1)
        out = layer.to(device)(x.to(device), (height, width)).cpu()
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)


def test_bias_is_in_the_queries_dtype_and_device():
    phi = posattn.build_phi('rpb', num_heads=2, table_size=(3, 3), num_prefix_tokens=1)
    bias = bias_of(phi, 4, 2, 1, dtype=torch.bfloat16)
    assert bias.dtype == torch.bfloat16 and bias.device == torch.device('cpu') and bias.shape == (1, 2, 9, 9)


# --- timm's layouts and resampling ------------------------------------------------------------

def test_index_is_timms_beit_and_swin():
    """The parameter layout is timm's, so its tables copy as they are."""
    pytest.importorskip('timm')
    from timm.models.beit import gen_relative_position_index
    from timm.models.swin_transformer import get_relative_position_index
    for height, width in [(3, 5), (4, 7), (14, 14)]:
        assert torch.equal(relative_position_index(height, width, 1), gen_relative_position_index((height, width)))
        assert torch.equal(relative_position_index(height, width, 0), get_relative_position_index(height, width))


@pytest.mark.parametrize('kind', ['beit', 'swin'])
def test_a_timm_table_copies_into_the_same_bias(kind):
    timm = pytest.importorskip('timm')
    if kind == 'beit':
        theirs = timm.models.beit.Attention(32, 4, window_size=(3, 5))
        prefix = 1
    else:
        theirs = timm.models.swin_transformer.WindowAttention(32, 4, window_size=(3, 5))
        prefix = 0
    torch.nn.init.normal_(theirs.relative_position_bias_table)
    ours = posattn.build_phi('rpb', num_heads=4, table_size=(3, 5), num_prefix_tokens=prefix)
    with torch.no_grad():
        ours.relative_position_bias_table.copy_(theirs.relative_position_bias_table)
        torch.testing.assert_close(bias_of(ours, 3, 5, prefix, torch.float32), theirs._get_rel_pos_bias(),
                                   rtol=0, atol=0)


@pytest.mark.parametrize('height,width', [(3, 5), (4, 7), (20, 9)])
@pytest.mark.parametrize('prefix', [0, 1])
def test_resampling_is_timms_bicubic_resize(height, width, prefix):
    """A 14 x 14 table on another grid gives the bias of the table timm resizes for that grid
    (``resize_rel_pos_bias_table_simple``: Swin's bicubic resampling; the extra rows kept)."""
    pytest.importorskip('timm')
    from timm.layers.pos_embed_rel import resize_rel_pos_bias_table_simple
    phi = drawn_rpb(num_heads=3, num_prefix_tokens=prefix)
    resized = resize_rel_pos_bias_table_simple(
        phi.relative_position_bias_table.detach().clone(), (height, width),
        (num_offsets(height, width) + 3 * prefix, 3))
    at_grid = posattn.build_phi('rpb', num_heads=3, table_size=(height, width), num_prefix_tokens=prefix).double()
    with torch.no_grad():
        at_grid.relative_position_bias_table.copy_(resized)
        torch.testing.assert_close(bias_of(phi, height, width, prefix), bias_of(at_grid, height, width, prefix),
                                   rtol=0, atol=1e-12)


def test_non_square_tables_resample_like_timms_per_head_canvas():
    """timm's (heads, 2h - 1, 2w - 1) canvas path also takes non-square tables."""
    pytest.importorskip('timm')
    from timm.layers.pos_embed_rel import resize_rel_pos_bias_table_simple
    phi = drawn_rpb(num_heads=2, table_size=(2, 6))
    canvas = phi.relative_position_bias_table.detach().t().reshape(2, 3, 11)
    expected = resize_rel_pos_bias_table_simple(canvas, (4, 3), (2, 7, 5))
    torch.testing.assert_close(phi.offset_table(4, 3), expected, rtol=0, atol=1e-12)


def test_the_reference_resampling_is_pytorchs_bicubic():
    canvas = torch.randn(3, 7, 11, dtype=torch.float64)
    for size in [(3, 5), (13, 9), (7, 11)]:
        torch.testing.assert_close(bicubic_resize(canvas, size),
                                   F.interpolate(canvas[None], size=size, mode='bicubic', align_corners=False)[0],
                                   rtol=0, atol=1e-12)


def test_on_the_tables_grid_the_table_is_read_exactly():
    phi = drawn_rpb(num_heads=2, table_size=(4, 7))
    canvas = phi.relative_position_bias_table.detach().t().reshape(2, 7, 13)
    assert torch.equal(phi.offset_table(4, 7), canvas)


# --- gradients and training -------------------------------------------------------------------

def test_gradients_reach_every_entry_of_the_table():
    layer = Attention(16, 2, phi='rpb', phi_cfg=dict(table_size=(3, 3)), num_prefix_tokens=1)
    x = torch.randn(2, 1 + 4 * 5, 16)
    layer(x, (4, 5)).square().sum().backward()  # a 4 x 5 grid reads the 3 x 3 table resampled
    table_grad = layer.phi.relative_position_bias_table.grad
    assert table_grad.shape == (25 + 3, 2) and torch.all(table_grad.abs() > 0)


def test_gradcheck_in_float64_with_resampling():
    layer = Attention(8, 2, phi='rpb', phi_cfg=dict(table_size=(2, 3)), num_prefix_tokens=1).double()
    with torch.no_grad():
        layer.phi.relative_position_bias_table.normal_()
    assert gradcheck_layer(layer, torch.randn(1, 1 + 3 * 2, 8, dtype=torch.float64), (3, 2))


@pytest.mark.parametrize('phi,shape', [('rpb', lambda h, w: (num_offsets(h, w) + 3, 3)),
                                       ('decomposed_rpb', lambda h, w: (2 * h - 1, 64))])
def test_a_vit_learns_its_table_for_its_own_grid(phi, shape):
    """In a vit_* model the table is learned for the grid of img_size (384 px: 24 x 24), unless set."""
    for img_size, grid in ((384, (24, 24)), ((224, 160), (14, 10))):
        model = posattn.create_model('vit_tiny', phi=phi, img_size=img_size, depth=1, num_classes=5)
        assert model.blocks[0].attn.phi.table_size == grid
        table = next(model.blocks[0].attn.phi.parameters())
        assert table.shape == shape(*grid)
    chosen = posattn.create_model('vit_tiny', phi=phi, phi_cfg=dict(table_size=(7, 7)), img_size=384, depth=1)
    assert chosen.blocks[0].attn.phi.table_size == (7, 7)


def test_a_training_step_of_a_vit_learns_the_table():
    torch.manual_seed(0)
    model = posattn.create_model('vit_tiny', phi='rpb', depth=1, num_classes=5).train()
    table = model.blocks[0].attn.phi.relative_position_bias_table
    assert table.shape == (27 * 27 + 3, 3) and torch.all(table == 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, labels = torch.randn(2, 3, 64, 48), torch.tensor([1, 3])
    loss = F.cross_entropy(model(x), labels)
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss) and table.abs().sum() > 0


# --- cache ---------------------------------------------------------------------------------

def test_the_position_cache_serves_the_bias_until_the_table_changes():
    layer = Attention(16, 2, phi='rpb', phi_cfg=dict(table_size=(3, 3)), num_prefix_tokens=1).eval()
    q = torch.zeros(1, 2, 13, 8)
    grid = TokenGrid(3, 4, 1)
    with torch.no_grad(), posattn.cache_positions(layer) as cache:
        first = layer.phi.logits_bias(q, None, grid)
        assert layer.phi.logits_bias(q, None, grid) is first and cache.nbytes == first.numel() * 4
        layer.phi.relative_position_bias_table.add_(1.0)
        updated = layer.phi.logits_bias(q, None, grid)
        assert updated is not first and torch.equal(updated, layer.phi.position_bias(grid))
        torch.testing.assert_close(updated, torch.ones_like(updated))  # the cubic weights sum to one
    assert layer.phi.position_cache is None


# --- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize('table_size', [14, (0, 14), (14, 14, 1), (14.0, 14), 'ab'])
def test_a_bad_table_size_says_what_it_takes(table_size):
    with pytest.raises(ValueError, match=r'rpb table_size must be a \(height, width\) pair of ints >= 1'):
        posattn.build_phi('rpb', num_heads=2, table_size=table_size)


def test_bad_options_name_the_problem():
    with pytest.raises(ValueError, match='rpb num_heads must be an int >= 1, got 0'):
        posattn.build_phi('rpb', num_heads=0)
    with pytest.raises(ValueError, match='rpb num_prefix_tokens .* must be an int >= 0, got -1'):
        posattn.build_phi('rpb', num_heads=2, num_prefix_tokens=-1)
    with pytest.raises(ValueError, match="rpb prefix_entries must be True or False, got 'yes'"):
        posattn.build_phi('rpb', num_heads=2, prefix_entries='yes')


def test_a_grid_with_another_prefix_count_names_the_fix():
    phi = posattn.build_phi('rpb', num_heads=2, num_prefix_tokens=1)
    with pytest.raises(ValueError, match='rpb built with num_prefix_tokens=1 got a 3x4 grid with 2 extra tokens: '
                                         'build it with num_prefix_tokens=2'):
        phi.logits_bias(torch.zeros(1, 2, 14, 8), None, TokenGrid(3, 4, 2))
