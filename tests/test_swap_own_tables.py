"""swap_attention(model, phi='own') on timm's Swin and BEiT: their relative position tables become rpb
Φp (the same Parameters, BEiT's shared table read where the model keeps it), which give timm's outputs,
also after timm's set_input_size; timm's weights load strictly; a training step trains the tables
through the Φp; a model without such a table is refused."""
import copy
import warnings

import pytest
import torch

import posattn
from conftest import randomised
from posattn.phi.rpb import RelativePositionBias
from posattn.swap.given import GivenBias
from posattn.swap import SwappedAttention, swap_attention

timm = pytest.importorskip('timm')


def swin(window=4, img_size=64):
    return timm.create_model('swin_tiny_patch4_window7_224', pretrained=False, embed_dim=32, depths=(2, 2),
                             num_heads=(2, 4), window_size=window, img_size=img_size, drop_path_rate=0.0, num_classes=5)


def beit(**kwargs):
    return timm.create_model('beit_base_patch16_224', pretrained=False, img_size=64, embed_dim=64, num_heads=2,
                             depth=2, num_classes=5, **kwargs)


MODELS = {  # name: (build, input size)
    'swin': (swin, (64, 64)),
    'swin, 3 x 5 windows': (lambda: swin(window=(3, 5), img_size=(48, 60)), (48, 60)),
    'beit': (beit, (64, 64)),
    'beit, shared table': (lambda: beit(use_rel_pos_bias=False, use_shared_rel_pos_bias=True), (64, 64)),
}


TABLE_PHI_MODELS = [name for name in MODELS if name != 'beit, shared table']  # whose Φp hold a table


def drawn(name, seed=0):
    """The model in float64 with every parameter drawn, the tables (which timm's BEiT starts at zero)
    as large as trained ones."""
    model = randomised(MODELS[name][0](), seed).double()
    with torch.no_grad():
        for table in tables(model):
            table.mul_(40)
    return model


def tables(model):
    return [p for n, p in model.named_parameters() if 'relative_position_bias_table' in n]


