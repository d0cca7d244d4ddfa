"""Per-image layouts (posattn.layout): a batch of images of different grids, padded or packed,
gives each image the output and the gradients of that image run alone, for every registered Φp
(float64), and nothing leaks into padding or across images."""
import pytest
import torch

import posattn
from posattn import Attention, ImageLayout, TokenGrid

from conftest import randomised

# Three aspect ratios, one grid twice, one image of a single row.
GRIDS = [(2, 3), (3, 2), (2, 3), (1, 4), (3, 3)]
LAYOUTS = {'padded': ImageLayout.padded, 'packed': ImageLayout.packed}
# Configurations beyond each Φp's default whose hooks differ: iRPE's contextual terms on q, k and v,
# and stacks of two Φp.
PHIS = [(name, None) for name in posattn.list_phis()] + [
    ('irpe', dict(mode='ctx', on='qkv')), (['rope', 'rpb'], None), (['peg', 'irpe'], None),
    ('irpe', dict(mode='bias', method='cross', on='qk')), ('irpe', dict(mode='ctx', method='euc', on='v')),
    ('rope', dict(frequencies='mixed', reference_grid=(3, 5), position_offset=1, axis_order='xy', pairing='halves')),
    ('rpb', dict(table_size=(2, 3))), ('rpb', dict(table_size=(4, 2), prefix_entries=False)),
    ('decomposed_rpb', dict(table_size=(3, 2))), ('alibi', None), (['alibi', 'gpsa'], None)]


def layer_with(phi, phi_cfg, num_prefix_tokens):
    if phi_cfg is not None and phi == 'irpe':
        phi_cfg = dict(phi_cfg, num_prefix_tokens=num_prefix_tokens)
    return randomised(Attention(8, 2, phi=phi, phi_cfg=phi_cfg, num_prefix_tokens=num_prefix_tokens).double())


def alone_and_together(layer, layout, x, weights, key_mask=None):
    """Outputs and gradients (input, parameters) of the layout run, and of each image run alone
    (its tokens and its part of the key mask), the loss sum(out * weights) in both."""
    x = x.clone().requires_grad_()
    out = layer(x, layout, key_mask)
    params = list(layer.parameters())
    together = torch.autograd.grad((out * weights).sum(), [x, *params], allow_unused=True)
    alone_out, alone_x, alone_params = [], [], [torch.zeros_like(p) for p in params]
    masks = [None] * layout.num_images if key_mask is None else layout.images(key_mask)
    for tokens, grid, image_weights, mask in zip(layout.images(x.detach()), layout.grids,
                                                 layout.images(weights), masks):
        tokens = tokens[None].clone().requires_grad_()
        image_out = layer(tokens, grid, None if mask is None else mask[None])
        grads = torch.autograd.grad((image_out[0] * image_weights).sum(), [tokens, *params], allow_unused=True)
        alone_out.append(image_out[0].detach())
        alone_x.append(grads[0][0])
        alone_params = [total + (0 if grad is None else grad) for total, grad in zip(alone_params, grads[1:])]
    return out.detach(), together, alone_out, alone_x, alone_params


@pytest.mark.parametrize('form', LAYOUTS)
@pytest.mark.parametrize('num_prefix_tokens', [0, 1])
@pytest.mark.parametrize('phi,phi_cfg', PHIS, ids=lambda value: str(value))
def test_each_image_gets_what_it_gets_alone(phi, phi_cfg, num_prefix_tokens, form):
    layer = layer_with(phi, phi_cfg, num_prefix_tokens)
    layout = LAYOUTS[form](GRIDS, num_prefix_tokens, length=None)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(layout.num_rows, layout.length, 8, generator=generator, dtype=torch.float64)
    weights = torch.randn(x.shape, generator=generator, dtype=torch.float64)
    out, together, alone_out, alone_x, alone_params = alone_and_together(layer, layout, x, weights)
    for image, expected in enumerate(alone_out):
        torch.testing.assert_close(layout.images(out)[image], expected, rtol=0, atol=1e-10)
        torch.testing.assert_close(layout.images(together[0])[image], alone_x[image], rtol=0, atol=1e-10)
    for grad, expected in zip(together[1:], alone_params):
        torch.testing.assert_close(torch.zeros_like(expected) if grad is None else grad, expected,
                                   rtol=0, atol=1e-10)
    outside = ~layout.valid(x.shape[0])
    assert not out[outside].any() and not together[0][outside].any(), 'padding changed or read'


