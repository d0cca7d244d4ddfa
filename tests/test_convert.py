"""Release checkpoints: the converter, create_model(checkpoint=...), and parity with the release.

Tiny is checked against the fixture the release computed (its trimmed copy in tests/fixtures in
every clone, the full file where ../shared is present); Small and Medium against
``release_pervit.ReleasePerViT`` (float64), which is first checked against that same fixture.
"""
import argparse
import importlib.util
import re
from pathlib import Path

import pytest
import torch

import posattn
from posattn.convert import is_pervit_release, pervit_from_release, to_posattn_layout, unwrap_state_dict

from conftest import FIXTURES, load_fixture
from release_fixtures import PERVIT, TRIMS, load_trimmed, pervit_fixture
from release_pervit import LAYOUTS, ReleasePerViT, release_spec
from release_weights import release_input, release_state_dict

PHI_ATOL, BLOCK_RTOL, LOGITS_ATOL = 1e-4, 1e-5, 1e-4  # the fixture README's parity bounds


@pytest.fixture(scope='module', params=['trimmed', 'full'])
def fixture(request):
    return pervit_fixture(request.param)


def release_weights(size, seed):
    return release_state_dict(release_spec(size), seed)


def posattn_outputs(model, images):
    """Logits, every block's output as (B, HW, C) and every layer's Φp, in eval mode."""
    model.eval()
    with torch.no_grad():
        logits = model(images)
        maps = model.forward_intermediates(images, intermediates_only=True)
        height, width = maps[0].shape[-2:]
        return {'logits': logits,
                'block_out': {i: m.flatten(2).transpose(1, 2) for i, m in enumerate(maps)},
                'phi_p': {i: b.attn.phi.position_attention(height, width, model.distance_embedding)
                          for i, b in enumerate(model.blocks)}}


def at_tokens(outputs, tokens):
    """What a fixture keeps of ``outputs``: Φp's query rows and the block outputs at ``tokens``."""
    return {'logits': outputs['logits'],
            'phi_p': {i: phi.reshape(-1, *phi.shape[-2:])[:, tokens] for i, phi in outputs['phi_p'].items()},
            'block_out': {i: out[:, tokens] for i, out in outputs['block_out'].items()}}


def assert_parity(outputs, expected):
    for i, phi in expected['phi_p'].items():
        torch.testing.assert_close(outputs['phi_p'][i], phi.reshape(outputs['phi_p'][i].shape).float(),
                                   rtol=0, atol=PHI_ATOL, msg=f'Φp of layer {i}')
    for i, out in expected['block_out'].items():
        scale = out.abs().max().item()
        torch.testing.assert_close(outputs['block_out'][i], out.float(), rtol=0, atol=BLOCK_RTOL * scale,
                                   msg=f'output of block {i}')
    torch.testing.assert_close(outputs['logits'], expected['logits'].float(), rtol=0, atol=LOGITS_ATOL)


def test_release_spec_generator_reproduces_the_fixture_spec():
    spec = load_trimmed(PERVIT[1])['spec']
    assert release_spec('tiny') == [(name, tuple(shape)) for name, shape in spec]
    counts = {size: sum(p.numel() for p in ReleasePerViT(size).parameters()) for size in LAYOUTS}
    assert counts == {'tiny': 7_591_000, 'small': 21_317_672, 'medium': 43_723_936}


def test_trimmed_fixtures_are_slices_of_the_full_ones():
    """Each file of tests/fixtures equals ``release_fixtures.trim_*`` of its full file, exactly."""
    def assert_same(trimmed, expected, where):
        if isinstance(expected, dict):
            assert trimmed.keys() == expected.keys(), where
            for key in expected:
                assert_same(trimmed[key], expected[key], f'{where}[{key!r}]')
        elif isinstance(expected, torch.Tensor):
            assert trimmed.dtype == expected.dtype and torch.equal(trimmed, expected), where
        else:
            assert trimmed == expected, where
    for (full_name, trimmed_name), trim in TRIMS.items():
        assert_same(load_trimmed(trimmed_name), trim(load_fixture(full_name)), trimmed_name)


def test_weights_recipe_is_the_fixtures_own():
    """tests/release_weights.py rebuilds the very tensors of the recipe shipped with the full fixtures."""
    path = FIXTURES / 'weights_recipe.py'
    if not path.exists():
        pytest.skip(f'{path} is absent: the full reference fixtures live in ../shared beside the checkout')
    spec = importlib.util.spec_from_file_location('shared_weights_recipe', path)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    for size, seed in [('tiny', 7), ('small', 11)]:
        expected, got = recipe.release_state_dict(release_spec(size), seed), release_weights(size, seed)
        assert list(got) == list(expected)
        for key, value in expected.items():
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    assert torch.equal(release_input(7), recipe.release_input(7))
    assert torch.equal(release_input(3, batch=1, size=64), recipe.release_input(3, batch=1, size=64))


