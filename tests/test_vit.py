"""DeiT-style ViT: timm's model as the reference, PerViT Table 2 rows, any input size, errors."""
import pytest
import torch

import posattn
from posattn.models.vit import VisionTransformer

timm = pytest.importorskip('timm')

IRPE_K = dict(method='product', mode='ctx', on='k', shared_head=True, ratio=1.9)


def small_vit(**kwargs):
    cfg = dict(img_size=32, patch_size=8, num_classes=10, embed_dim=32, depth=3, num_heads=2)
    return VisionTransformer(**{**cfg, **kwargs})


@pytest.mark.parametrize('size', [(224, 224), (288, 320), (160, 96)])
def test_vit_tiny_equals_timm_at_any_input_size(size):
    """With timm's weights and phi='none' the model is timm's, including its position-embedding resize."""
    reference = timm.create_model('vit_tiny_patch16_224', pretrained=False, dynamic_img_size=True).eval()
    model = posattn.create_model('vit_tiny').eval()
    model.load_state_dict(reference.state_dict())
    x = torch.randn(2, 3, *size)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=1e-5)


@pytest.mark.parametrize('name,params', [('vit_tiny', 5_717_416), ('vit_small', 22_050_664)])
def test_deit_layouts(name, params):
    model = posattn.create_model(name)
    assert sum(p.numel() for p in model.parameters()) == params  # DeiT-Ti / DeiT-S
    assert len(model.blocks) == 12 and model.patch_embed.patch_size == 16


def test_vit_base_layout():
    model = posattn.create_model('vit_base', num_classes=0)
    assert sum(p.numel() for p in model.parameters()) == 86_567_656 - 769_000  # DeiT-B less its head
    assert model.blocks[0].attn.num_heads == 12 and model.embed_dim == 768


def test_table2_rows_are_one_argument_apart():
    """PerViT Table 2: DeiT-T, + CPVT (PEG after blocks 0-4, no learned embedding), + iRPE-K, + PPE."""
    rows = {
        'deit': posattn.create_model('vit_tiny'),
        'cpvt': posattn.create_model('vit_tiny', pos_embed=False, peg_after=(0, 1, 2, 3, 4)),
        'irpe': posattn.create_model('vit_tiny', phi='irpe', phi_cfg=IRPE_K),
        'ppe': posattn.create_model('vit_tiny', phi='peripheral'),
    }
    params = {name: sum(p.numel() for p in model.parameters()) for name, model in rows.items()}
    assert params['cpvt'] - params['deit'] == 5 * (9 * 192 + 192) - 197 * 192
    assert params['irpe'] - params['deit'] == 12 * 64 * 50  # one (1, 64, 50) table per layer
    irpe = rows['irpe'].blocks[3].attn.phi
    assert (irpe.num_prefix_tokens, irpe.num_buckets, irpe.method, irpe.mode, irpe.on) == (1, 50, 'product', 'ctx', 'k')
    first, last = rows['ppe'].blocks[0].attn.phi, rows['ppe'].blocks[11].attn.phi
    assert first.norm2_bias[0].item() == -5.0 and last.norm2_bias[0].item() == 4.0  # layer-dependent init
    x = torch.randn(1, 3, 48, 64)
    for model in rows.values():
        assert model(x).shape == (1, 1000)


def test_irpe_at_init_is_the_baseline():
    """iRPE tables start at zero, so DeiT-T + iRPE-K with DeiT-T's weights is DeiT-T."""
    baseline = small_vit().eval()
    model = small_vit(phi='irpe', phi_cfg=IRPE_K).eval()
    missing, unexpected = model.load_state_dict(baseline.state_dict(), strict=False)
    assert not unexpected and all('.attn.phi.' in key for key in missing)
    x = torch.randn(2, 3, 40, 24)
    with torch.no_grad():
        torch.testing.assert_close(model(x), baseline(x), rtol=0, atol=1e-6)


def test_peg_runs_after_the_named_blocks():
    model = small_vit(pos_embed=False, peg_after=(0,)).eval()
    plain = small_vit(pos_embed=False).eval()
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith('pegs.')})
    seen = []
    peg_tokens = model.pegs['0'].tokens
    model.pegs['0'].tokens = lambda x, grid: seen.append(grid) or peg_tokens(x, grid)
    x = torch.randn(2, 3, 32, 48)
    with torch.no_grad():
        assert not torch.allclose(model(x), plain(x))
        torch.nn.init.zeros_(model.pegs['0'].proj.weight)
        torch.nn.init.zeros_(model.pegs['0'].proj.bias)
        torch.testing.assert_close(model(x), plain(x))  # a zero conv leaves the residual only
    assert seen[0] == posattn.TokenGrid(4, 6, 1)


