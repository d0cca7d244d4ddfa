"""Saved weights record which Φp they belong to; loading them into another Φp, or one with settings
that compute otherwise, is refused with both named. Weights of two such Φp have the same keys and
shapes, so without the record a strict load passes and the outputs differ."""
import io
import warnings
from pathlib import Path

import pytest
import torch

import posattn
from posattn import Attention
from posattn.convert import saved_phi_records
from posattn.models.registry import load_checkpoint, load_weights
from posattn.models.vit import VisionTransformer
from posattn.phi.record import RECORD_KEY, mismatches

FIXTURES = Path(__file__).parent / 'fixtures'
GRID = (3, 4)

# (saved, loaded into): same keys and shapes, different computation
LOOKALIKES = {
    'alibi+rpb into rope+rpb': (dict(phi=['alibi', 'rpb']), dict(phi=['rope', 'rpb'])),
    'peg without its residual into peg': (dict(phi='peg', phi_cfg=dict(residual=False)), dict(phi='peg')),
    "rope 'xy' into rope 'yx'": (dict(phi='rope', phi_cfg=dict(axis_order='xy')), dict(phi='rope')),
    'alibi into rope': (dict(phi='alibi'), dict(phi='rope')),
}
PROBLEMS = {
    'alibi+rpb into rope+rpb': "those of a stack Φp with members=('alibi', 'rpb'), this one has members=('rope', 'rpb')",
    'peg without its residual into peg': 'those of a peg Φp with residual=False, this one has residual=True',
    "rope 'xy' into rope 'yx'": "those of a rope Φp with axis_order='xy', this one has axis_order='yx'",
    'alibi into rope': 'those of alibi(num_heads=2), this Φp is rope(',
}


def layer(seed=0, **options):
    torch.manual_seed(seed)
    return Attention(16, 2, num_prefix_tokens=1, **options).eval()


def vit(seed=0, **options):
    torch.manual_seed(seed)
    return VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=3,
                             **options).eval()


def round_trip(state_dict):
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_the_lookalikes_load_without_the_record_and_compute_otherwise():
    """Why the record is needed: without it each pair loads strictly ("All keys matched")."""
    x = torch.randn(2, 1 + GRID[0] * GRID[1], 16)
    for saved, loaded in LOOKALIKES.values():
        source, target = layer(**saved), layer(seed=1, **loaded)
        result = target.load_state_dict(dict(source.state_dict()))  # a plain copy carries no record
        assert not result.missing_keys and not result.unexpected_keys
        with torch.no_grad():
            assert (source(x, GRID) - target(x, GRID)).abs().max() > 1e-3


@pytest.mark.parametrize('name', posattn.list_phis())
def test_every_phi_records_its_name_and_settings_through_a_weights_only_round_trip(name):
    module = layer(phi=name)
    state_dict = round_trip(module.state_dict())
    record = state_dict._metadata['phi'][RECORD_KEY]
    assert record == {'name': name, 'settings': module.phi.settings()}
    assert saved_phi_records(state_dict) == {'phi': record}
    fresh = layer(seed=1, phi=name)
    fresh.load_state_dict(state_dict)  # the same Φp loads
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), module.state_dict().values()))


@pytest.mark.parametrize('case', LOOKALIKES)
def test_load_state_dict_refuses_another_phi_naming_both(case):
    saved, loaded = LOOKALIKES[case]
    state_dict = round_trip(layer(**saved).state_dict())
    with pytest.raises(RuntimeError) as error:
        layer(**loaded).load_state_dict(state_dict)
    message = str(error.value)
    assert PROBLEMS[case] in message and 'Build the model with the Φp the weights were saved with' in message
    with pytest.raises(RuntimeError, match='this one has|this Φp is'):  # strict=False loads keys, not another Φp
        layer(**loaded).load_state_dict(state_dict, strict=False)


@pytest.mark.parametrize('case', LOOKALIKES)
def test_checkpoint_files_are_refused_through_the_loader_of_create_model(case, tmp_path):
    saved, loaded = LOOKALIKES[case]
    path = tmp_path / 'weights.pth'
    torch.save({'model': vit(**saved).state_dict(), 'epoch': 3}, path)  # a training checkpoint's wrapping
    with pytest.raises(ValueError) as error:
        load_checkpoint(vit(**loaded), path, target='the ViT')
    message = str(error.value)
    assert "its Φp are others than the model's: build the model with the Φp (and options)" in message
    assert f'other Φp (1): blocks.0.attn.phi: the weights are {PROBLEMS[case]}' in message


