"""posattn.analysis: PerViT's measures against float64 formulas written here, the maps against the
layer's own computation, the release initialisation's locality trend, and the figures."""
import importlib.util
import itertools
import math

import pytest
import timm
import torch
from einops import rearrange

import posattn
from posattn import Attention, TokenGrid
from posattn.analysis import (REGIONS, attention_maps, collect_attention_maps, impact, measure_attention,
                              nonlocality, plot_measures, plot_position_maps, plot_sample_attention,
                              plot_training_curve, region_radii, region_scores)
from conftest import REPO

PNG_SIGNATURE = b'\x89PNG\r\n\x1a\n'


def positions(grid):
    return [(r, c) for r in range(grid.height) for c in range(grid.width)]


def test_nonlocality_impact_and_regions_match_the_paper_formulas():
    grid = TokenGrid(3, 5)
    generator = torch.Generator().manual_seed(0)
    maps = torch.rand(2, 3, 15, 15, generator=generator, dtype=torch.float64)
    other = torch.rand(2, 3, 15, 15, generator=generator, dtype=torch.float64)
    radii = [math.sqrt(15 * theta / (220 * math.pi)) for theta in (5, 40, 120, 220)]
    bounds = list(zip([0.0] + radii[:-1], radii))
    for b, h in itertools.product(range(2), range(3)):
        omega, scores = 0.0, [0.0] * 4
        for (i, p), (j, s) in itertools.product(enumerate(positions(grid)), repeat=2):
            distance = math.dist(p, s)
            omega += maps[b, h, i, j].item() * distance
            for r, (low, high) in enumerate(bounds):
                if low <= distance < high:
                    scores[r] += maps[b, h, i, j].item()
        assert nonlocality(maps, grid)[b, h].item() == pytest.approx(omega / 15 ** 2, rel=1e-12)
        assert region_scores(maps, grid)[b, h].tolist() == pytest.approx([s / 15 ** 2 for s in scores], rel=1e-12)
        frobenius = math.sqrt(sum((maps[b, h] - other[b, h]).flatten().square().tolist()))
        assert impact(maps, other)[b, h].item() == pytest.approx(1 / frobenius, rel=1e-12)


def test_region_radii_are_the_papers_on_14x14():
    assert [round(r, 2) for r in region_radii(TokenGrid(14, 14))] == [1.19, 3.37, 5.83, 7.9]
    assert REGIONS == ('central', 'para-central', 'mid-peripheral', 'far-peripheral')


def test_measures_refuse_maps_of_another_grid():
    with pytest.raises(ValueError, match=r'maps over a 3x4 grid should end in \(12, 12\), got shape \(2, 13, 13\)'):
        nonlocality(torch.zeros(2, 13, 13), TokenGrid(3, 4))


def layer_qkv(layer, x):
    return rearrange(layer.qkv(x), 'b n (three h d) -> three b h n d', three=3, h=layer.num_heads).unbind(0)


@pytest.mark.parametrize('prefix', [0, 1])
def test_peripheral_maps_are_what_the_layer_computes(prefix):
    torch.manual_seed(0)
    grid = TokenGrid(4, 5, prefix)
    layer = Attention(32, 4, phi='peripheral', num_prefix_tokens=prefix).double()
    x = torch.randn(3, grid.num_tokens, 32, dtype=torch.float64)
    (maps,) = collect_attention_maps(layer_model(layer, grid), x).values()
    q, k, v = layer_qkv(layer, x)
    phi = layer.phi.position_attention(4, 5)
    bias = torch.zeros(4, grid.num_tokens, grid.num_tokens, dtype=torch.float64)
    bias[:, prefix:, prefix:] = phi.log()
    logits = q @ k.transpose(-2, -1) / math.sqrt(8)
    cut = slice(prefix, None)
    torch.testing.assert_close(maps.position[0], phi.float())
    torch.testing.assert_close(maps.content, logits.softmax(-1)[..., cut, cut].float())
    torch.testing.assert_close(maps.mixed, (logits + bias).softmax(-1)[..., cut, cut].float())
    if not prefix:  # the layer's output is the mixed attention applied to v
        out = layer.proj(rearrange(maps.mixed.double() @ v, 'b h n d -> b n (h d)'))
        torch.testing.assert_close(out, layer(x, grid), rtol=1e-5, atol=1e-6)


