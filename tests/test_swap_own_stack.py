"""swap_attention(model, phi=['own', X]): the model's own scheme converted into a Φp and a new one
added, exact in float64, outputs and gradients: against the same model swapped with X while its own
scheme is applied the model's way (timm's RoPE rotation, BEiT's and Swin's tables, ConViT's gated
attention), and on BEiT and Swin against timm's own model whose tables hold the ALiBi offsets
besides their own (what timm computes, nothing of posattn's)."""
import copy
import math

import pytest
import torch

from conftest import randomised
from test_alibi import released_slopes
from test_swap_own_rope import rope_tables_in_float64
from posattn import PhiStack
from posattn.phi.gpsa import GatedPositionalAttention
from posattn.phi.rope import RotaryPositionEmbedding
from posattn.phi.none import NoPosition
from posattn.phi.rpb import RelativePositionBias
from posattn.swap import SwappedAttention, swap_attention

timm = pytest.importorskip('timm')

SMALL = dict(pretrained=False, depth=2, num_classes=5)
MODELS = {  # name: (build, input size, the own Φp's class)
    'eva02': (lambda: timm.create_model('eva02_tiny_patch14_224', img_size=56, **SMALL), (56, 56),
              RotaryPositionEmbedding),
    'beit': (lambda: timm.create_model('beit_base_patch16_224', img_size=64, embed_dim=64, num_heads=2, **SMALL),
             (64, 64), RelativePositionBias),
    'swin': (lambda: timm.create_model('swin_tiny_patch4_window7_224', pretrained=False, embed_dim=32, depths=(2, 2),
                                       num_heads=(2, 4), window_size=4, img_size=64, num_classes=5), (64, 64),
             RelativePositionBias),
    'convit': (lambda: timm.create_model('convit_tiny', pretrained=False, depth=3, local_up_to_layer=2, img_size=48,
                                         num_classes=5), (48, 48), GatedPositionalAttention),
}


def drawn(name):
    """The model in float64, every weight drawn; the tables and queries large enough to matter."""
    model = randomised(MODELS[name][0]()).double()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if 'relative_position_bias_table' in param_name:
                param.mul_(40)
            if param_name.endswith('attn.qkv.weight'):
                param.mul_(4)
    return model


def assert_same_outputs_and_input_gradients(got_model, expected_model, size):
    """Both models on the same float64 images: outputs to 1e-10, the images' gradients (of the sum of
    squared outputs) to 1e-9; each model's parameters are left holding their gradients."""
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x_got, x_expected = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, expected = got_model(x_got), expected_model(x_expected)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)
    got.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(x_got.grad, x_expected.grad, rtol=0, atol=1e-9)


def layers(model):
    return [m for m in model.modules() if isinstance(m, SwappedAttention)]


def named_phi(layer):
    """The Φp swapped in by name: last in a stack that keeps the model's own scheme first."""
    return layer.phi[-1] if isinstance(layer.phi, PhiStack) else layer.phi


