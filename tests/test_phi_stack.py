"""Several Φp in one layer (``phi=['rope', 'rpb']``): exact in float64 against the composition written
out by hand, with the members' terms from posattn.reference where it states them, outputs and
gradients; the list form through the registry, the models and a config; clear errors."""
import math

import pytest
import torch
import torch.nn.functional as F

import posattn
from posattn import Attention, PhiStack, TokenGrid
from posattn.reference import irpe_attention, irpe_bucket_ids, relative_position_bias, rope_rotate

GRID = TokenGrid(3, 4, 1)


def split_heads(x, layer):
    batch, tokens, _ = x.shape
    qkv = x @ layer.qkv.weight.t() + layer.qkv.bias
    return qkv.reshape(batch, tokens, 3, layer.num_heads, layer.head_dim).permute(2, 0, 3, 1, 4)


def attend_by_hand(x, layer, q, k, v, bias):
    attn = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(layer.head_dim) + bias, dim=-1)
    out = (attn @ v).transpose(1, 2).reshape(x.shape)
    return out @ layer.proj.weight.t() + layer.proj.bias


def randomised(layer, seed=0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.phi.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return layer


def gradients(output, tensors):
    return torch.autograd.grad(output.square().sum(), tensors)


def test_rope_then_rpb_matches_the_references():
    torch.manual_seed(0)
    layer = randomised(Attention(16, 2, phi=['rope', 'rpb'], phi_cfg=[None, dict(table_size=(3, 4))],
                                 num_prefix_tokens=1).double())
    rope, rpb = layer.phi
    x = torch.randn(2, GRID.num_tokens, 16, dtype=torch.float64)
    q, k, v = split_heads(x, layer)
    rotated_q, rotated_k = (rope_rotate(t, 3, 4, 1) for t in (q, k))
    bias = relative_position_bias(rpb.relative_position_bias_table.detach(), (3, 4), 3, 4, 1)
    expected = attend_by_hand(x, layer, rotated_q, rotated_k, v, bias)
    torch.testing.assert_close(layer(x, GRID), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize('names,configs', [
    (['rope', 'rpb'], [None, dict(table_size=(3, 4))]),
    (['rope', 'decomposed_rpb'], [None, dict(table_size=(3, 4))]),  # a bias read by the rotated queries
    (['alibi', 'rpb'], [None, dict(table_size=(2, 2))]),
])
def test_outputs_and_gradients_equal_the_hand_written_composition(names, configs):
    """q/k transforms first, then every bias from the final q, k, summed."""
    torch.manual_seed(1)
    layer = randomised(Attention(16, 2, phi=names, phi_cfg=configs, num_prefix_tokens=1).double())
    x = torch.randn(2, GRID.num_tokens, 16, dtype=torch.float64, requires_grad=True)
    q, k, v = split_heads(x, layer)
    for member in layer.phi:
        if member.transforms_queries_keys:
            q, k = member.queries_keys(q, k, GRID)
    bias = sum(member.logits_bias(q, k, GRID) for member in layer.phi if member.gives_logits_bias)
    by_hand = attend_by_hand(x, layer, q, k, v, bias)
    got = layer(x, GRID)
    torch.testing.assert_close(got, by_hand, rtol=0, atol=1e-12)
    tensors = [x, *layer.parameters()]
    for got_grad, expected_grad in zip(gradients(got, tensors), gradients(by_hand, tensors)):
        torch.testing.assert_close(got_grad, expected_grad, rtol=0, atol=1e-11)


def naive_peg(x, weight, bias, height, width, prefix):
    grid = x[:, prefix:].transpose(1, 2).reshape(x.shape[0], -1, height, width)
    out = F.conv2d(grid, weight, bias, padding=1, groups=grid.shape[1]) + grid
    return torch.cat([x[:, :prefix], out.flatten(2).transpose(1, 2)], 1)


def test_peg_then_irpe_matches_the_references():
    """CPVT's PEG mixes the tokens, then iRPE (contextual, on keys and values) attends over them."""
    torch.manual_seed(2)
    layer = randomised(Attention(16, 2, phi=['peg', 'irpe'], phi_cfg=[None, dict(on='kv')],
                                 num_prefix_tokens=1).double())
    peg, irpe = layer.phi
    x = torch.randn(2, GRID.num_tokens, 16, dtype=torch.float64, requires_grad=True)
    mixed = naive_peg(x, peg.proj.weight, peg.proj.bias, 3, 4, 1)
    tables = {target: [getattr(irpe, f'rpe_{target}')()] for target in irpe.on}
    ids = irpe_bucket_ids(3, 4, 1, irpe.method, irpe.ratio)
    expected = irpe_attention(mixed, layer.qkv.weight, layer.qkv.bias, layer.proj.weight, layer.proj.bias,
                              layer.num_heads, tables, ids, irpe.mode)
    got = layer(x, GRID)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    tensors = [x, *layer.parameters()]
    for got_grad, expected_grad in zip(gradients(got, tensors), gradients(expected, tensors)):
        torch.testing.assert_close(got_grad, expected_grad, rtol=0, atol=1e-11)


def test_mixtures_run_in_order_and_value_terms_add():
    """gpsa's mixture, then iRPE's value term, each on what the one before left."""
    torch.manual_seed(3)
    layer = randomised(Attention(16, 4, phi=['gpsa', 'irpe'], phi_cfg=[None, dict(on='v')],
                                 num_prefix_tokens=1).double())
    gpsa, irpe = layer.phi
    x = torch.randn(2, GRID.num_tokens, 16, dtype=torch.float64)
    q, k, v = split_heads(x, layer)
    attn = gpsa.mix_probabilities(torch.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1), GRID)
    out = (attn @ v + irpe.value_term(attn, GRID)).transpose(1, 2).reshape(x.shape)
    expected = out @ layer.proj.weight.t() + layer.proj.bias
    torch.testing.assert_close(layer(x, GRID), expected, rtol=0, atol=1e-12)
    position, gate = layer.phi.mixture_parts(GRID)  # what the analyses read: the mixing member's parts
    assert torch.equal(position, gpsa.position_attention(3, 4)) and torch.equal(gate, gpsa.gate)
    assert irpe.mixture_parts(GRID) is None


def test_the_mixture_parts_of_two_mixing_members_are_what_the_stack_mixes_in():
    """(1 - g) A + g P, with g and P folded from both gpsa members, is the stack's mixture of A."""
    torch.manual_seed(4)
    grid = TokenGrid(3, 4)
    layer = randomised(Attention(16, 4, phi=['gpsa', 'gpsa']).double())
    content = torch.randn(2, 4, grid.num_tokens, grid.num_tokens, dtype=torch.float64).softmax(-1)
    position, share = layer.phi.mixture_parts(grid)
    assert position.shape == (4, 12, 12) and share.shape == (4,)
    torch.testing.assert_close(position.sum(-1), torch.ones(4, 12, dtype=torch.float64), rtol=0, atol=1e-12)
    expected = torch.lerp(content, position[None], share[None, :, None, None])
    torch.testing.assert_close(layer.phi.mix_probabilities(content, grid), expected, rtol=0, atol=1e-12)
    first, second = layer.phi
    assert not torch.allclose(position, first.position_attention(3, 4))  # not the first member's alone
    torch.testing.assert_close(1 - share, (1 - first.gate) * (1 - second.gate), rtol=0, atol=1e-15)


def test_the_stack_declares_the_union_of_its_members():
    stack = posattn.phi.build_layer_phi(['peg', 'irpe'], [None, dict(on='kv')], dim=16, num_heads=2)
    assert isinstance(stack, PhiStack) and stack.hooks == {'tokens', 'logits_bias', 'value_term'}
    assert stack.bias_per_image and stack.needs_probabilities
    assert [type(member).__name__ for member in stack] == ['PositionEncodingGenerator', 'IRPE']
    assert not posattn.phi.build_layer_phi(['peg', 'rope'], None, dim=16, num_heads=2).gives_logits_bias
    with pytest.raises(ValueError, match='declares one'):
        Attention(16, 2, phi=['peg', 'rope'], content=False)


def test_members_keep_their_own_keys_and_caches():
    layer = Attention(16, 2, phi=['alibi', 'rpb'], phi_cfg=[None, dict(table_size=(3, 4))], num_prefix_tokens=1).eval()
    assert list(layer.phi.state_dict()) == ['1.relative_position_bias_table']
    x = torch.randn(1, GRID.num_tokens, 16)
    with torch.no_grad(), posattn.cache_positions(layer) as cache:
        first = layer(x, GRID)
        assert len(cache) == 2  # one bias per member
        torch.testing.assert_close(layer(x, GRID), first, rtol=0, atol=0)


def test_models_and_configs_take_the_list_form():
    model = posattn.create_model('vit_tiny', phi=['peg', 'irpe'], phi_cfg=[None, dict(on='k')], num_classes=4,
                                 img_size=32)
    assert isinstance(model.blocks[0].attn.phi, PhiStack)
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 4)
    assert any(key.startswith('blocks.0.attn.phi.1.rpe_k.') for key in model.state_dict())