def test_release_reference_reproduces_the_fixture(fixture):
    """The float64 re-implementation used for Small and Medium is validated here, on Tiny."""
    reference = ReleasePerViT('tiny').double().eval()
    reference.load_state_dict(fixture['weights'], strict=True)
    out = at_tokens(reference(fixture['input'].double()), fixture['tokens'])
    for i in range(12):
        assert (out['phi_p'][i] - fixture['phi_p'][i]).abs().max() < 2e-5  # fixture: 1.5e-5 off float64
        block = fixture['block_out'][i]
        assert (out['block_out'][i] - block).abs().max() < 2e-6 * block.abs().max()
    assert (out['logits'] - fixture['logits']).abs().max() < 2e-6


def test_tiny_matches_release_fixture(fixture):
    model = posattn.create_model('pervit_tiny')
    model.load_state_dict(pervit_from_release(fixture['weights']), strict=True)
    expected = {k: fixture[k] for k in ('logits', 'block_out', 'phi_p')}
    assert_parity(at_tokens(posattn_outputs(model, fixture['input']), fixture['tokens']), expected)


@pytest.mark.parametrize('size,seed,image_size', [
    ('tiny', 3, (160, 224)),
    ('small', 11, (224, 224)),
    pytest.param('medium', 12, (224, 224), marks=pytest.mark.slow),
])
def test_matches_release_reference(size, seed, image_size):
    weights = release_weights(size, seed)
    reference = ReleasePerViT(size).double().eval()
    reference.load_state_dict(weights, strict=True)
    images = torch.randn(2, 3, *image_size, generator=torch.Generator().manual_seed(seed))
    expected = reference(images.double())
    model = posattn.create_model(f'pervit_{size}')
    model.load_state_dict(pervit_from_release(weights), strict=True)
    assert_parity(posattn_outputs(model, images), expected)


@pytest.mark.parametrize('size', sorted(LAYOUTS))
def test_converter_renames_every_tensor_one_to_one(size):
    """Every tensor of the release but its 25 cancelled biases (rpe_proj's, conv1's and conv2's)."""
    weights = release_weights(size, seed=1)
    converted = pervit_from_release({'model': weights, 'epoch': 299})
    expected = posattn.create_model(f'pervit_{size}').state_dict()
    cancelled = [k for k in weights if k == 'rpe_proj.bias' or k.endswith(('activation.conv1.bias', 'activation.conv2.bias'))]
    assert list(converted) != list(weights) and len(converted) == len(weights) - 25 == len(expected)
    assert len(cancelled) == 25
    assert {k: v.shape for k, v in converted.items()} == {k: v.shape for k, v in expected.items()}
    kept = {id(v) for k, v in weights.items() if k not in cancelled}
    assert {id(v) for v in converted.values()} == kept  # no copies
    assert pervit_from_release(weights).keys() == converted.keys()


def test_converter_refuses_other_layouts():
    state_dict = posattn.create_model('pervit_tiny').state_dict()
    assert not is_pervit_release(state_dict)
    with pytest.raises(ValueError, match="not a PerViT release checkpoint: it has no 'rpe_proj.weight'"):
        pervit_from_release(state_dict)
    with pytest.raises(TypeError, match='a checkpoint is a state_dict or a dict with a "model" state_dict'):
        pervit_from_release([('rpe_proj.weight', torch.zeros(16, 1))])
    assert to_posattn_layout({'model': state_dict})[1] == 'posattn'


def test_dead_release_parameters_are_dropped_and_change_nothing():
    """The release's biases that an instance norm removes are dropped at conversion, and so are those of
    checkpoints posattn saved while it still had them: the model loads strictly, any of their values
    gives the same outputs (the release's computation with them: test_peripheral.py)."""
    weights = release_weights('tiny', seed=2)
    model = posattn.create_model('pervit_tiny').eval()
    model.load_state_dict(pervit_from_release(weights))
    old_posattn = {**model.state_dict(), 'distance_embedding.bias': torch.ones(16),
                   **{f'blocks.{i}.attn.phi.proj{j}_bias': torch.ones(16 if j == 1 else 4) for i in range(12) for j in (1, 2)}}
    converted, layout = to_posattn_layout(old_posattn)
    assert layout == 'posattn' and list(converted) == list(model.state_dict())
    images = torch.randn(1, 3, 64, 80)
    with torch.no_grad():
        before = model(images)
        shifted = {k: v + 3 if k == 'rpe_proj.bias' or k.endswith(('activation.conv1.bias', 'activation.conv2.bias'))
                   else v for k, v in weights.items()}
        model.load_state_dict(pervit_from_release(shifted))
        torch.testing.assert_close(model(images), before, rtol=0, atol=1e-5)


