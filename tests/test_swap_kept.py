"""A swapped model's own relative scheme, kept beside a named Φp, is an ordinary Φp: the first
member(s) of each layer's PhiStack, which apply what the model or the layer computes from the
model's own parameters (still under the model's names) and is given with the call. The layer has no
second positional channel: ``attend`` takes no own_* argument. Weights saved with the named Φp as the
layer's whole Φp (``...attn.phi.<key>``) still load."""
import copy
import inspect

import pytest
import torch

from conftest import randomised
from posattn import Attention, PhiStack, TokenGrid
from posattn.phi.alibi import ALiBi2D
from posattn.phi.gpsa import GatedPositionalAttention
from posattn.phi.rpb import RelativePositionBias
from posattn.swap import SwappedAttention, swap_attention
from posattn.swap.given import GivenBias, GivenRotation
from posattn.swap.timm_sam import GivenDecomposedBias

timm = pytest.importorskip('timm')

SMALL = dict(pretrained=False, depth=2, num_classes=5)
MODELS = {  # name: (build, input size, the kept members' classes in a layer that has them)
    'swin': (lambda: timm.create_model('swin_tiny_patch4_window7_224', pretrained=False, embed_dim=32, depths=(2, 2),
                                       num_heads=(2, 4), window_size=4, img_size=64, num_classes=5), 64,
             [GivenBias]),
    'beit': (lambda: timm.create_model('beit_base_patch16_224', img_size=64, embed_dim=64, num_heads=2, **SMALL),
             64, [GivenBias]),
    'beit_shared_and_per_block': (lambda: timm.create_model(
        'beit_base_patch16_224', img_size=64, embed_dim=64, num_heads=2, use_shared_rel_pos_bias=True, **SMALL),
        64, [GivenBias, GivenBias]),
    'eva02': (lambda: timm.create_model('eva02_tiny_patch14_224', img_size=56, **SMALL), 56, [GivenRotation]),
    'sam': (lambda: timm.create_model('samvit_base_patch16', img_size=64, depth=2, embed_dim=64, num_heads=2,
                                      window_size=3, global_attn_indexes=(1,), neck_chans=32), 64,
            [GivenDecomposedBias]),
    'relpos': (lambda: timm.create_model('vit_relpos_small_patch16_224', img_size=64, embed_dim=64, num_heads=2,
                                         rel_pos_type='bias', **SMALL), 64, [GivenBias]),
    'convit': (lambda: timm.create_model('convit_tiny', pretrained=False, depth=3, local_up_to_layer=2, img_size=48,
                                         num_classes=5), 48, [GatedPositionalAttention]),
}


def layers(model):
    return [m for m in model.modules() if isinstance(m, SwappedAttention)]


def outputs(model, size):
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model.eval()(x)


def test_attend_has_no_second_positional_channel():
    """Every positional term is the Φp's: the layer's attend takes a non-positional mask only."""
    assert [name for name in inspect.signature(Attention.attend).parameters if name.startswith('own')] == []
    assert not {'rotation', 'own_bias', 'own_mixture'} & set(inspect.signature(SwappedAttention.attention_output)
                                                            .parameters)


@pytest.mark.parametrize('name', list(MODELS))
def test_the_kept_scheme_comes_first_and_the_models_names_stay(name):
    build, size, kept_classes = MODELS[name]
    model = randomised(build())
    original_keys = set(model.state_dict())
    swapped = swap_attention(copy.deepcopy(model), phi='alibi')
    with_scheme = [layer for layer in layers(swapped) if isinstance(layer.phi, PhiStack)]
    assert with_scheme, 'no layer kept its scheme'
    for layer in with_scheme:
        assert [type(member) for member in layer.phi.members] == kept_classes + [ALiBi2D]
    keys = set(swapped.state_dict())
    # the model's tables and frequencies keep timm's names; only ConViT's gates move, into the gpsa member
    moved = {key for key in original_keys if key.endswith(('.attn.pos_proj.weight', '.attn.pos_proj.bias',
                                                          '.attn.gating_param'))}
    assert original_keys - keys == moved and (name == 'convit') == bool(moved)
    assert all('.attn.phi.0.' in key for key in keys - original_keys)  # alibi holds nothing
    swapped.load_state_dict(swapped.state_dict())  # strict round trip