def same_new_phi(stacked, kept):
    """The new Φp of both models equal: drawn in the stacked one, copied into the other."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for stack_layer, kept_layer in zip(layers(stacked), layers(kept)):
            for got, expected in zip(stack_layer.phi[1].parameters(), named_phi(kept_layer).parameters()):
                got.copy_(torch.randn(got.shape, generator=generator, dtype=got.dtype))
                expected.copy_(got)


@pytest.mark.parametrize('name', list(MODELS))
@pytest.mark.parametrize('new', ['rpb', 'alibi', 'peripheral'])
def test_own_plus_a_new_phi_is_the_model_with_it_beside_its_own(name, new):
    original = drawn(name)
    options = dict(table_size=(4, 4)) if new == 'rpb' else {}
    stacked = swap_attention(copy.deepcopy(original), phi=['own', new],
                             phi_cfg=[None, options or None]).eval()
    kept = swap_attention(copy.deepcopy(original), phi=new, **options).eval()  # own scheme applied timm's way
    if name == 'eva02':
        rope_tables_in_float64(kept)  # timm forms its RoPE tables in float32 whatever the model's dtype
    same_new_phi(stacked, kept)
    for layer in layers(stacked):
        assert isinstance(layer.phi, PhiStack) and isinstance(layer.phi[0], (MODELS[name][2], NoPosition))
    assert_same_outputs_and_input_gradients(stacked, kept, MODELS[name][1])
    compared = 0
    for param_name, param in kept.named_parameters():
        counterpart = _counterpart(stacked, param_name)
        if param.grad is None:
            assert counterpart.grad is None, param_name
            continue
        torch.testing.assert_close(counterpart.grad, param.grad, rtol=0, atol=1e-9, msg=param_name)
        compared += 1
    assert compared == sum(p.requires_grad for p in stacked.parameters())


def _counterpart(stacked, name):
    """The stacked model's parameter for the kept model's ``name``: in the stacked model the new Φp sits
    at ``phi.1`` and the model's own scheme, converted, at ``phi.0``; in the kept model the own scheme
    is first in the stack where it holds parameters (ConViT's gated attention, ``phi.0``) and the
    tables stay the layer's."""
    parts = name.split('.')
    if 'phi' in parts:
        index = parts.index('phi')
        if not parts[index + 1].isdigit():  # the new Φp alone (a layer with no scheme of its own)
            parts[index + 1:index + 1] = ['1']
    elif parts[-1] == 'relative_position_bias_table':
        parts[-1:] = ['phi', '0', 'relative_position_bias_table']
    return stacked.get_parameter('.'.join(parts))


def test_the_original_weights_load_strictly_after_own_is_converted():
    original = drawn('beit')
    stacked = swap_attention(copy.deepcopy(original), phi=['own', 'alibi'])
    stacked.load_state_dict(original.state_dict())  # the tables are renamed onto phi.0; alibi has no state
    assert any(key.endswith('attn.phi.0.relative_position_bias_table') for key in stacked.state_dict())


@pytest.mark.parametrize('phi,phi_cfg,error,match', [
    (['own', 'own'], None, ValueError, 'more than once'),
    (['own', 'rpb'], [dict(table_size=(2, 2)), None], TypeError, 'takes no Φp options'),
])
def test_bad_lists_name_the_fix(phi, phi_cfg, error, match):
    with pytest.raises(error, match=match):
        swap_attention(drawn('beit'), phi=phi, phi_cfg=phi_cfg)


def test_list_options_are_given_as_a_list():
    with pytest.raises(TypeError, match=r'phi_cfg=\[\.\.\.\]'):
        swap_attention(drawn('beit'), phi=['own', 'rpb'], table_size=(2, 2))


def test_a_model_without_an_own_scheme_is_refused():
    model = timm.create_model('vit_tiny_patch16_224', pretrained=False, img_size=32, depth=1, num_classes=2)
    with pytest.raises(TypeError, match="phi='own' converts"):
        swap_attention(model, phi=['own', 'alibi'])


def alibi_in_the_tables(model):
    """timm's model with 2D ALiBi added to each relative table: row (dy, dx) of every head gets
    -m_h sqrt(dy^2 + dx^2) (ALiBi's released slopes), the class-token rows nothing."""
    for module in model.modules():
        table = getattr(module, 'relative_position_bias_table', None)
        if table is None or not isinstance(table, torch.nn.Parameter):
            continue
        height, width = module.window_size
        slopes = released_slopes(table.shape[1])
        with torch.no_grad():
            for row in range((2 * height - 1) * (2 * width - 1)):
                dy, dx = row // (2 * width - 1) - (height - 1), row % (2 * width - 1) - (width - 1)
                for head, slope in enumerate(slopes):
                    table[row, head] -= slope * math.hypot(dy, dx)
    return model


@pytest.mark.parametrize('name', ['beit', 'swin'])
def test_own_plus_alibi_is_timms_model_with_alibi_in_its_tables(name):
    original = drawn(name)
    stacked = swap_attention(copy.deepcopy(original), phi=['own', 'alibi']).eval()
    oracle = alibi_in_the_tables(copy.deepcopy(original)).eval()
    assert_same_outputs_and_input_gradients(stacked, oracle, MODELS[name][1])
    for param_name, param in oracle.named_parameters():
        counterpart = stacked.get_parameter(param_name.replace('relative_position_bias_table',
                                                               'phi.0.relative_position_bias_table'))
        torch.testing.assert_close(counterpart.grad, param.grad, rtol=0, atol=1e-9, msg=param_name)