def test_gap_head_without_class_token_and_backward():
    model = small_vit(class_token=False, global_pool='avg', phi='peripheral')
    assert model.num_prefix_tokens == 0 and model.cls_token is None
    out = model(torch.randn(2, 3, 24, 40))
    out.sum().backward()
    assert out.shape == (2, 10) and model.blocks[0].attn.phi.proj2_weight.grad is not None


def test_gap_head_with_class_token_pools_the_grid():
    model = small_vit(global_pool='avg', num_classes=0).eval()
    with torch.no_grad():
        tokens = model.forward_features(torch.randn(2, 3, 32, 32))
        torch.testing.assert_close(model.forward_head(tokens), tokens[:, 1:].mean(1))


def test_stochastic_depth_and_dropout_only_in_training():
    model = small_vit(drop_path_rate=0.5, drop_rate=0.1, attn_drop_rate=0.1, qkv_bias=False)
    assert model.blocks[0].drop_path1.drop_prob == 0 and model.blocks[-1].drop_path1.drop_prob == 0.5
    assert model.blocks[0].attn.qkv.bias is None
    x = torch.randn(4, 3, 32, 32)
    assert not torch.allclose(model.train()(x), model(x))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), model(x))


def test_phi_blocks_give_the_phi_to_those_blocks_only():
    """ConViT's layout: the Φp in the first blocks, plain attention after; the plain blocks equal a
    model without the Φp given the same weights."""
    model = small_vit(phi='rpb', phi_blocks=range(2)).eval()
    assert [type(block.attn.phi).__name__ for block in model.blocks] == [
        'RelativePositionBias', 'RelativePositionBias', 'NoPosition']
    plain = small_vit(phi='none').eval()
    plain.load_state_dict(model.state_dict(), strict=False)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x))  # rpb's tables start at zero
        for block in model.blocks[:2]:
            block.attn.phi.relative_position_bias_table.normal_()
        assert not torch.allclose(model(x), plain(x))


def test_bad_arguments():
    with pytest.raises(ValueError, match="global_pool='token' classifies the class token: pass class_token=True"):
        small_vit(class_token=False)
    with pytest.raises(ValueError, match=r"global_pool must be 'token', 'avg' or '', got 'max'"):
        small_vit(global_pool='max')
    with pytest.raises(ValueError, match=r'peg_after \(0, 3\) names blocks outside 0..2'):
        small_vit(peg_after=(3, 0))
    with pytest.raises(ValueError, match=r'phi_blocks \(-1, 0\) names blocks outside 0..2'):
        small_vit(phi='alibi', phi_blocks=(0, -1))
    with pytest.raises(ValueError, match='input of 30x32 pixels does not split into 8-pixel patches'):
        small_vit()(torch.randn(1, 3, 30, 32))
    with pytest.raises(TypeError, match="embed_dim: set by the model name 'vit_tiny'"):
        posattn.create_model('vit_tiny', embed_dim=256)
    with pytest.raises(ValueError, match="unknown Φp 'rpe'"):
        small_vit(phi='rpe')


@pytest.mark.parametrize('name', ['vit_tiny', 'pervit_tiny'])
def test_device_and_dtype_at_construction(name, monkeypatch):
    """timm's ``device`` / ``dtype`` arguments: built on the meta device directly (nothing is moved
    there afterwards), or in another floating dtype."""
    with monkeypatch.context() as patched:
        patched.setattr(torch.nn.Module, 'to', lambda *args, **kwargs: pytest.fail('the model was moved'))
        model = posattn.create_model(name, phi='peripheral', device='meta')
    assert {p.device.type for p in model.parameters()} == {'meta'}
    half = posattn.create_model(name, dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in half.buffers() if b.is_floating_point()} <= {torch.bfloat16}
    posattn.register_timm_models()
    model = timm.create_model(f'posattn_{name}', device='meta', dtype=torch.float16)
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {('meta', torch.float16)}
