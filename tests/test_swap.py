"""swap_attention: timm / torchvision ViTs keep their outputs with 'none', their weights, and train;
the tests that take ``device`` run the models on ``pytest --device`` (conftest.py)."""
import copy

import pytest
import torch
from torch import nn

import posattn
from conftest import assert_swap_keeps_outputs, randomised
from posattn.swap import swap_attention

timm = pytest.importorskip('timm')


@pytest.mark.parametrize('name', ['vit_tiny_patch16_224', 'deit_tiny_distilled_patch16_224'])
def test_timm_none_equals_original(name, device):
    model = timm.create_model(name, pretrained=False)
    swapped = assert_swap_keeps_outputs(model, torch.randn(2, 3, 224, 224), device=device)
    layers = [block.attn for block in swapped.blocks]
    assert all(isinstance(layer, posattn.Attention) for layer in layers) and len(layers) == 12
    assert layers[0].num_prefix_tokens == model.num_prefix_tokens  # 2 for the distilled DeiT
    assert set(swapped.state_dict()) == set(model.state_dict())  # timm's names: weights still load


@pytest.mark.slow
def test_torchvision_none_equals_original(device):
    """torchvision's ViT-B/16 (86M parameters, about 3 s on the CPU)."""
    torchvision = pytest.importorskip('torchvision')
    model = torchvision.models.vit_b_16()
    swapped = assert_swap_keeps_outputs(model, torch.randn(1, 3, 224, 224), device=device)
    layer = swapped.encoder.layers[5].self_attention
    assert isinstance(layer, posattn.Attention) and layer.num_heads == 12
    original = model.encoder.layers[5].self_attention
    assert torch.equal(layer.qkv.weight, original.in_proj_weight)
    assert torch.equal(layer.proj.bias, original.out_proj.bias)


def small_timm_vit(**kwargs):
    return timm.create_model('vit_tiny_patch16_224', pretrained=False, img_size=32, patch_size=8,
                             embed_dim=32, depth=2, num_heads=2, num_classes=5, **kwargs)


def test_same_parameters_not_copies():
    model = small_timm_vit()
    qkv = model.blocks[1].attn.qkv.weight
    swap_attention(model, phi='irpe', method='product', mode='ctx', on='k')
    assert model.blocks[1].attn.qkv.weight is qkv
    assert model.blocks[1].attn.phi.num_prefix_tokens == 1 and model.blocks[1].attn.phi.num_heads == 2


def test_grid_follows_the_input_and_matches_posattn_vit(device):
    """A dynamic-size timm DeiT with peripheral attention is posattn's ViT with the same weights,
    on non-square inputs of two sizes: the Φp saw the right grid each time."""
    model = randomised(small_timm_vit(dynamic_img_size=True))
    swapped = swap_attention(model, phi='peripheral').to(device)
    reference = posattn.models.vit.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5, phi='peripheral').eval()
    reference.load_state_dict(swapped.state_dict())
    reference.to(device)
    for size in [(24, 40), (48, 16)]:
        x = torch.randn(2, 3, *size).to(device)
        with torch.no_grad():
            torch.testing.assert_close(swapped(x), reference(x), rtol=1e-5, atol=1e-5)
        assert swapped.blocks[0].attn.current_grid() == posattn.TokenGrid(size[0] // 8, size[1] // 8, 1)


def test_a_copy_follows_its_own_inputs():
    swapped = swap_attention(small_timm_vit(dynamic_img_size=True), phi='irpe').eval()
    clone = copy.deepcopy(swapped)
    with torch.no_grad():
        clone(torch.randn(1, 3, 24, 40))
    assert clone.blocks[1].attn.current_grid() == posattn.TokenGrid(3, 5, 1)
    assert clone.blocks[1].attn.grid_tracker is not swapped.blocks[1].attn.grid_tracker
    with pytest.raises(RuntimeError, match='run the whole model'):
        swapped.blocks[1].attn.current_grid()  # the original never ran


def test_fine_tuning_a_swapped_model_lowers_the_loss(device):
    """Overfitting one fixed batch: after 15 AdamW steps the loss is below half its start (0.27-0.32
    of it over four seeds of model and batch), a drop no rounding difference between machines can undo."""
    torch.manual_seed(0)
    model = swap_attention(small_timm_vit(), phi='peripheral').to(device).train()
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, 32, 32, generator=generator), torch.randint(0, 5, (8,), generator=generator)
    x, y = x.to(device), y.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(16):
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    assert model.blocks[0].attn.phi.proj2_weight.grad.abs().sum() > 0