@pytest.mark.parametrize('form', LAYOUTS)
def test_padding_and_other_images_are_never_read(form):
    """Changing a padding token, or another image, changes no image's output."""
    layer = layer_with('peripheral', None, 1)
    layout = LAYOUTS[form](GRIDS, 1, length=60 if form == 'packed' else 12)
    x = torch.randn(layout.num_rows, layout.length, 8, dtype=torch.float64)
    out = layer(x, layout)
    changed = x.clone()
    changed[~layout.valid(x.shape[0])] = 1e3
    torch.testing.assert_close(layer(changed, layout), out, rtol=0, atol=0)
    first_image_moved = x.clone()
    first_image_moved.flatten(0, 1)[next(layout.groups()).index[0]] += 1.0
    others = [i for i in range(layout.num_images) if i != 0]
    moved = layer(first_image_moved, layout)
    for image in others:
        torch.testing.assert_close(layout.images(moved)[image], layout.images(out)[image], rtol=0, atol=0)


@pytest.mark.parametrize('phi,phi_cfg', [('rpb', None), ('gpsa', None), ('irpe', dict(mode='ctx', on='qkv')),
                                         ('rope', None), ('decomposed_rpb', None), ('peripheral', None)], ids=str)
def test_a_key_mask_applies_within_each_image(phi, phi_cfg):
    layer = layer_with(phi, phi_cfg, 1)
    layout = ImageLayout.padded(GRIDS, 1)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(layout.num_rows, layout.length, 8, generator=generator, dtype=torch.float64)
    key_mask = torch.rand(x.shape[:2], generator=generator) > 0.3
    weights = torch.randn(x.shape, generator=generator, dtype=torch.float64)
    out, together, alone_out, alone_x, _ = alone_and_together(layer, layout, x, weights, key_mask)
    for image, expected in enumerate(alone_out):
        torch.testing.assert_close(layout.images(out)[image], expected, rtol=0, atol=1e-10)
        torch.testing.assert_close(layout.images(together[0])[image], alone_x[image], rtol=0, atol=1e-10)


def test_a_bias_of_the_grid_alone_is_computed_once_per_distinct_grid(monkeypatch):
    """Where a Φp runs once per distinct grid (it needs each grid as a canvas), its bias is made once
    for each grid, whatever the number of images of that grid."""
    layer = layer_with('peripheral', None, 0)
    calls = []
    compute = layer.phi.position_bias
    monkeypatch.setattr(layer.phi, 'position_bias', lambda grid, *args, **kwargs: calls.append(grid)
                        or compute(grid, *args, **kwargs))
    layout = ImageLayout.packed(GRIDS)
    layer(torch.randn(1, layout.length, 8, dtype=torch.float64), layout)
    assert sorted(calls, key=str) == sorted({TokenGrid(*hw) for hw in GRIDS}, key=str)


def test_the_two_forms_place_images_as_documented():
    padded = ImageLayout.padded([(2, 3), (1, 2)], num_prefix_tokens=1)
    assert (padded.rows, padded.starts, padded.length) == ((0, 1), (0, 0), 7)
    assert padded.valid().tolist() == [[True] * 7, [True] * 3 + [False] * 4]
    packed = ImageLayout.packed([(2, 3), (1, 2)], num_prefix_tokens=1, length=12)
    assert (packed.rows, packed.starts, packed.length) == ((0, 0), (0, 7), 12)
    assert packed.valid().tolist() == [[True] * 10 + [False] * 2]
    assert str(packed) == 'layout of 2 images (2x3, 1x2) in 1 rows of 12 tokens'