def test_maps_with_a_key_mask_and_an_attention_mask_are_the_layers_probabilities():
    """Φa is the softmax of the content, the Φp bias and the attention mask over the kept
    keys, Φc that of the content alone; a sequence with no key left attends to nothing, as in the
    layer, and has zero maps."""
    generator = torch.Generator().manual_seed(0)
    grid = TokenGrid(2, 3, 1)
    q, k = (torch.randn(3, 2, 7, 4, generator=generator, dtype=torch.float64) for _ in range(2))
    bias, attn_mask = torch.randn(1, 2, 7, 7, generator=generator), torch.randn(3, 1, 7, 7, generator=generator)
    key_mask = torch.tensor([[1] * 7, [1, 0, 1, 1, 0, 1, 1], [0] * 7], dtype=torch.bool)
    maps = attention_maps(q, k, bias, grid, key_mask, attn_mask)
    logits = q @ k.transpose(-2, -1) / 2  # head_dim 4
    for b, keep in enumerate(key_mask):
        for name, logits_bias in (('content', 0.0), ('mixed', bias[0].double() + attn_mask[b].double())):
            expected = torch.zeros(2, 7, 7, dtype=torch.float64)
            if keep.any():
                expected[:, :, keep] = (logits[b] + logits_bias)[:, :, keep].softmax(-1)
            torch.testing.assert_close(getattr(maps, name)[b], expected[:, 1:, 1:].float())
    torch.testing.assert_close(maps.position, bias[..., 1:, 1:].exp())


class layer_model(torch.nn.Module):
    """One attention layer called with its grid, as a model."""

    def __init__(self, layer, grid):
        super().__init__()
        self.layer, self.grid = layer, grid

    def forward(self, x):
        return self.layer(x, self.grid)


def test_irpe_position_map_is_exp_of_its_bias_and_none_has_none():
    torch.manual_seed(1)
    grid = TokenGrid(3, 4, 1)
    layer = Attention(32, 4, phi='irpe', phi_cfg=dict(method='product', mode='ctx', on='k'), num_prefix_tokens=1)
    with torch.no_grad():
        layer.phi.rpe_k.lookup_table_weight.normal_()
    x = torch.randn(2, grid.num_tokens, 32)
    (maps,) = collect_attention_maps(layer_model(layer, grid), x).values()
    q, _, _ = layer_qkv(layer, x)
    expected = layer.phi.term('k', q / math.sqrt(8), grid)[..., 1:, 1:].exp()
    torch.testing.assert_close(maps.position, expected.detach())
    plain = Attention(32, 4, phi='none')
    (maps,) = collect_attention_maps(layer_model(plain, TokenGrid(3, 4)), torch.randn(2, 12, 32)).values()
    assert maps.position is None and maps.mixed is maps.content


def test_measures_stream_over_batches_and_restore_training_mode():
    torch.manual_seed(2)
    model = posattn.create_model('vit_tiny', phi='peripheral', img_size=64, depth=2, num_classes=0)
    images = torch.randn(6, 3, 64, 64)
    model.train()
    streamed = measure_attention(model, [images[:2], images[2:]])
    whole = measure_attention(model, [images])
    assert model.training
    assert [m.name for m in streamed] == ['blocks.0.attn', 'blocks.1.attn']
    for a, b in zip(streamed, whole):
        assert a.num_samples == b.num_samples == 6
        for key in ('nonlocality_position', 'nonlocality_content', 'nonlocality_mixed', 'impact_position',
                    'impact_content', 'region_scores'):
            torch.testing.assert_close(getattr(a, key), getattr(b, key))
    record = whole[0].to_dict()
    assert record['grid'] == [4, 4] and len(record['impact_position']) == 3 and len(record['regions']) == 3
    with pytest.raises(ValueError, match=r'layer blocks.0.attn saw a 2x2 grid .* after a 4x4 grid'):
        measure_attention(model, [images, torch.randn(1, 3, 32, 32)])


