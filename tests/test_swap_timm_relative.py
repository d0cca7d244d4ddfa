"""swap_attention on timm's ViTs with their own relative positions: Eva (EVA-02's RoPE, the RoPE ViTs),
Beit (its relative position tables, per block or shared) and VisionTransformerRelPos (bias tables
and bias networks). 'none' keeps every output; every Φp trains; own_positions=False drops the
model's scheme (and leaves nothing trainable unused); weights and names stay timm's."""
import copy

import pytest
import torch

import posattn
from conftest import assert_swap_keeps_outputs, assert_trains_with_every_phi, randomised
from posattn.swap import SwappedAttention, swap_attention

timm = pytest.importorskip('timm')

SMALL = dict(pretrained=False, depth=2, num_classes=5)


def without_dropout(model):
    """timm's relative position networks drop 1/8 of their hidden units while training, whatever
    the model's rates: switched off here, so that train-mode outputs compare."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


MODELS = {
    'eva02': lambda **kw: timm.create_model('eva02_tiny_patch14_224', img_size=56, **SMALL, **kw),
    'rope_vit_registers': lambda **kw: timm.create_model('vit_medium_patch16_rope_reg1_gap_256', img_size=64,
                                                         embed_dim=64, num_heads=2, **SMALL, **kw),
    'beit': lambda **kw: timm.create_model('beit_base_patch16_224', img_size=64, embed_dim=64, num_heads=2,
                                           **SMALL, **kw),
    'beit_shared_bias': lambda **kw: timm.create_model('beit_base_patch16_224', img_size=64, embed_dim=64,
                                                       num_heads=2, use_rel_pos_bias=False,
                                                       use_shared_rel_pos_bias=True, **SMALL, **kw),
    'relpos_mlp': lambda **kw: without_dropout(timm.create_model(
        'vit_relpos_small_patch16_224', img_size=64, embed_dim=64, num_heads=2, **SMALL, **kw)),
    'relpos_shared_class_token': lambda **kw: without_dropout(timm.create_model(
        'vit_srelpos_small_patch16_224', img_size=64, embed_dim=64, num_heads=2, class_token=True,
        global_pool='', **SMALL, **kw)),  # every token's output: the last Φp acts on the grid tokens only
    'relpos_table': lambda **kw: timm.create_model('vit_relpos_small_patch16_224', img_size=64, embed_dim=64,
                                                   num_heads=2, rel_pos_type='bias', **SMALL, **kw),
}


def image(name, batch=2, size=None, dtype=torch.float32):
    size = size or ((56, 56) if name == 'eva02' else (64, 64))
    return torch.randn(batch, 3, *size, generator=torch.Generator().manual_seed(1), dtype=dtype)


@pytest.mark.parametrize('name', list(MODELS))
def test_none_equals_original(name):
    """In float64: the same sums in another order, to rounding."""
    model = MODELS[name]().double()
    swapped = assert_swap_keeps_outputs(model, image(name, dtype=torch.float64), atol=1e-10)
    assert all(isinstance(block.attn, SwappedAttention) for block in swapped.blocks)
    assert set(swapped.state_dict()) == set(model.state_dict())  # timm's names: timm's weights load


@pytest.mark.parametrize('name', list(MODELS))
def test_every_phi_trains(name):
    assert_trains_with_every_phi(lambda: randomised(MODELS[name]()), image(name))


def test_eva_with_dynamic_size_sees_each_grid():
    model = randomised(MODELS['eva02'](dynamic_img_size=True))
    swapped = assert_swap_keeps_outputs(model, image('eva02', size=(42, 70)))
    assert swapped.blocks[1].attn.current_grid() == posattn.TokenGrid(3, 5, 1)
    swap_attention(MODELS['eva02'](dynamic_img_size=True), phi='peripheral')(image('eva02', size=(70, 28)))


@pytest.mark.parametrize('name', ['eva02', 'beit', 'beit_shared_bias', 'relpos_mlp'])
def test_own_positions_dropped(name):
    """Without the model's own positions a swapped 'none' model is plain attention: its output changes,
    the absolute embedding is zero and frozen, the relative biases frozen, and every parameter left
    trainable gets a gradient (DistributedDataParallel finds no unused parameter)."""
    model = randomised(MODELS[name]())
    with torch.no_grad():  # relative biases as large as trained ones
        for param in (p for n, p in model.named_parameters() if 'rel_pos' in n or 'relative_position' in n):
            param.mul_(40)
    swapped = swap_attention(copy.deepcopy(model), phi='peripheral', own_positions=False).train()
    x = image(name)
    with torch.no_grad():
        kept = swap_attention(copy.deepcopy(model), phi='none')(x)
        dropped = swap_attention(copy.deepcopy(model), phi='none', own_positions=False)(x)
    assert (kept - dropped).abs().max() > 1e-3
    if getattr(model, 'pos_embed', None) is not None:
        assert not swapped.pos_embed.requires_grad and not swapped.pos_embed.any()
    swapped(x).square().mean().backward()
    unused = [n for n, p in swapped.named_parameters() if p.requires_grad and p.grad is None]
    assert not unused
    frozen = {n for n, p in swapped.named_parameters() if not p.requires_grad}
    assert any('rel_pos' in n or 'relative_position' in n or 'pos_embed' in n for n in frozen)


def test_eva_rope_is_what_positions_it():
    """EVA-02 without its absolute embedding tells positions apart through RoPE alone: with RoPE kept,
    mirroring the order of the patches changes the tokens; with it dropped, it only mirrors them."""
    model = randomised(MODELS['eva02'](use_abs_pos_emb=False))
    x = image('eva02', batch=1)  # 4 x 4 patches of 14 x 14 pixels
    flipped = x.unflatten(-1, (4, 14)).flip(-2).flatten(-2)
    for own_positions, equivariant in ((True, False), (False, True)):
        swapped = swap_attention(copy.deepcopy(model), phi='none', own_positions=own_positions)
        with torch.no_grad():
            tokens, tokens_flipped = swapped.forward_features(x)[:, 1:], swapped.forward_features(flipped)[:, 1:]
        mirrored = tokens_flipped.reshape(1, 4, 4, -1).flip(2).reshape(1, 16, -1)
        assert torch.allclose(tokens, mirrored, atol=1e-5) == equivariant


@pytest.mark.parametrize('name', ['eva02', 'beit', 'relpos_mlp'])
def test_checkpoints_round_trip_and_weights_stay(name):
    model = randomised(MODELS[name]())
    block = model.blocks[1].attn
    swapped = swap_attention(model, phi='irpe', method='product', mode='ctx', on='qkv')
    assert swapped.blocks[1].attn.proj is block.proj and swapped.blocks[1].attn.qkv is block.qkv
    randomised(swapped, seed=3)
    again = swap_attention(MODELS[name](), phi='irpe', method='product', mode='ctx', on='qkv').eval()
    again.load_state_dict(swapped.state_dict())
    x = image(name, batch=1)
    with torch.no_grad():
        torch.testing.assert_close(again(x), swapped(x), rtol=0, atol=0)


def test_beit_input_size_changes_after_the_swap():
    swapped = swap_attention(randomised(MODELS['beit']()), phi='peripheral')
    swapped.set_input_size(img_size=(48, 80))
    out = swapped(image('beit', size=(48, 80)))
    assert out.shape == (2, 5) and swapped.blocks[0].attn.current_grid() == posattn.TokenGrid(3, 5, 1)
    assert swapped.blocks[0].attn.relative_position_bias_table.shape[0] == 5 * 9 + 3


def test_eva_features_only():
    model = timm.create_model('eva02_tiny_patch14_224', features_only=True, out_indices=(0, 1), img_size=56,
                              pretrained=False, depth=2)
    assert_swap_keeps_outputs(model, image('eva02'), atol=1e-4)


def test_refusals_name_the_reason():
    with pytest.raises(ValueError, match='patch_drop_rate'):
        swap_attention(MODELS['eva02'](patch_drop_rate=0.5))
    gqa = timm.create_model('vit_medium_patch16_rope_reg1_gap_256', img_size=64, embed_dim=64, num_heads=4,
                            attn_type='rope', num_kv_heads=2, qkv_fused=False, **SMALL)
    with pytest.raises(TypeError, match='grouped-query attention'):
        swap_attention(gqa)
    with pytest.raises(TypeError, match='attn_head_dim'):
        swap_attention(MODELS['beit'](attn_head_dim=16))