def test_create_model_loads_release_and_posattn_checkpoints(tmp_path):
    weights = release_weights('tiny', seed=4)
    release_path = tmp_path / 'release.pth'
    torch.save({'model': weights, 'epoch': 299, 'args': argparse.Namespace(model='pervit_tiny')}, release_path)
    model = posattn.create_model('pervit_tiny', checkpoint=release_path)
    for key, value in pervit_from_release(weights).items():
        assert torch.equal(model.state_dict()[key], value), key
    posattn_path = tmp_path / 'posattn.pth'
    torch.save(model.state_dict(), posattn_path)
    again = posattn.create_model('pervit_tiny', checkpoint=str(posattn_path), drop_path_rate=0.1)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))


def test_checkpoint_of_another_model_names_it(tmp_path):
    path = tmp_path / 'small.pth'
    torch.save({'model': release_weights('small', seed=5)}, path)
    with pytest.raises(ValueError) as error:
        posattn.create_model('pervit_tiny', checkpoint=path)
    message = str(error.value)
    assert message.startswith(f'checkpoint {path} (PerViT release layout) does not fit pervit_tiny:')
    assert "this is a pervit_small checkpoint: create_model('pervit_small', checkpoint=...)" in message
    assert 'wrong shapes (264): stem.layers.0.conv.weight: checkpoint (64, 3, 3, 3), model (48, 3, 3, 3)' in message


def test_checkpoint_mismatch_lists_missing_unexpected_and_classifier(tmp_path):
    state_dict = posattn.create_model('pervit_tiny', num_classes=10).state_dict()
    path = tmp_path / 'ten_classes.pth'
    torch.save(state_dict, path)
    with pytest.raises(ValueError, match=r'only the classifier differs: pass num_classes=10\n'
                                         r'  wrong shapes \(2\): head.weight: checkpoint \(10, 280\), model \(1000, 280\)'):
        posattn.create_model('pervit_tiny', checkpoint=path)
    assert posattn.create_model('pervit_tiny', checkpoint=path, num_classes=10).head.out_features == 10
    state_dict['extra.weight'] = state_dict.pop('norm.weight')
    torch.save(state_dict, path)
    with pytest.raises(ValueError, match=r"missing keys \(1\): norm.weight\n  unexpected keys \(1\): extra.weight"):
        posattn.create_model('pervit_tiny', checkpoint=path, num_classes=10)


def test_each_wrapping_of_a_state_dict_is_unwrapped():
    state_dict = {'norm.weight': torch.ones(2)}
    for wrapped in (state_dict, {'model': state_dict, 'epoch': 3}, {'state_dict': state_dict, 'meta': {}}):
        assert unwrap_state_dict(wrapped) == state_dict
    with pytest.raises(TypeError, match='a checkpoint is a state_dict or a dict with a "model" state_dict .*, '
                                        'got Tensor'):
        unwrap_state_dict(torch.ones(1))


def mmengine_classifier(state_dict):
    """A posattn classifier's ``state_dict`` as mmengine saves it with mmpretrain's head, and a neck."""
    return {**{('head.fc.' + k[len('head.'):]) if k.startswith('head.') else 'backbone.model.' + k: v
               for k, v in state_dict.items()}, 'neck.lateral.weight': torch.zeros(4, 4)}


def tensors(state_dict):
    """Which tensor each key holds (the conversions rename; they copy nothing)."""
    return {key: id(value) for key, value in state_dict.items()}