def test_bad_layouts_and_inputs_are_refused_with_the_reason():
    with pytest.raises(ValueError, match='images 0 and 1 overlap in row 0'):
        ImageLayout((TokenGrid(2, 2), TokenGrid(1, 1)), (0, 0), (0, 3), 8)
    with pytest.raises(ValueError, match='does not fit a row of 5 tokens'):
        ImageLayout.padded([(2, 3)], length=5)
    with pytest.raises(TypeError, match='one per image'):
        ImageLayout.padded((2, 3))
    with pytest.raises(ValueError, match='at least one image'):
        ImageLayout((), (), (), 4)
    layer = Attention(8, 2, phi='rpb', num_prefix_tokens=1)
    layout = ImageLayout.padded([(2, 3), (1, 2)], num_prefix_tokens=1)
    with pytest.raises(ValueError, match=r'does not fit tokens of shape \(2, 6, 8\)'):
        layer(torch.randn(2, 6, 8), layout)
    with pytest.raises(ValueError, match='have 0 prefix tokens; this layer has 1'):
        layer(torch.randn(2, 6, 8), ImageLayout.padded([(2, 3), (1, 2)]))
    with pytest.raises(ValueError, match=r'key_mask must be a bool tensor of shape \(B, L\) = \(2, 7\)'):
        layer(torch.randn(2, 7, 8), layout, torch.ones(2, 6, dtype=torch.bool))


@pytest.mark.parametrize('name,options', [('vit_tiny', dict(depth=2, phi='rope', dynamic_img_size=True)),
                                          ('pervit_tiny', {})])
def test_models_take_a_list_of_images_for_inference_and_training(name, options):
    """Logits and every parameter's gradient of a list of images of three sizes (two alike) equal
    those of the images run one by one (float64; in eval mode, where neither drop path nor
    BatchNorm depends on the batch), and a training step on a list runs (PerViT's BatchNorm needs
    ``min_images_per_size`` images of each size)."""
    model = posattn.create_model(name, num_classes=4, **options).double().eval()
    generator = torch.Generator().manual_seed(0)
    sizes = [(48, 80), (80, 32), (48, 80), (64, 64)]
    images = [torch.randn(3, *size, generator=generator, dtype=torch.float64) for size in sizes]
    weights = torch.randn(len(images), 4, generator=generator, dtype=torch.float64)
    names, params = zip(*[(name, param) for name, param in model.named_parameters() if param.requires_grad])
    logits = model(images)
    together = torch.autograd.grad((logits * weights).sum(), params, allow_unused=True)
    alone = torch.cat([model(image[None]) for image in images])
    expected = torch.autograd.grad((alone * weights).sum(), params, allow_unused=True)
    torch.testing.assert_close(logits, alone, rtol=0, atol=1e-10)
    for name, grad, want in zip(names, together, expected):
        # the absolute embedding is resampled to other grids in float32 (models/pos_embed.py)
        tolerance = dict(rtol=1e-6, atol=1e-9) if name == 'pos_embed' else dict(rtol=0, atol=1e-10)
        torch.testing.assert_close(grad, want, **tolerance, msg=name)
    with pytest.raises(TypeError, match='forward_features takes one batch'):
        model.forward_features(images)
    with pytest.raises(TypeError, match=r'forward_intermediates takes one batch \(B, C, H, W\): features of images '
                                        r'of different sizes do not stack. Give the list to the model itself'):
        model.forward_intermediates(images)
    images = images * getattr(model, 'min_images_per_size', 1)
    loss = torch.nn.functional.cross_entropy(model.train()(images), torch.arange(len(images)) % 4)
    loss.backward()
    assert torch.isfinite(loss) and all(param.grad is not None for param in params)
