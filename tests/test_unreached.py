"""A Φp that no gradient reaches is said once: in a model that classifies from its class token, the
last block's Φp gets a gradient only where it reaches the prefix-token queries, as each Φp declares
(``reaches_prefix_queries``); the declaration is checked here against one backward pass in float64."""
import warnings

import pytest
import timm
import torch

import posattn
from posattn.models.vit import VisionTransformer

# (Φp, options): every registered Φp, and the options that change what reaches a prefix query
CASES = [(name, {}) for name in posattn.list_phis()] + [
    ('rope', dict(frequencies='mixed')), ('rpb', dict(prefix_entries=False)), ('irpe', dict(mode='bias')),
    ('irpe', dict(on='q')), ('irpe', dict(on='qkv')), ('irpe', dict(on='v')),
    (['peripheral', 'rpb'], None), (['peripheral', 'gpsa'], None)]
IDS = [f'{name}{options or ""}' for name, options in CASES]


def randomised_vit(phi, phi_cfg, **options):
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=3,
                              phi=phi, phi_cfg=phi_cfg, **options).double()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.3)
    return model


@pytest.mark.parametrize('phi,options', CASES, ids=IDS)
def test_the_last_phi_gets_a_gradient_exactly_where_it_declares_it_reaches_the_class_token(phi, options):
    model = randomised_vit(phi, options)
    model(torch.randn(2, 3, 32, 32, dtype=torch.float64)).square().sum().backward()
    last = model.blocks[-1].attn.phi
    largest = max((param.grad.abs().max().item() for param in last.parameters()), default=None)
    if largest is None:
        return  # nothing to train
    if last.reaches_prefix_queries:
        assert largest > 1e-6
    else:
        assert largest < 1e-12  # zero, or a softmax's cancellation to rounding
    assert any(param.grad.abs().max() > 1e-6 for param in model.blocks[0].attn.phi.parameters())  # it learns there


@pytest.mark.parametrize('phi,options', CASES, ids=IDS)
def test_create_model_says_it_once_where_the_last_phi_cannot_learn(phi, options):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        model = posattn.create_model('vit_tiny', depth=2, img_size=32, phi=phi, phi_cfg=options)
    said = [str(w.message) for w in caught if issubclass(w.category, posattn.UnreachedPhiWarning)]
    last = model.blocks[-1].attn.phi
    expected = not last.reaches_prefix_queries and any(True for _ in last.parameters())
    assert len(said) == int(expected)
    if expected:
        assert said[0].startswith("blocks.1.attn.phi (") and "gets no gradient: the model classifies from its class " \
            "token (global_pool='token')" in said[0]
        assert "global_pool='avg'; or give that block no Φp, phi_blocks=range(depth - 1)" in said[0]


def test_pooling_the_tokens_or_leaving_the_last_block_out_says_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter('error', posattn.UnreachedPhiWarning)
        posattn.create_model('vit_tiny', depth=2, img_size=32, phi='peripheral', global_pool='avg')
        posattn.create_model('vit_tiny', depth=2, img_size=32, phi='peripheral', phi_blocks=range(1))
        posattn.create_model('pervit_tiny')


def test_a_swap_into_a_class_token_timm_vit_says_it_once():
    model = timm.create_model('vit_tiny_patch16_224', pretrained=False, depth=2, img_size=32)
    with pytest.warns(posattn.UnreachedPhiWarning, match=r"blocks\.1\.attn\.phi \(peripheral\) gets no gradient: its "
                                                         r"head classifies the class token alone.*Pool the grid tokens "
                                                         r"to train it \(timm\.create_model\(\.\.\., "
                                                         r"global_pool='avg'\)"):
        posattn.swap_attention(model, phi='peripheral')
    pooled = timm.create_model('vit_tiny_patch16_224', pretrained=False, depth=2, img_size=32, global_pool='avg')
    with warnings.catch_warnings():
        warnings.simplefilter('error', posattn.UnreachedPhiWarning)
        posattn.swap_attention(pooled, phi='peripheral')


def test_a_swap_into_torchvisions_vit_which_always_reads_its_class_token_says_it():
    import torchvision
    model = torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32,
                                                 mlp_dim=64)
    with pytest.warns(posattn.UnreachedPhiWarning, match=r"encoder\.layers\.encoder_layer_1\.self_attention\.phi "
                                                         r"\(gpsa\) gets no gradient: its head classifies the class "
                                                         r"token alone .*Freeze it"):
        posattn.swap_attention(model, phi='gpsa')
