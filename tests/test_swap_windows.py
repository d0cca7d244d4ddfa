"""swap_attention on Swin window attention (timm, torchvision, mmdet, mmseg, mmpretrain): 'none'
keeps every output (shifted blocks, padded and non-square maps, non-square windows); every Φp
trains; own_positions=False drops the relative position table and keeps the shift mask; the Φp
sees the window grid; weights stay the model's; refusals name the reason."""
import copy

import pytest
import torch
from torch import nn

import posattn
from conftest import assert_swap_keeps_outputs, assert_trains_with_every_phi, randomised
from posattn.phi.peripheral import peripheral_init
from posattn.swap import SwappedAttention, swap_attention
from posattn.swap.given import GivenBias
from posattn.swap.timm_swin import TimmWindowAttention
from posattn.swap.torchvision_swin import TorchvisionWindowAttention
from posattn.swap.window_tables import WindowTableAttention

timm = pytest.importorskip('timm')
tv_swin = pytest.importorskip('torchvision.models.swin_transformer')

SMALL = dict(embed_dim=32, depths=(2, 2), num_heads=(2, 4))  # two stages, the second block of each shifted


def timm_swin(window=4, img_size=64, **kwargs):
    return timm.create_model('swin_tiny_patch4_window7_224', pretrained=False, **SMALL, window_size=window,
                             img_size=img_size, drop_path_rate=0.0, num_classes=5, **kwargs)


def torchvision_swin(window=(4, 4), **kwargs):
    return tv_swin.SwinTransformer(patch_size=[4, 4], embed_dim=32, depths=[2, 2], num_heads=[2, 4],
                                   window_size=list(window), stochastic_depth_prob=0.0, num_classes=5, **kwargs)


def openmmlab():
    """mmdet's, mmseg's and mmpretrain's Swin classes, with the OpenMMLab families registered."""
    pytest.importorskip('posattn_openmmlab')
    from mmdet.models.backbones import SwinTransformer as DetSwin
    from mmpretrain.models.backbones import SwinTransformer as PretrainSwin
    from mmseg.models.backbones import SwinTransformer as SegSwin
    return DetSwin, SegSwin, PretrainSwin


def mmdet_swin(**kwargs):
    """In a container: the OpenMMLab backbones' train() returns None."""
    DetSwin = openmmlab()[0]
    return nn.Sequential(DetSwin(pretrain_img_size=56, embed_dims=32, depths=(2, 2), num_heads=(2, 4), window_size=4,
                                 strides=(4, 2), out_indices=(0, 1), drop_path_rate=0.0, **kwargs))


def mmseg_swin():
    SegSwin = openmmlab()[1]
    return nn.Sequential(SegSwin(pretrain_img_size=56, embed_dims=32, depths=(2, 2), num_heads=(2, 4), window_size=4,
                                 strides=(4, 2), out_indices=(0, 1), drop_path_rate=0.0))


def mmpretrain_swin(**kwargs):
    PretrainSwin = openmmlab()[2]
    return nn.Sequential(PretrainSwin(arch=dict(embed_dims=32, depths=[2, 2], num_heads=[2, 4]), img_size=56,
                                      window_size=4, drop_path_rate=0.0, out_indices=(0, 1), **kwargs))


def images(height, width):
    return torch.randn(2, 3, height, width, generator=torch.Generator().manual_seed(1))


def swapped_layers(model):
    return [m for m in model.modules() if isinstance(m, SwappedAttention)]


CASES = {  # name: (builder, input, the adapter, the window of the first stage)
    'timm, 16 x 16 map': (lambda: timm_swin(), images(64, 64), TimmWindowAttention, (4, 4)),
    'timm, 14 x 10 map, padded windows': (
        lambda: timm_swin(img_size=(56, 40)), images(56, 40), TimmWindowAttention, (4, 4)),
    'timm, 3 x 5 windows, padded in stage 2': (
        lambda: timm_swin(window=(3, 5), img_size=(48, 60)), images(48, 60), TimmWindowAttention, (3, 5)),
    'timm, dynamic size, another input': (
        lambda: timm_swin(dynamic_img_size=True), images(56, 40), TimmWindowAttention, (4, 4)),
    'timm, features_only': (lambda: timm_swin(features_only=True), images(64, 64), TimmWindowAttention, (4, 4)),
    'torchvision, 16 x 16 map': (lambda: torchvision_swin(), images(64, 64), TorchvisionWindowAttention, (4, 4)),
    # stage 2 is 4 x 8: the window covers its height, so torchvision shifts along the width only
    'torchvision, 7 x 15 map, shifted along one side in stage 2': (
        lambda: torchvision_swin(), images(30, 60), TorchvisionWindowAttention, (4, 4)),
    'torchvision, 3 x 5 windows, padded': (
        lambda: torchvision_swin(window=(3, 5)), images(44, 60), TorchvisionWindowAttention, (3, 5)),
    'mmdet, 14 x 10 map, padded windows': (lambda: mmdet_swin(), images(56, 40), WindowTableAttention, (4, 4)),
    'mmseg, 14 x 10 map, padded windows': (lambda: mmseg_swin(), images(56, 40), WindowTableAttention, (4, 4)),
    'mmpretrain, 14 x 10 map, padded windows': (
        lambda: mmpretrain_swin(pad_small_map=True), images(56, 40), WindowTableAttention, (4, 4)),
}