def test_release_initialisation_gets_less_local_with_depth():
    """s_l rises from -5 to 4 over the layers: Ω of Φp rises with depth, regions move outwards."""
    torch.manual_seed(3)
    model = posattn.create_model('pervit_tiny', num_classes=0)
    measures = measure_attention(model, [torch.randn(2, 3, 224, 224)])
    omega = torch.stack([m.nonlocality_position.mean() for m in measures])
    assert torch.all(omega[1:] > omega[:-1])
    assert measures[0].regions == ['para-central'] * 4 and measures[-1].regions == ['mid-peripheral'] * 4


def test_swapped_timm_model_is_analysed_and_plain_models_are_refused():
    model = timm.create_model('vit_tiny_patch16_224', pretrained=False, img_size=32, patch_size=8, depth=2)
    posattn.swap_attention(model, phi='peripheral')
    maps = collect_attention_maps(model, torch.randn(1, 3, 32, 32))
    assert list(maps) == ['blocks.0.attn', 'blocks.1.attn'] and maps['blocks.0.attn'].mixed.shape == (1, 3, 16, 16)
    with pytest.raises(ValueError, match='Linear has no posattn.Attention layer to analyse'):
        measure_attention(torch.nn.Linear(2, 2), [torch.zeros(1, 2)])


def assert_png(path):
    assert path.read_bytes()[:8] == PNG_SIGNATURE and path.stat().st_size > 2000


def colorbars(fig):
    return [ax._colorbar for ax in fig.axes if getattr(ax, '_colorbar', None) is not None]


def map_scales(fig):
    """(vmin, vmax) of every map drawn in ``fig``: 2-D images (the input pictures are RGB), colour bars left out."""
    return {(im.norm.vmin, im.norm.vmax) for ax in fig.axes if getattr(ax, '_colorbar', None) is None
            for im in ax.images if im.get_array().ndim == 2}


def test_figures_are_written(tmp_path):
    torch.manual_seed(4)
    model = posattn.create_model('pervit_tiny', num_classes=0)
    images = torch.randn(2, 3, 96, 80)
    maps = collect_attention_maps(model, images)
    plot_position_maps(maps, tmp_path / 'position.png', query=(1, 2))
    plot_sample_attention(images, maps, tmp_path / 'samples.png', layers=['blocks.3.attn'])
    plot_measures(measure_attention(model, [images]), tmp_path / 'measures.png')
    for name in ('position.png', 'samples.png', 'measures.png'):
        assert_png(tmp_path / name)
    with pytest.raises(ValueError, match=r'query \(6, 0\) is outside the 6x5 grid'):
        plot_position_maps(maps, tmp_path / 'x.png', query=(6, 0))
    with pytest.raises(ValueError, match=r"no maps for layers \['blocks.12.attn'\]"):
        plot_sample_attention(images, maps, tmp_path / 'x.png', layers=['blocks.12.attn'])
    plain = posattn.create_model('vit_tiny', phi='none', img_size=32, depth=1)
    with pytest.raises(ValueError, match='no layer has a position attention Φp'):
        plot_position_maps(collect_attention_maps(plain, torch.randn(1, 3, 32, 32)), tmp_path / 'x.png')


def test_position_maps_share_one_labelled_colour_scale(tmp_path):
    """Every layer's and head's Φp on one scale from 0 to the largest value shown, with its colour bar."""
    model = posattn.create_model('pervit_tiny', num_classes=0)
    maps = collect_attention_maps(model, torch.randn(1, 3, 64, 64))
    fig = plot_position_maps(maps, tmp_path / 'position.png')
    query = 2 * 4 + 2  # the centre of the 4 x 4 grid
    largest = max(m.position[0, :, query].max().item() for m in maps.values())
    (bar,) = colorbars(fig)
    assert (bar.norm.vmin, bar.norm.vmax) == (0, pytest.approx(largest))
    assert 'one scale for every layer and head' in bar.ax.get_ylabel()
    assert map_scales(fig) == {(bar.norm.vmin, bar.norm.vmax)}
    heads = maps['blocks.0.attn'].position.shape[1]
    assert sum(len(ax.images) for ax in fig.axes) == len(maps) * heads