def test_create_model_refuses_a_checkpoint_of_another_phi(tmp_path):
    path = tmp_path / 'rope_xy.pth'
    torch.save(posattn.create_model('vit_tiny', depth=1, img_size=32, phi='rope',
                                    phi_cfg=dict(axis_order='xy')).state_dict(), path)
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.phi: the weights are those of a rope Φp with "
                                         r"axis_order='xy', this one has axis_order='yx'"):
        posattn.create_model('vit_tiny', depth=1, img_size=32, phi='rope', checkpoint=path)
    assert posattn.create_model('vit_tiny', depth=1, img_size=32, phi='rope', phi_cfg=dict(axis_order='xy'),
                                checkpoint=path)


def test_a_partial_load_skips_and_reports_the_other_phi():
    source, target = vit(phi='peg', phi_cfg=dict(residual=False)), vit(seed=1, phi='peg')
    before = target.blocks[0].attn.phi.proj.weight.clone()
    skipped = load_weights(target, source.state_dict(), source='weights', target='the ViT', strict=False)
    assert skipped == ['other Φp: blocks.0.attn.phi: the weights are those of a peg Φp with residual=False, this '
                       'one has residual=True']
    assert torch.equal(target.blocks[0].attn.phi.proj.weight, before)  # not loaded into the other Φp
    assert torch.equal(target.blocks[0].attn.qkv.weight, source.blocks[0].attn.qkv.weight)  # the rest is


def test_plain_vit_weights_start_any_phi_but_weights_of_another_phi_do_not(tmp_path):
    """Weights recorded as ``none`` are a plain ViT's: any Φp may start from them (its own
    initialisation), and a plain model from any Φp's; weights of a Φp without parameters (alibi)
    do not start another."""
    path = tmp_path / 'none.pth'
    torch.save(vit(phi='none').state_dict(), path)
    load_checkpoint(vit(phi='rope'), path, target='the ViT')
    vit(phi='irpe').load_state_dict(torch.load(path, weights_only=True), strict=False)
    vit(phi='none').load_state_dict(vit(phi='alibi').state_dict())
    torch.save(vit(phi='alibi').state_dict(), path)
    with pytest.raises(ValueError, match=r'the weights are those of alibi\(num_heads=2\), this Φp is rope\('):
        load_checkpoint(vit(phi='rope'), path, target='the ViT')


def test_a_checkpoint_saved_before_phi_recorded_themselves_still_loads():
    """A ViT with ['alibi', 'rpb'] saved by posattn before Φp recorded themselves: no record, so it
    loads as it always did, into its own Φp and (unchecked) into another."""
    path = FIXTURES / 'vit_alibi_rpb_unrecorded.pt'
    state_dict = torch.load(path, weights_only=True)
    assert saved_phi_records(state_dict) == {}
    model = vit(seed=1, phi=['alibi', 'rpb'])
    model.load_state_dict(state_dict)
    load_checkpoint(vit(seed=2, phi=['alibi', 'rpb']), path, target='the ViT')
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        load_checkpoint(vit(seed=2, phi=['rope', 'rpb']), path, target='the ViT')
    assert torch.equal(model.blocks[0].attn.phi[1].relative_position_bias_table,
                       state_dict['blocks.0.attn.phi.1.relative_position_bias_table'])


def test_records_are_matched_by_path_under_a_wrapper():
    """Weights saved inside a wrapper (``module.``, an OpenMMLab backbone's ``backbone.model.``) or a
    model inside one: the record whose path ends with the other's; an ambiguous match is not checked."""
    rope = {'name': 'rope', 'settings': {'axis_order': 'xy'}}
    model = [('blocks.0.attn.phi', {'name': 'rope', 'settings': {'axis_order': 'yx'}})]
    for saved_path in ('blocks.0.attn.phi', 'module.blocks.0.attn.phi', 'backbone.model.blocks.0.attn.phi'):
        assert [m.path for m in mismatches(model, {saved_path: rope})] == ['blocks.0.attn.phi']
    wrapped = [('backbone.model.blocks.0.attn.phi', model[0][1])]
    assert [m.path for m in mismatches(wrapped, {'blocks.0.attn.phi': rope})] == ['backbone.model.blocks.0.attn.phi']
    assert mismatches(model, {'a.blocks.0.attn.phi': rope, 'b.blocks.0.attn.phi': rope}) == []
    assert mismatches(model, {'blocks.10.attn.phi': rope}) == []  # not a dotted suffix
    assert mismatches(model, {'blocks.0.attn.phi': {'name': 'rope', 'settings': {'pairing': 'halves'}}}) == []


def test_the_stack_is_reported_once_not_again_for_its_members():
    stack = [('phi', {'name': 'stack', 'settings': {'members': ['rope', 'rpb']}}),
             ('phi.0', {'name': 'rope', 'settings': {}}), ('phi.1', {'name': 'rpb', 'settings': {}})]
    saved = {'phi': {'name': 'stack', 'settings': {'members': ('alibi', 'rpb')}},
             'phi.0': {'name': 'alibi', 'settings': {}}, 'phi.1': {'name': 'rpb', 'settings': {}}}
    assert [m.path for m in mismatches(stack, saved)] == ['phi']