@pytest.mark.parametrize('name', ['swin', 'beit', 'eva02', 'convit'])
def test_weights_saved_with_the_named_phi_alone_still_load(name):
    """A checkpoint of the layout where the named Φp was the layer's whole Φp (``phi.<key>``) loads
    strictly into the stack (``phi.1.<key>``) and gives the same outputs."""
    build, size, _ = MODELS[name]
    swapped = swap_attention(randomised(build()), phi='rpb', table_size=(3, 3))
    with torch.no_grad():
        for param_name, param in swapped.named_parameters():
            if '.phi.' in param_name:
                param.normal_()
    saved = {key.replace('.attn.phi.1.', '.attn.phi.'): value for key, value in swapped.state_dict().items()}
    assert any('.attn.phi.relative_position_bias_table' in key for key in saved)
    torch.manual_seed(7)
    fresh = swap_attention(build(), phi='rpb', table_size=(3, 3))
    fresh.load_state_dict(saved)
    torch.testing.assert_close(outputs(fresh, size), outputs(swapped, size), rtol=0, atol=0)


def test_a_saved_list_of_phi_loads_shifted_past_the_kept_scheme():
    """Two named Φp saved at ``phi.0`` and ``phi.1`` load at ``phi.1`` and ``phi.2``, the last first."""
    build, size, _ = MODELS['swin']
    names, options = ['rpb', 'rpb'], [dict(table_size=(3, 3)), dict(table_size=(5, 5))]
    swapped = swap_attention(randomised(build()), phi=names, phi_cfg=options)
    with torch.no_grad():
        for param_name, param in swapped.named_parameters():
            if '.phi.' in param_name:
                param.normal_()
    saved = {key.replace('.attn.phi.2.', '.attn.phi.@.').replace('.attn.phi.1.', '.attn.phi.0.')
             .replace('.attn.phi.@.', '.attn.phi.1.'): value for key, value in swapped.state_dict().items()}
    fresh = swap_attention(build(), phi=names, phi_cfg=options)
    fresh.load_state_dict(saved)
    for got, expected in zip(layers(fresh), layers(swapped)):
        assert [type(m) for m in got.phi.members] == [GivenBias, RelativePositionBias, RelativePositionBias]
        torch.testing.assert_close(got.phi[2].relative_position_bias_table,
                                   expected.phi[2].relative_position_bias_table, rtol=0, atol=0)
    torch.testing.assert_close(outputs(fresh, size), outputs(swapped, size), rtol=0, atol=0)


def test_given_bias_adds_what_the_call_gives_in_float64():
    """Against the attention written out: softmax(q k^T / sqrt(d) + b) v, then the projection."""
    torch.manual_seed(0)
    layer = Attention(8, 2, phi=GivenBias('extra'), num_prefix_tokens=1).double()
    grid = TokenGrid(2, 3, 1)
    x = torch.randn(2, 7, 8, dtype=torch.float64)
    bias = torch.randn(2, 2, 7, 7, dtype=torch.float64)
    q, k, v = layer.qkv(x).reshape(2, 7, 3, 2, 4).permute(2, 0, 3, 1, 4)
    attn = (q @ k.transpose(-2, -1) / 2 + bias).softmax(-1)
    expected = layer.proj((attn @ v).transpose(1, 2).reshape(2, 7, 8))
    torch.testing.assert_close(layer(x, grid, extra=bias), expected, rtol=0, atol=1e-12)
    with pytest.raises(TypeError, match=r'extra='):
        layer(x, grid)
    with pytest.raises(ValueError, match=r'extra='):
        layer(x, grid, extra=None)


def test_the_kept_members_say_what_they_were_not_given():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match='rope='):
        GivenRotation().queries_keys(q, q, TokenGrid(2, 2))
    with pytest.raises(ValueError, match='rel_pos_h='):
        GivenDecomposedBias().logits_bias(q, q, TokenGrid(2, 2))