@pytest.mark.parametrize('phi,phi_cfg,error,match', [
    (['rope'], None, ValueError, 'two or more'),
    (['rope', 'rpb'], dict(table_size=(3, 4)), ValueError, 'list of 2 option dicts'),
    (['rope', 'rpb'], [None], ValueError, 'list of 2 option dicts'),
    (['rope', 'rpb'], [None, 3], TypeError, 'dict of one Φp'),
    (['rope', ['rpb']], None, TypeError, 'list of names'),
    (['rope', 'nope'], None, ValueError, "unknown Φp 'nope'"),
])
def test_bad_lists_name_the_fix(phi, phi_cfg, error, match):
    with pytest.raises(error, match=match):
        Attention(16, 2, phi=phi, phi_cfg=phi_cfg)


def test_a_stack_of_built_modules_refuses_nesting_and_repeats():
    rope = posattn.build_phi('rope', head_dim=8, num_heads=2)
    alibi = posattn.build_phi('alibi', num_heads=2)
    with pytest.raises(TypeError, match='itself a stack'):
        PhiStack([rope, PhiStack([alibi, posattn.build_phi('none')])])
    with pytest.raises(ValueError, match='same module'):
        PhiStack([alibi, alibi])


def test_a_built_phi_or_member_for_other_sizes_is_refused_when_the_layer_is_built():
    """Refused when built, naming the member and both sizes, not at the first forward."""
    from posattn.phi import build_phi
    stack = PhiStack([build_phi('rope', head_dim=8, num_heads=4), build_phi('alibi', num_heads=2)])
    with pytest.raises(ValueError, match=r'member 1 of the Φp stack, alibi, is built for num_heads=2, but the layer '
                                         r'has num_heads=4: build it for the layer'):
        posattn.Attention(32, 4, phi=stack)
    with pytest.raises(ValueError, match=r'Φp peg is built for dim=16, but the layer has dim=32'):
        posattn.Attention(32, 4, phi=build_phi('peg', dim=16))
    with pytest.raises(ValueError, match=r'Φp irpe is built for num_heads=2, head_dim=4, but the layer has '
                                         r'num_heads=4, head_dim=8'):
        posattn.Attention(32, 4, phi=build_phi('irpe', num_heads=2, head_dim=4))
    fitting = PhiStack([build_phi('rope', head_dim=8, num_heads=4), build_phi('alibi', num_heads=4)])
    assert posattn.Attention(32, 4, phi=fitting).phi is fitting
