"""Loading weights into a swapped model: torch's strict load stays strict, so weights of the model
before the swap fail it for want of the Φp keys; posattn.load_original_weights loads exactly those
weights, every Φp keeping its initialisation, with one warning, and refuses any others."""
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
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', posattn.swap.AddedParametersWarning)
        return plain, posattn.swap_attention(small_deit(), phi=phi, **phi_cfg).eval()


def phi_state(model):
    """A copy of every Φp tensor of ``model``, by key: the keys with '.attn.phi.' that the plain model lacks."""
    return {name: tensor.clone() for name, tensor in model.state_dict().items() if '.attn.phi.' in name}


def load_recording(load, *args):
    """load(*args) -> (its result, the messages of the warnings it gave)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        result = load(*args)
    return result, [str(w.message) for w in caught]


def test_a_strict_load_of_plain_weights_into_a_swapped_model_fails_with_the_phi_keys():
    plain, swapped = swapped_pair()
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "blocks\.0\.attn\.phi\.proj1_weight", '):
        swapped.load_state_dict(plain.state_dict())
    with pytest.raises(RuntimeError, match='Missing key'):
        swapped.load_state_dict(plain.state_dict(), strict=True)
    result = swapped.load_state_dict(plain.state_dict(), strict=False)  # torch's lenient load, as torch has it
    assert sorted(result.missing_keys) == sorted(phi_state(swapped)) and result.unexpected_keys == []


def test_a_plain_deit_tiny_loads_into_its_swapped_copy_with_every_phi_fresh():
    plain = randomised(timm.create_model('deit_tiny_patch16_224', pretrained=False))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', posattn.swap.AddedParametersWarning)
        swapped = posattn.swap_attention(timm.create_model('deit_tiny_patch16_224', pretrained=False),
                                         phi='peripheral').eval()
    phis = phi_state(swapped)
    assert len(phis) == 84  # 12 layers x 7 peripheral parameters
    fresh, messages = load_recording(posattn.load_original_weights, swapped, plain.state_dict())
    assert fresh == list(phis)  # in the model's order
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
    fresh, messages = load_recording(posattn.load_original_weights, swapped, plain.state_dict())
    assert sorted(fresh) == sorted(phis) and len(messages) == 1 and f'{len(phis)} keys' in messages[0]
    assert all(torch.equal(swapped.state_dict()[name], value) for name, value in phis.items())
    if phi == 'irpe':  # zero tables at their initialisation: the swapped model is the plain one
        x = torch.randn(2, 3, 32, 32)
        with torch.no_grad():
            torch.testing.assert_close(swapped(x), plain(x))


def test_weights_saved_after_the_swap_load_strictly_and_are_refused_as_original_weights():
    _, swapped = swapped_pair()
    _, other = swapped_pair()
    with torch.no_grad():
        for param in other.parameters():
            param.add_(1.0)
    result, messages = load_recording(swapped.load_state_dict, other.state_dict())
    assert messages == [] and result.missing_keys == [] and result.unexpected_keys == []
    assert all(torch.equal(a, b) for a, b in zip(swapped.state_dict().values(), other.state_dict().values()))
    with pytest.raises(ValueError) as refusal:
        posattn.load_original_weights(swapped, other.state_dict())
    assert str(refusal.value) == (
        "timm.models.vision_transformer.VisionTransformer: these are not the weights of the model before its "
        "attention was swapped, which hold every key but the Φp's:\n"
        "  Φp keys given (14 of 14): blocks.0.attn.phi.proj1_weight, blocks.0.attn.phi.norm1_weight, "
        "blocks.0.attn.phi.norm1_bias, blocks.0.attn.phi.proj2_weight, blocks.0.attn.phi.norm2_weight, ... (9 more)\n"
        "  weights saved after the swap load with model.load_state_dict(weights)")


def test_plain_weights_load_into_a_swapped_model_inside_another_module():
    plain, swapped = swapped_pair()
    outer = nn.ModuleDict({'backbone': swapped, 'neck': nn.Linear(5, 3)})
    weights = {f'backbone.{name}': value for name, value in plain.state_dict().items()}
    weights.update({f'neck.{name}': value for name, value in outer.neck.state_dict().items()})
    fresh, messages = load_recording(posattn.load_original_weights, outer, weights)
    assert fresh == [f'backbone.{name}' for name in phi_state(swapped)]
    assert len(messages) == 1 and '(backbone.blocks.0.attn.phi ... backbone.blocks.1.attn.phi: 14 keys)' in messages[0]
    weights.pop('neck.bias')  # outside the swapped model, whose weights are still plain ones
    with pytest.raises(ValueError, match=r"\n  missing keys outside the Φp \(1\): neck\.bias$"):
        posattn.load_original_weights(outer, weights)


def test_a_copy_of_a_swapped_model_loads_plain_weights():
    plain, swapped = swapped_pair()
    fresh, messages = load_recording(posattn.load_original_weights, copy.deepcopy(swapped), plain.state_dict())
    assert len(fresh) == 14 and len(messages) == 1


def test_some_phi_keys_are_refused_naming_them():
    plain, swapped = swapped_pair()
    weights = dict(plain.state_dict(), **{'blocks.0.attn.phi.proj2_weight': swapped.blocks[0].attn.phi.proj2_weight})
    with pytest.raises(ValueError) as refusal:
        posattn.load_original_weights(swapped, weights)
    assert str(refusal.value).endswith("which hold every key but the Φp's:\n"
                                       "  Φp keys given (1 of 14): blocks.0.attn.phi.proj2_weight")


def test_another_phis_weights_are_refused_with_the_keys_that_differ():
    _, swapped = swapped_pair('peripheral')
    _, irpe = swapped_pair('irpe')
    with pytest.raises(RuntimeError, match=r"blocks\.0\.attn\.phi: the weights are those of irpe\(num_heads=2, head_dim=16, method='product'"):
        posattn.load_original_weights(swapped, irpe.state_dict())  # their records say whose they are
    with pytest.raises(ValueError) as refusal:
        posattn.load_original_weights(swapped, dict(irpe.state_dict()))  # without: their keys
    assert str(refusal.value).endswith(
        "which hold every key but the Φp's:\n"
        "  unexpected keys (2): blocks.0.attn.phi.rpe_k.lookup_table_weight, "
        "blocks.1.attn.phi.rpe_k.lookup_table_weight")
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "blocks\.0\.attn\.phi\.rpe_k'):
        swapped.load_state_dict(dict(irpe.state_dict()))


def test_a_missing_key_an_unexpected_key_and_a_wrong_shape_are_refused():
    plain, swapped = swapped_pair()
    weights = dict(plain.state_dict(), extra=torch.zeros(1))
    del weights['norm.weight']
    with pytest.raises(ValueError) as refusal, warnings.catch_warnings():
        warnings.simplefilter('error')  # and no warning that the Φp start fresh
        posattn.load_original_weights(swapped, weights)
    assert str(refusal.value).endswith("which hold every key but the Φp's:\n"
                                       "  missing keys outside the Φp (1): norm.weight\n"
                                       "  unexpected keys (1): extra")
    with pytest.raises(RuntimeError, match=r'size mismatch for head\.weight'):
        posattn.load_original_weights(swapped, dict(plain.state_dict(), **{'head.weight': torch.zeros(7, 32)}))


def test_a_conversion_adds_no_phi_keys_and_the_original_weights_load_strictly():
    """phi='own': the Φp holds Swin's own tables (renamed on load), so nothing starts fresh."""
    def small_swin():
        return timm.create_model('swin_tiny_patch4_window7_224', img_size=32, window_size=4, embed_dim=16,
                                 depths=(1, 1), num_heads=(1, 2), num_classes=5)
    plain = randomised(small_swin())
    swapped = posattn.swap_attention(small_swin(), phi='own').eval()
    fresh, messages = load_recording(posattn.load_original_weights, swapped, plain.state_dict())
    assert fresh == [] and messages == []
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(swapped(x), plain(x))
    swapped.load_state_dict(plain.state_dict())  # strictly, without the opt-in