def test_the_refusal_lists_what_the_registered_families_cover_and_names_a_registered_refusal(monkeypatch):
    from posattn.swap import spec
    monkeypatch.setattr(spec, '_FAMILIES', dict(spec._FAMILIES))
    monkeypatch.setattr(spec, '_REFUSED', dict(spec._REFUSED))

    class MyViT(nn.Sequential):
        pass

    class MyOtherViT(nn.Sequential):
        pass
    posattn.swap.register_family(covers=("mylib's MyViT",))(lambda model: None)
    with pytest.raises(TypeError, match=r"swap_attention knows .*mylib's MyViT; timm's VisionTransformer, .*; "
                                        r"torchvision's .*; transformers' vit, deit, .*"):
        swap_attention(MyViT(nn.Linear(2, 2)))
    posattn.swap.register_refusal(f'{MyOtherViT.__module__}.{MyOtherViT.__qualname__}', 'it attends across images')
    with pytest.raises(TypeError, match=r'cannot swap .*MyOtherViT: it attends across images'):
        swap_attention(nn.Sequential(MyOtherViT(nn.Linear(2, 2))))


def test_a_model_of_an_openmmlab_package_is_told_to_import_posattn_openmmlab():
    from posattn.swap.openmmlab_hint import _import_posattn_openmmlab
    assert _import_posattn_openmmlab(['torch.nn.modules.container.Sequential']) is None
    assert 'import posattn_openmmlab' in _import_posattn_openmmlab(['mmdet.models.detectors.mask_rcnn.MaskRCNN'])


def test_unsupported_models_name_what_was_found():
    with pytest.raises(TypeError, match=r"no supported attention in torch.nn.modules.container.Sequential \(it has "
                                        r"no module named as an attention\); swap_attention knows "
                                        r".*timm's VisionTransformer"):
        swap_attention(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(TypeError, match=r"Sequential \(its attention modules, MultiheadAttention, are of no family"):
        swap_attention(nn.Sequential(nn.MultiheadAttention(4, 2, kdim=2)))
    model = small_timm_vit()
    model.blocks[1].attn = nn.Identity()
    with pytest.raises(TypeError, match=r'block 1 \(timm.models.vision_transformer.Block\) holds '
                                        'torch.nn.modules.linear.Identity, not timm.layers.Attention'):
        swap_attention(model)
    model = small_timm_vit()
    model.blocks[0].attn = timm.layers.Attention(32, num_heads=2, attn_head_dim=8)
    with pytest.raises(TypeError, match=r'block 0 attends in 2 heads x 8 channels, not the model width 32'):
        swap_attention(model)
    with pytest.raises(ValueError, match=r'drops tokens while training \(patch_drop_rate > 0\)'):
        swap_attention(small_timm_vit(patch_drop_rate=0.5))
    model = small_timm_vit()
    with pytest.raises(TypeError, match="Φp 'irpe' got unknown option\\(s\\) 'methd' \\(did you mean 'method'\\?\\)"):
        swap_attention(model, phi='irpe', methd='euc')
    assert type(model.blocks[0].attn).__module__.startswith('timm') and not model.patch_embed.proj._forward_hooks
    swapped = swap_attention(model, phi='none')
    with pytest.raises(ValueError, match='is already swapped'):
        swap_attention(swapped)
    with pytest.raises(RuntimeError, match='run the whole model, not the blocks alone'):
        swapped.blocks(torch.randn(1, 17, 32))


@pytest.mark.parametrize('phi,cfg', [('rpb', dict(table_size=(4, 4))), ('decomposed_rpb', dict(table_size=(4, 4)))])
def test_a_phi_that_starts_at_zero_keeps_a_swapped_models_outputs(phi, cfg):
    """rpb's table and decomposed_rpb's embeddings start at zero: swapped into a timm ViT, they change
    nothing until they learn; each layer's Φp is told the class token."""
    model = small_timm_vit().eval()
    swapped = posattn.swap_attention(copy.deepcopy(model), phi=phi, **cfg)
    phis = [m.phi for m in swapped.modules() if isinstance(m, posattn.swap.SwappedAttention)]
    assert len(phis) == 2 and all(p.num_prefix_tokens == 1 for p in phis)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(swapped(x), model(x), rtol=0, atol=1e-5)