def test_sample_maps_share_a_position_and_a_probability_scale(tmp_path):
    model = posattn.create_model('pervit_tiny', num_classes=0)
    images = torch.randn(2, 3, 64, 64)
    maps = collect_attention_maps(model, images)
    fig = plot_sample_attention(images, maps, tmp_path / 'samples.png')
    position, probability = colorbars(fig)
    assert 'every Φp map' in position.ax.get_ylabel() and 'every Φc, Φa map' in probability.ax.get_ylabel()
    query = 2 * 4 + 2
    largest = max(torch.stack([m.content, m.mixed])[..., query, :].max().item() for m in maps.values())
    assert (probability.norm.vmin, probability.norm.vmax) == (0, pytest.approx(largest))
    assert map_scales(fig) == {(bar.norm.vmin, bar.norm.vmax) for bar in (position, probability)}
    plain = posattn.create_model('vit_tiny', phi='none', img_size=32, depth=1)
    images = torch.randn(1, 3, 32, 32)
    fig = plot_sample_attention(images, collect_attention_maps(plain, images), tmp_path / 'plain.png')
    (bar,) = colorbars(fig)
    assert bar.ax.get_ylabel() == 'attention probability (one scale for every Φc, Φa map)'


def test_measures_legend_names_every_head(tmp_path):
    model = posattn.create_model('vit_tiny', phi='peripheral', img_size=32, depth=2, num_classes=0)
    fig = plot_measures(measure_attention(model, [torch.randn(2, 3, 32, 32)]), tmp_path / 'measures.svg')
    (legend,) = fig.legends
    assert [text.get_text() for text in legend.get_texts()] == ['head 0', 'head 1', 'head 2', 'layer mean']
    assert b'<svg' in (tmp_path / 'measures.svg').read_bytes()[:400]


def test_sample_maps_tell_their_two_colour_bars_apart(tmp_path):
    """Φp and the attention probabilities in different colour maps, each colour bar titled with its maps."""
    model = posattn.create_model('pervit_tiny', num_classes=0)
    images = torch.randn(2, 3, 64, 64)
    fig = plot_sample_attention(images, collect_attention_maps(model, images), tmp_path / 'samples.png')
    position, probability = colorbars(fig)
    assert (position.ax.get_title(), probability.ax.get_title()) == ('Φp', 'Φc, Φa')
    assert position.cmap.name != probability.cmap.name
    columns = {'Φp': set(), 'Φc': set(), 'Φa': set()}  # the colour maps drawn under each column title
    for ax in fig.axes[1:13]:  # the first row: the picture, then Φp, Φc, Φa of each head
        columns[ax.get_title().split()[0]].add(ax.images[0].get_cmap().name)
    assert columns == {'Φp': {position.cmap.name}, 'Φc': {probability.cmap.name}, 'Φa': {probability.cmap.name}}


def test_position_maps_name_the_query_and_the_model(tmp_path):
    model = posattn.create_model('pervit_tiny', num_classes=0)
    maps = collect_attention_maps(model, torch.randn(1, 3, 96, 80))
    fig = plot_position_maps(maps, tmp_path / 'position.png', query=(1, 2), title='pervit_t_shapes: epoch_10.pth')
    assert fig.get_suptitle() == ('Φp of the query at row 1, column 2 of the 6x5 token grid\n'
                                  'pervit_t_shapes: epoch_10.pth')
    fig = plot_position_maps(maps, tmp_path / 'position.png')
    assert fig.get_suptitle() == 'Φp of the query at row 3, column 2 of the 6x5 token grid'