def images(size, batch=2):
    return torch.randn(batch, 3, *size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def layers(model):
    return [m for m in model.modules() if isinstance(m, SwappedAttention)]


def assert_same_outputs(got_model, expected_model, x):
    with torch.no_grad():
        got, expected = got_model(x), expected_model(x)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize('name', list(MODELS))
def test_own_gives_timms_outputs(name):
    model = drawn(name)
    x = images(MODELS[name][1])
    swapped = swap_attention(copy.deepcopy(model), phi='own')
    kind = GivenBias if name == 'beit, shared table' else RelativePositionBias
    assert all(isinstance(layer.phi, kind) for layer in layers(swapped))
    assert_same_outputs(swapped, model, x)
    with torch.no_grad():  # the tables matter: without them the outputs differ
        dropped = swap_attention(copy.deepcopy(model), phi='none', own_positions=False)(x)
    assert (dropped - model(x)).abs().max() > 1e-3


@pytest.mark.parametrize('name', TABLE_PHI_MODELS)
def test_the_phi_bias_is_timms_bias_exactly(name):
    """rpb's rows and BEiT's class-token entries read timm's index: the same bias, bit for bit."""
    model = drawn(name)
    originals = [m for m in model.modules() if hasattr(m, 'relative_position_index')
                 and getattr(m, 'relative_position_bias_table', None) is not None]
    expected = [m._get_rel_pos_bias() if hasattr(m, '_get_rel_pos_bias') else m() for m in originals]
    prefix = 1 if name.startswith('beit') else 0
    windows = [tuple(m.window_size) for m in originals]
    swapped = swap_attention(model, phi='own')
    phis = [layer.phi for layer in layers(swapped)]
    for phi, bias, window in zip(phis, expected, windows):
        grid = posattn.TokenGrid(*window, prefix)
        assert torch.equal(phi.position_bias(grid).detach(), bias.reshape(1, -1, grid.num_tokens, grid.num_tokens))


@pytest.mark.parametrize('name', TABLE_PHI_MODELS)
def test_the_phi_holds_the_models_table_and_a_step_trains_it(name):
    model = drawn(name)
    before = tables(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # built before the swap
    swapped = swap_attention(model, phi='own').train()
    held = [layer.phi.learned_table()[0] for layer in layers(swapped)]
    assert {id(t) for t in held} == {id(t) for t in before}  # the very Parameters
    assert [id(p) for p in swapped.parameters()].count(id(before[0])) == 1  # seen once
    saved = [t.detach().clone() for t in before]
    swapped(images(MODELS[name][1])).square().mean().backward()
    optimizer.step()
    for table, old in zip(before, saved):
        assert table.grad is not None and (table - old).abs().max() > 0


@pytest.mark.parametrize('name', list(MODELS))
def test_timms_weights_load_strictly_and_give_timms_outputs(name):
    """Weights of another model of the same kind (another draw), saved before any swap: the tables'
    keys are renamed to the Φp's (per block), or are the model's own (BEiT's shared table)."""
    swapped = swap_attention(drawn(name, seed=0), phi='own')
    other = drawn(name, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # no Φp is left at its initialisation: no warning
        swapped.load_state_dict(other.state_dict())
    assert_same_outputs(swapped, other, images(MODELS[name][1]))
    keys = {k for k in swapped.state_dict() if 'relative_position_bias_table' in k}
    if name == 'beit, shared table':
        assert keys == {'rel_pos_bias.relative_position_bias_table'}
    else:
        assert keys and all(k.endswith('.attn.phi.relative_position_bias_table') for k in keys)
    again = swap_attention(drawn(name, seed=2), phi='own')
    again.load_state_dict(swapped.state_dict())  # a swapped checkpoint loads back
    assert_same_outputs(again, other, images(MODELS[name][1]))


def test_the_shared_table_stays_the_models_trained_and_resized_by_it():
    """BEiT's one shared table: every block's Φp adds the bias the model computes and gives it."""
    model = drawn('beit, shared table')
    table = model.rel_pos_bias.relative_position_bias_table
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    swapped = swap_attention(model, phi='own').train()
    assert [id(p) for p in swapped.parameters()].count(id(table)) == 1
    saved = table.detach().clone()
    swapped(images((64, 64))).square().mean().backward()
    optimizer.step()
    assert table.grad is not None and (table - saved).abs().max() > 0
    original = drawn('beit, shared table')
    resized = swap_attention(copy.deepcopy(original), phi='own')
    for m in (original, resized):
        m.set_input_size(img_size=(96, 80))
    assert_same_outputs(resized, original, images((96, 80)))


@pytest.mark.parametrize('name,size', [('swin', (96, 96)), ('swin, 3 x 5 windows', (64, 80)),
                                       ('beit', (96, 80))])
def test_timms_set_input_size_resizes_the_phis_table_as_timms(name, size):
    """timm resizes its tables to the new windows (or patch grid) by its own interpolation, which is
    not rpb's bicubic resampling: the converted tables are resized by timm's code all the same, so the
    swapped model stays timm's, with each Φp learned for the new window."""
    model = drawn(name)
    swapped = swap_attention(copy.deepcopy(model), phi='own')
    unresized = copy.deepcopy(layers(swapped)[0].phi)
    for m in (model, swapped):
        m.set_input_size(img_size=size)
    assert_same_outputs(swapped, model, images(size))
    windows = [tuple(m.window_size) for m in model.modules() if hasattr(m, 'relative_position_index')
               and getattr(m, 'window_size', None) is not None]
    phi = layers(swapped)[0].phi
    assert {layer.phi.learned_table()[1] for layer in layers(swapped)} == set(windows)
    assert all(phi_table.shape == table.shape for phi_table, table in
               zip([layer.phi.learned_table()[0] for layer in layers(swapped)], tables(model)))
    bicubic = unresized.offset_table(*phi.learned_table()[1]).detach()  # rpb's own resampling of the old table
    assert (bicubic - phi.offset_table(*phi.learned_table()[1]).detach()).abs().max() > 1e-3


def test_torchvision_swin_tables_become_rpb_with_the_outputs():
    torchvision = pytest.importorskip('torchvision')
    model = torchvision.models.SwinTransformer(patch_size=[4, 4], embed_dim=32, depths=[2, 2], num_heads=[2, 4],
                                               window_size=[4, 4], num_classes=5)
    model = randomised(model).double()
    with torch.no_grad():
        for table in tables(model):
            table.mul_(40)
    swapped = swap_attention(copy.deepcopy(model), phi='own')
    assert len(layers(swapped)) == 4
    assert all(isinstance(layer.phi, RelativePositionBias) for layer in layers(swapped))
    assert_same_outputs(swapped, model, images((40, 56)))  # padded windows
    swapped.load_state_dict(model.state_dict())


def test_a_copied_model_reads_its_own_shared_table():
    """The shared table is the model's, given to each block with the call: a copy reads its own."""
    swapped = swap_attention(drawn('beit, shared table'), phi='own')
    copied = copy.deepcopy(swapped)
    assert all(isinstance(layer.phi, GivenBias) and not list(layer.phi.parameters()) for layer in layers(copied))
    assert [name for name, _ in copied.named_parameters() if 'relative_position' in name] == [
        'rel_pos_bias.relative_position_bias_table']
    with torch.no_grad():
        copied.rel_pos_bias.relative_position_bias_table.zero_()
    x = images((64, 64))
    assert_same_outputs(swapped, swap_attention(drawn('beit, shared table'), phi='own'), x)
    with torch.no_grad():
        assert (copied(x) - swapped(x)).abs().max() > 1e-3


def test_without_the_models_positions_the_converted_tables_stay_trainable():
    """own_positions=False drops absolute embeddings only (Swin has none): the tables are the Φp's."""
    model = drawn('swin')
    swapped = swap_attention(copy.deepcopy(model), phi='own', own_positions=False)
    assert all(layer.phi.relative_position_bias_table.requires_grad for layer in layers(swapped))
    assert_same_outputs(swapped, model, images((64, 64)))


def test_a_model_without_an_own_table_is_refused():
    deit = timm.create_model('deit_tiny_patch16_224', pretrained=False, img_size=64, depth=2)
    with pytest.raises(TypeError, match="phi='own' converts a model's own relative positional scheme into a Φp; "
                                        'timm VisionTransformer has none that posattn converts'):
        swap_attention(deit, phi='own')
    with pytest.raises(TypeError, match='timm Beit has none that posattn converts'):
        swap_attention(beit(use_rel_pos_bias=False, use_abs_pos_emb=True), phi='own')
    both = beit(use_shared_rel_pos_bias=True)
    with pytest.raises(TypeError, match="block 0 adds its own table to the shared one .*: pick a Φp by name"):
        swap_attention(both, phi='own')
    assert not layers(both)  # left as it was


# --- rpb's conversion ---------------------------------------------------------------------------

def test_rpb_takes_a_table_of_its_layout_only():
    phi = RelativePositionBias(2, (3, 4), num_prefix_tokens=1)
    with pytest.raises(ValueError, match=r'rpb with 2 heads and 3 extra entries takes a table Parameter of shape '
                                         r'\(38, 2\) for a 3x4 grid, got Parameter of shape \(35, 2\)'):
        phi.set_table(torch.nn.Parameter(torch.zeros(35, 2)), (3, 4))
    with pytest.raises(ValueError, match=r'got Tensor of shape \(38, 2\)'):
        phi.set_table(torch.zeros(38, 2), (3, 4))
