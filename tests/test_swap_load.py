"""Weights of a model before its attention was swapped load into the swapped model: every Φp keeps its
initialisation, with one warning; any other mismatch fails strict loading as it did."""
import copy
import warnings

import pytest
import torch
from torch import nn

import posattn
from conftest import randomised

timm = pytest.importorskip('timm')


def small_deit(**kwargs):
    return timm.create_model('deit_tiny_patch16_224', pretrained=False, img_size=32, patch_size=8, embed_dim=32,
                             depth=2, num_heads=2, num_classes=5, **kwargs)


def swapped_pair(phi='peripheral', **phi_cfg):
    """(a randomised plain DeiT, a DeiT of the same layout with its attention swapped to ``phi``)."""
    plain = randomised(small_deit())
    return plain, posattn.swap_attention(small_deit(), phi=phi, **phi_cfg).eval()


def phi_state(model):
    return {name: tensor.clone() for name, tensor in model.state_dict().items() if '.phi.' in name}


def load_recording(model, state_dict, **kwargs):
    """model.load_state_dict(state_dict) -> (its result, the messages of the warnings it gave)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        result = model.load_state_dict(state_dict, **kwargs)
    return result, [str(w.message) for w in caught]


def test_a_plain_deit_tiny_loads_strictly_into_its_swapped_copy():
    plain = randomised(timm.create_model('deit_tiny_patch16_224', pretrained=False))
    swapped = posattn.swap_attention(timm.create_model('deit_tiny_patch16_224', pretrained=False),
                                     phi='peripheral').eval()
    phis = phi_state(swapped)
    assert len(phis) == 84  # 12 layers x 7 peripheral parameters
    result, messages = load_recording(swapped, plain.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert messages == ['timm.models.vision_transformer.VisionTransformer: the loaded weights hold no Φp keys; the '
                        'Φp of its 12 swapped attention layers (blocks.0.attn.phi ... blocks.11.attn.phi: 84 keys) '
                        'keep their initialisation']
    loaded = swapped.state_dict()
    assert all(torch.equal(loaded[name], value) for name, value in plain.state_dict().items())
    assert all(torch.equal(loaded[name], value) for name, value in phis.items())


@pytest.mark.parametrize('phi,phi_cfg', [('peripheral', {}), ('irpe', dict(mode='bias', on='qk')), ('peg', {})])
def test_plain_weights_give_the_plain_model_with_each_phi_fresh(phi, phi_cfg):
    plain, swapped = swapped_pair(phi, **phi_cfg)
    phis = phi_state(swapped)
    _, messages = load_recording(swapped, plain.state_dict())
    assert len(messages) == 1 and f'{len(phis)} keys' in messages[0]
    assert all(torch.equal(swapped.state_dict()[name], value) for name, value in phis.items())
    if phi == 'irpe':  # zero tables at their initialisation: the swapped model is the plain one
        x = torch.randn(2, 3, 32, 32)
        with torch.no_grad():
            torch.testing.assert_close(swapped(x), plain(x))


def test_a_swapped_models_own_weights_load_without_a_warning():
    _, swapped = swapped_pair()
    other = posattn.swap_attention(small_deit(), phi='peripheral')
    with torch.no_grad():
        for param in other.parameters():
            param.add_(1.0)
    result, messages = load_recording(swapped, other.state_dict())
    assert messages == [] and result.missing_keys == []
    assert all(torch.equal(a, b) for a, b in zip(swapped.state_dict().values(), other.state_dict().values()))


def test_plain_weights_load_into_a_swapped_model_inside_another_module():
    plain, swapped = swapped_pair()
    outer = nn.ModuleDict({'backbone': swapped, 'neck': nn.Linear(5, 3)})
    weights = {f'backbone.{name}': value for name, value in plain.state_dict().items()}
    weights.update({f'neck.{name}': value for name, value in outer.neck.state_dict().items()})
    result, messages = load_recording(outer, weights)
    assert result.missing_keys == [] and len(messages) == 1 and '(backbone.blocks.0.attn.phi' in messages[0]
    weights.pop('neck.bias')  # outside the swapped model, whose weights are still plain ones
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "neck.bias"\. '), \
            pytest.warns(UserWarning, match='hold no Φp keys'):
        outer.load_state_dict(weights)


def test_a_copy_of_a_swapped_model_loads_plain_weights():
    plain, swapped = swapped_pair()
    result, messages = load_recording(copy.deepcopy(swapped), plain.state_dict())
    assert result.missing_keys == [] and len(messages) == 1


def test_some_phi_keys_fail_strict_loading_with_every_missing_key():
    plain, swapped = swapped_pair()
    weights = dict(plain.state_dict())
    weights.update({name: value for name, value in swapped.state_dict().items() if name.startswith('blocks.0.')})
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "blocks\.1\.attn\.phi\.'):
        swapped.load_state_dict(weights)
    weights = dict(plain.state_dict(), **{'blocks.0.attn.phi.proj2_weight': swapped.blocks[0].attn.phi.proj2_weight})
    result, messages = load_recording(swapped, weights, strict=False)
    assert messages == [] and len(result.missing_keys) == 13  # 14 Φp keys, one given


def test_another_phis_weights_are_not_plain_weights():
    _, swapped = swapped_pair('peripheral')
    _, irpe = swapped_pair('irpe')
    result, messages = load_recording(swapped, irpe.state_dict(), strict=False)
    assert messages == [] and len(result.missing_keys) == 14 and len(result.unexpected_keys) == 2
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "blocks\.0\.attn\.phi\.rpe_k'):
        swapped.load_state_dict(irpe.state_dict())


def test_other_missing_keys_unexpected_keys_and_wrong_shapes_still_fail():
    plain, swapped = swapped_pair()
    weights = dict(plain.state_dict())
    del weights['norm.weight']
    result, messages = load_recording(swapped, weights, strict=False)
    assert messages == [] and 'norm.weight' in result.missing_keys and len(result.missing_keys) == 15
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: .*"norm\.weight"'):
        swapped.load_state_dict(weights)
    weights = dict(plain.state_dict(), extra=torch.zeros(1))
    result, messages = load_recording(swapped, weights, strict=False)
    assert messages == [] and len(result.missing_keys) == 14 and result.unexpected_keys == ['extra']
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "extra"'):
        swapped.load_state_dict(weights)
    with pytest.raises(RuntimeError, match=r'size mismatch for head\.weight'), \
            pytest.warns(UserWarning, match='hold no Φp keys'):  # the shapes are checked apart from the keys
        swapped.load_state_dict(dict(plain.state_dict(), **{'head.weight': torch.zeros(7, 32)}))