def test_measures_label_every_y_axis_with_quantity_and_unit(tmp_path):
    model = posattn.create_model('vit_tiny', phi='peripheral', img_size=32, depth=2, num_classes=0)
    fig = plot_measures(measure_attention(model, [torch.randn(2, 3, 32, 32)]), tmp_path / 'measures.png')
    drawn = [ax for ax in fig.axes if ax.axison]
    assert [ax.get_title() for ax in drawn] == ['Ω (Eq. 13) of Φp', 'Ω (Eq. 13) of Φc', 'Ω (Eq. 13) of Φa',
                                               'Ψ (Eq. 12) of Φp', 'Ψ (Eq. 12) of Φc']
    assert [ax.get_ylabel() for ax in drawn] == [
        'Ω: pair mean of Φp x distance (tokens)', 'Ω: mean attention distance / |P| (tokens)',
        'Ω: mean attention distance / |P| (tokens)', 'Ψ = 1 / ||Φa - Φp||_F (no unit)', 'Ψ = 1 / ||Φa - Φc||_F (no unit)']


def test_an_impact_without_bound_is_cut_and_marked_while_the_record_keeps_it(tmp_path):
    """Φa = Φc where the Φp adds nothing at initialisation (rpb's zero tables): Ψc is 1 / 0, or
    about 1 / rounding; its bars stop at IMPACT_SHOWN, hatched, and the panel says why."""
    from posattn.analysis.figures import IMPACT_SHOWN
    torch.manual_seed(0)
    model = posattn.create_model('vit_tiny', phi='rpb', img_size=32, depth=2, num_classes=0)
    measures = measure_attention(model, [torch.randn(2, 3, 32, 32)])
    assert all(m.impact_content.min() > IMPACT_SHOWN for m in measures)  # as computed
    fig = plot_measures(measures, tmp_path / 'measures.png')
    (panel,) = [ax for ax in fig.axes if ax.axison and ax.get_title().startswith('Ψ (Eq. 12) of Φc')]
    assert 'hatched: larger' in panel.get_title()
    bars = [patch for patch in panel.patches]
    assert bars and all(bar.get_height() == IMPACT_SHOWN and bar.get_hatch() == '///' for bar in bars)


@pytest.mark.parametrize('side,apply', [(3, False), (4, False), (5, True), (7, True), (14, True)])
def test_regions_are_named_only_on_grids_where_each_holds_a_pair_of_positions(side, apply):
    """On 4 x 4 the radii are 0.34, 0.96, 1.67, 2.26 (Eq. 38): no two positions are para-central
    apart, so no head can be there and the names say nothing."""
    from posattn.analysis.metrics import region_radii, regions_apply
    grid = TokenGrid.of((side, side))
    distances = {math.hypot(dy, dx) for dy in range(side) for dx in range(side)}
    bounds = (0.0, *region_radii(grid))
    assert all(any(low <= d < high for d in distances) for low, high in zip(bounds, bounds[1:])) == apply  # oracle
    assert regions_apply(grid) == apply
    model = posattn.create_model('vit_tiny', phi='peripheral', img_size=16 * side, depth=1, num_classes=0)
    (measures,) = measure_attention(model, [torch.randn(1, 3, 16 * side, 16 * side)])
    if apply:
        assert set(measures.regions) <= set(REGIONS)
    else:
        assert measures.regions == [f'grid too small for regions ({side}x{side})'] * 3
    assert measures.to_dict()['regions_apply'] == apply


def visible_text_sizes(fig):
    import matplotlib.text
    return [text.get_fontsize() for text in fig.findobj(matplotlib.text.Text) if text.get_text() and text.get_visible()]


def test_figures_draw_readable_text_without_touching_matplotlibs_state(tmp_path):
    """Every text at 9 pt or more, 100 dpi by default; rcParams, pyplot's figures and the backend as before."""
    import matplotlib
    import matplotlib.pyplot as plt
    model = posattn.create_model('pervit_tiny', num_classes=0)
    images = torch.randn(1, 3, 64, 64)
    maps = collect_attention_maps(model, images)
    rc_before, backend = dict(matplotlib.rcParams), matplotlib.get_backend()
    open_before = plt.get_fignums()  # another test in this process may have left pyplot figures open
    figures = [plot_position_maps(maps, tmp_path / 'position.png'),
               plot_sample_attention(images, maps, tmp_path / 'samples.png', layers=['blocks.0.attn']),
               plot_measures(measure_attention(model, [images]), tmp_path / 'measures.png'),
               plot_training_curve({1: 2.0, 2: 1.5}, {'accuracy/top1': {1: 40.0}}, tmp_path / 'curve.png')]
    for fig in figures:
        assert min(visible_text_sizes(fig)) >= 9
    assert dict(matplotlib.rcParams) == rc_before and matplotlib.get_backend() == backend
    assert plt.get_fignums() == open_before
    width_inches = figures[-1].get_size_inches()[0]
    assert png_width(tmp_path / 'curve.png') == pytest.approx(100 * width_inches, rel=0.1)