def test_mmengine_layout_whole_model_only_and_under_a_prefix():
    expected = posattn.create_model('pervit_tiny', num_classes=6).state_dict()
    body = {k: v for k, v in expected.items() if not k.startswith('head.')}
    saved = mmengine_classifier(expected)
    with_neck = {**expected, 'neck.lateral.weight': saved['neck.lateral.weight']}
    cases = [({}, 'mmengine', with_neck), (dict(model_only=True), 'mmengine', expected),
             (dict(prefix='backbone.'), 'posattn backbone', body), (dict(prefix='backbone.model.'), 'posattn', body)]
    for checkpoint in (saved, {'meta': {}, 'state_dict': saved}):  # bare, or as mmengine writes it
        for options, layout, keys in cases:
            converted, found = to_posattn_layout(checkpoint, **options)
            assert (found, tensors(converted)) == (layout, tensors(keys)), options
        assert to_posattn_layout(checkpoint, prefix='head.fc.')[0].keys() == {'weight', 'bias'}
        with pytest.raises(ValueError, match=re.escape("no key of x.pth starts with prefix 'neck.lat.'; its keys "
                                                       "start with ['backbone.', 'head.', 'neck.']")):
            to_posattn_layout(checkpoint, prefix='neck.lat.', source='x.pth')


def test_a_backbone_under_a_prefix_drops_the_cancelled_biases():
    body = posattn.create_model('pervit_tiny', num_classes=0).state_dict()
    old = {'backbone.model.' + k: v for k, v in body.items()}
    old['backbone.model.distance_embedding.bias'] = torch.ones(16)  # as posattn saved it when it had one
    for prefix, layout in (('backbone.', 'posattn backbone'), ('backbone.model.', 'posattn')):
        converted, found = to_posattn_layout({'state_dict': old}, prefix=prefix)
        assert (found, tensors(converted)) == (layout, tensors(body))


def test_checkpoint_with_arbitrary_objects_is_refused(tmp_path):
    path = tmp_path / 'pickled.pth'
    torch.save({'model': {}, 'hook': _Unsafe()}, path)
    with pytest.raises(ValueError, match='holds objects other than tensors .* weights-only loading refuses'):
        posattn.create_model('pervit_tiny', checkpoint=path)


class _Unsafe:
    pass


def test_model_card_examples_run(tmp_path, monkeypatch):
    card = Path(__file__).resolve().parents[1] / 'docs' / 'models.md'
    blocks = re.findall(r'```python\n(.*?)```', card.read_text(), flags=re.S)
    (use,) = [block for block in blocks if 'forward_intermediates' in block]
    (load,) = [block for block in blocks if "checkpoint='pervit_small.pth'" in block]
    namespace = {}
    exec(compile(use, 'docs/models.md', 'exec'), namespace)
    assert namespace['logits'].shape == (2, 1000) and namespace['features'].shape == (2, 280, 10, 14)
    assert [m.shape[1] for m in namespace['maps']] == [192, 224, 280, 280]
    release = ReleasePerViT('small').state_dict()
    monkeypatch.chdir(tmp_path)
    torch.save({'model': release, 'args': argparse.Namespace(model='pervit_small')}, 'pervit_small.pth')
    exec(compile(load, 'docs/models.md', 'exec'), namespace)
    assert torch.equal(namespace['model'].distance_embedding.weight, release['rpe_proj.weight'])


def test_create_model_reads_the_classifiers_mmengine_writes(tmp_path):
    # tools/train.py's layout: posattn's model under backbone.model., mmpretrain's head under head.fc.
    trained = posattn.create_model('pervit_tiny', num_classes=6).eval()
    weights = trained.state_dict()
    state_dict = {('head.fc.' + k[len('head.'):]) if k.startswith('head.') else 'backbone.model.' + k: v
                  for k, v in weights.items()}
    path = tmp_path / 'epoch_10.pth'
    torch.save({'meta': {'epoch': 10, 'iter': 940}, 'state_dict': state_dict, 'optimizer': {}}, path)
    model = posattn.create_model('pervit_tiny', num_classes=6, checkpoint=path).eval()
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(model(images), trained(images))
    with pytest.raises(ValueError, match=r'\(mmengine layout\) does not fit pervit_tiny:\n  only the classifier '
                                         r'differs: pass num_classes=6'):
        posattn.create_model('pervit_tiny', checkpoint=path)


def test_a_detector_checkpoint_reports_what_is_not_the_backbone(tmp_path):
    weights = {'backbone.model.' + k: v for k, v in posattn.create_model('pervit_tiny', num_classes=0).state_dict().items()}
    weights['neck.lateral.weight'] = torch.zeros(4, 4)
    path = tmp_path / 'detector.pth'
    torch.save({'meta': {}, 'state_dict': weights}, path)
    with pytest.raises(ValueError, match=r"unexpected keys \(1\): neck.lateral.weight"):
        posattn.create_model('pervit_tiny', num_classes=0, checkpoint=path)