@pytest.mark.parametrize('name', CASES)
def test_none_keeps_the_outputs(name):
    build, x, adapter, window = CASES[name]
    swapped = assert_swap_keeps_outputs(build(), x)
    layers = swapped_layers(swapped)
    assert len(layers) == 4 and all(type(layer) is adapter for layer in layers)
    assert layers[0].current_grid() == posattn.TokenGrid(*window)


def test_torchvision_case_shifts_along_one_side_only():
    """The case above reaches torchvision's rule: no shift along a side one window covers."""
    model = torchvision_swin()
    seen = []
    model.features[3][1].attn.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[1:3]))
    with torch.no_grad():
        model(images(30, 60))
    assert seen == [(4, 8)] and model.features[3][1].attn.window_size == [4, 4]


@pytest.mark.parametrize('build', [lambda: timm_swin(img_size=(56, 40)), torchvision_swin, mmdet_swin],
                         ids=['timm', 'torchvision', 'mmdet'])
def test_every_phi_trains(build):
    assert_trains_with_every_phi(lambda: randomised(build()), images(56, 40))


OWN_POSITIONS = {  # name: (builder, input)
    'timm': (lambda: timm_swin(img_size=(56, 40)), images(56, 40)),
    'torchvision': (torchvision_swin, images(56, 40)),
    'mmdet, absolute position embedding': (lambda: mmdet_swin(use_abs_pos_embed=True), images(56, 56)),
}