def png_width(path):
    import struct
    return struct.unpack('>I', path.read_bytes()[16:20])[0]


def test_importing_the_analysis_leaves_matplotlib_unimported():
    import subprocess
    import sys
    code = 'import sys, posattn.analysis; print(sorted(m for m in sys.modules if m.startswith("matplotlib")))'
    result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == '[]'


def test_training_curve_draws_the_loss_and_each_validation(tmp_path):
    losses = {20: 1.8, 40: 1.2, 60: 0.05}
    fig = plot_training_curve(losses, {'accuracy/top1': {2: 90.0, 1: 50.0}, 'accuracy/top5': {}},
                              tmp_path / 'curve.png', validation_unit='epoch', title='pervit_t_shapes')
    assert_png(tmp_path / 'curve.png')
    loss, validation = fig.axes
    assert (loss.get_xlabel(), loss.get_ylabel(), loss.get_yscale()) == ('iteration', 'loss', 'log')
    assert (validation.get_xlabel(), validation.get_ylabel()) == ('epoch', 'accuracy/top1')
    assert loss.lines[0].get_xydata().tolist() == [[20, 1.8], [40, 1.2], [60, 0.05]]
    assert validation.lines[0].get_xydata().tolist() == [[1, 50.0], [2, 90.0]]  # in step order; top5 skipped
    assert fig.get_suptitle() == 'pervit_t_shapes'
    fig = plot_training_curve({1: 2.0, 2: 1.9}, {'mIoU': {}}, tmp_path / 'no_validation.png',
                              validation_unit='iteration')
    (loss,) = fig.axes
    assert loss.get_yscale() == 'linear'
    fig = plot_training_curve({}, {'coco/bbox_mAP': {300: 0.2}, 'coco/segm_mAP': {300: 0.1, 600: 0.3}},
                              tmp_path / 'validation_only.png', validation_unit='iteration')
    (validation,) = fig.axes
    assert validation.get_xlabel() == 'iteration' and validation.get_ylabel() == 'metric'
    assert [text.get_text() for text in validation.get_legend().get_texts()] == ['coco/bbox_mAP', 'coco/segm_mAP']
    with pytest.raises(ValueError, match='nothing to plot: no training loss and no validation metric'):
        plot_training_curve({}, {'accuracy/top1': {}}, tmp_path / 'x.png')
    with pytest.raises(ValueError, match="validation_unit must be 'epoch' or 'iteration', got 'step'"):
        plot_training_curve(losses, {}, tmp_path / 'x.png', validation_unit='step')


def quickstart():
    spec = importlib.util.spec_from_file_location('quickstart', REPO / 'examples' / 'quickstart.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_text_map_draws_on_a_fixed_scale():
    """A flat Φp draws flat, whatever its level and however small its spread; 0 and 1 are the ends."""
    ascii_map = quickstart().ascii_map
    nearly_flat = 0.982 + 1e-4 * torch.rand(9, 12)
    assert set(ascii_map(nearly_flat).replace('\n', '')) == {'@'}
    assert set(ascii_map(torch.full((3, 4), 0.5)).replace('\n', '')) == {'='}
    assert ascii_map(torch.tensor([[0.0, 0.5, 1.0]])) == ' =@'


def test_figure_rows_name_a_models_blocks_briefly():
    from posattn.analysis.figures import _layer_label
    assert _layer_label('model.blocks.11.attn') == 'block 11'
    assert _layer_label('blocks.0.attn') == 'block 0'
    assert _layer_label('encoder.layers.encoder_layer_3.self_attention') == 'encoder.layers.encoder_layer_3.self_attention'