def with_large_tables(model):
    """``model`` randomised, its relative position tables of order one, so that they matter."""
    model = randomised(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith('relative_position_bias_table'):
                param.mul_(20)
    return model


def without_own_positions(model):
    """``model`` with its relative position tables and absolute embedding zeroed."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(('relative_position_bias_table', 'absolute_pos_embed')):
                param.zero_()
    return model


def outputs(model, x):
    with torch.no_grad():
        out = model(x)
    return torch.cat([t.flatten() for t in (out if isinstance(out, (tuple, list)) else [out])])


@pytest.mark.parametrize('name', OWN_POSITIONS)
def test_without_own_positions_the_tables_are_dropped_and_the_shift_mask_kept(name):
    build, x = OWN_POSITIONS[name]
    model = with_large_tables(build())
    kept = swap_attention(copy.deepcopy(model), phi='none').eval()
    dropped = swap_attention(copy.deepcopy(model), phi='none', own_positions=False).eval()
    reference = without_own_positions(copy.deepcopy(model))
    assert (outputs(kept, x) - outputs(dropped, x)).abs().max() > 1e-3
    torch.testing.assert_close(outputs(dropped, x), outputs(reference, x), rtol=0, atol=1e-5)
    tables = [p for n, p in dropped.named_parameters() if n.endswith('relative_position_bias_table')]
    assert len(tables) == 4 and all(t.abs().sum() > 0 for t in tables)  # kept, only not added
    assert not any(t.requires_grad for t in tables)  # and frozen: no optimiser or DDP sees them unused


def test_the_shift_mask_matters_where_it_is_kept():
    """Without the shift mask the zero-table timm model of the test above gives other outputs, so
    that test's equality shows the swapped shifted blocks apply it."""
    model = without_own_positions(randomised(timm_swin(img_size=(56, 40))))
    unmasked = copy.deepcopy(model)
    for stage in unmasked.layers:
        stage.blocks[1].attn_mask = None
    assert (outputs(model, images(56, 40)) - outputs(unmasked, images(56, 40))).abs().max() > 1e-3


@pytest.mark.parametrize('build,x,window', [
    (lambda: timm_swin(window=(3, 5), img_size=(48, 60)), images(48, 60), (3, 5)),
    (lambda: torchvision_swin(window=(3, 5)), images(44, 60), (3, 5)),
    (mmdet_swin, images(56, 40), (4, 4)),
], ids=['timm', 'torchvision', 'mmdet'])
def test_the_phi_is_evaluated_once_on_the_window_grid(build, x, window):
    swapped = swap_attention(randomised(build()), phi='peripheral').eval()
    layers = swapped_layers(swapped)
    seen = []
    for layer in layers:
        layer.logits_probe.register_forward_hook(
            lambda module, args, out: seen.append((args[3], args[0].shape[0], args[2].shape[0])))
    with torch.no_grad():
        swapped(x)
    grids, all_windows, bias_batches = zip(*seen)
    assert grids == (posattn.TokenGrid(*window),) * 4
    assert all_windows == (2 * 12, 2 * 12, 2 * 4, 2 * 4)  # 2 images of 4 x 3, then 2 x 2 windows (padded)
    assert bias_batches == (1, 1, 1, 1)  # one bias for every window
    assert all(isinstance(layer.phi[0], GivenBias) for layer in layers)  # the table's bias, kept first
    sizes = [layer.phi[1].norm2_bias[0].item() for layer in layers]
    assert sizes == pytest.approx([peripheral_init(i, 4)[0] for i in range(4)])  # depth order over both stages


@pytest.mark.parametrize('build', [lambda: timm_swin(), torchvision_swin, mmdet_swin, mmpretrain_swin],
                         ids=['timm', 'torchvision', 'mmdet', 'mmpretrain'])
def test_weights_stay_the_models_and_a_swapped_checkpoint_loads_back(build):
    model = randomised(build())
    keys = set(model.state_dict())
    parameters = dict(model.named_parameters())
    swapped = swap_attention(model, phi='peripheral')
    assert {k for k in swapped.state_dict() if '.phi.' not in k} == keys
    assert all(parameters[name] is param for name, param in swapped.named_parameters() if name in parameters)
    torch.manual_seed(1)
    fresh = swap_attention(build(), phi='peripheral').eval()
    fresh.load_state_dict(swapped.state_dict())
    x = images(64, 64)
    torch.testing.assert_close(outputs(fresh, x), outputs(swapped.eval(), x), rtol=0, atol=0)


def test_timm_set_input_size_resizes_a_swapped_model_as_timm_does():
    model = randomised(timm_swin())
    swapped = swap_attention(copy.deepcopy(model), phi='none')
    for m in (model, swapped):
        m.set_input_size(img_size=(96, 96))  # windows scale with the map: 4 -> 6
    x = images(96, 96)
    torch.testing.assert_close(outputs(swapped, x), outputs(model, x), rtol=0, atol=1e-5)
    assert swapped.layers[1].blocks[0].attn.current_grid() == posattn.TokenGrid(6, 6)


def test_a_shift_mask_for_another_number_of_windows_is_an_error():
    layer = swapped_layers(swap_attention(timm_swin(), phi='none'))[1]
    with pytest.raises(ValueError, match='got 6 windows for a shift mask of 4 windows per image'):
        layer(torch.randn(6, 16, 32), mask=torch.zeros(4, 16, 16))


def test_refusals_name_the_reason():
    small_v2 = tv_swin.SwinTransformer(patch_size=[4, 4], embed_dim=32, depths=[2], num_heads=[2], window_size=[4, 4],
                                       block=tv_swin.SwinTransformerBlockV2, downsample_layer=tv_swin.PatchMergingV2)
    with pytest.raises(TypeError, match=r"ShiftedWindowAttentionV2\): Swin V2's cosine attention"):
        swap_attention(small_v2)
    model = torchvision_swin()
    model.features[1][0].attn = nn.Identity()
    with pytest.raises(TypeError, match=r"Swin block 0 holds torch.nn.modules.linear.Identity, not torchvision's"):
        swap_attention(model)
    with pytest.raises(TypeError, match=r"Swin block 0 attends in 2 heads x 8 channels, not the block width 32"):
        swap_attention(timm_swin(head_dim=8))
    v2 = timm.create_model('swinv2_tiny_window8_256', pretrained=False, **SMALL, img_size=64, window_size=4)
    with pytest.raises(TypeError, match=r"cannot swap timm.models.swin_transformer_v2.SwinTransformerV2: Swin V2's"):
        swap_attention(v2)
    model = timm_swin()
    model.layers[1].blocks[1].attn = nn.Identity()
    with pytest.raises(TypeError, match=r"Swin block 3 holds torch.nn.modules.linear.Identity, not timm's"):
        swap_attention(model)
    assert type(model.layers[0].blocks[0].attn).__module__.startswith('timm')  # left as it was


def test_openmmlab_refusals_name_the_reason():
    with pytest.raises(ValueError, match=r'block 0 of mmdet.models.backbones.swin.SwinTransformer: it was built with '
                                         r'qk_scale=0.5, not the head_dim \*\* -0.5 = 0.25'):
        swap_attention(mmdet_swin(qk_scale=0.5))
    model = mmpretrain_swin()
    model[0].stages[1].blocks[0].attn.w_msa = nn.Identity()
    with pytest.raises(TypeError, match=r'block 2 of .*: it is torch.nn.modules.linear.Identity, not '
                                        r'mmpretrain.models.utils.attention.WindowMSA'):
        swap_attention(model)
    from mmpretrain.models.backbones import SwinTransformerV2
    v2 = SwinTransformerV2(arch=dict(embed_dims=32, depths=[2, 2], num_heads=[2, 4], extra_norm_every_n_blocks=0),
                           img_size=64, window_size=4, out_indices=(1,))
    with pytest.raises(TypeError, match=r"cannot swap mmpretrain.models.backbones.swin_transformer_v2."
                                        r"SwinTransformerV2: Swin V2's cosine attention"):
        swap_attention(nn.Sequential(v2))
