"""posattn's models as timm models: registered with timm by ``posattn.register_timm_models()``
(never by importing posattn), timm's model API, and the checks timm's own model tests
(``tests/test_models.py`` in timm's repository) run on every model, with its input sizes: forward
at up to 384, backward at 128 with ``num_classes=42`` and a gradient for every parameter, the
pretrained config against the model, classifier resets, ``forward_intermediates`` and
``features_only`` at 96."""
import argparse
import math
import pickle
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import posattn
from posattn.models.pervit import PERVIT_ARCHS
from posattn.models.vit import VIT_ARCHS

from release_pervit import ReleasePerViT

timm = pytest.importorskip('timm')
import timm.optim  # noqa: E402 (after the skip)

NAMES = posattn.register_timm_models()
FORWARD_SIZE, BACKWARD_SIZE, FEATURES_SIZE = 384, 128, 96  # timm's TARGET_FWD_SIZE, TARGET_BWD_SIZE, TARGET_FFEAT_SIZE
SLOW = {'posattn_pervit_small', 'posattn_pervit_medium', 'posattn_vit_base'}


def names():
    return [pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else []) for name in NAMES]


def input_size(model, target):
    """timm's ``_get_input_size``: the pretrained config's size, each side capped at ``target``."""
    size = model.pretrained_cfg['input_size']
    return tuple(min(side, target) for side in size)


def run_python(code):
    """Run ``code`` in a fresh interpreter (nothing registered with timm yet); its stdout."""
    result = subprocess.run([sys.executable, '-c', textwrap.dedent(code)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_every_model_is_registered_with_timm_under_posattn_names():
    expected = [f'posattn_pervit_{arch}' for arch in PERVIT_ARCHS] + [f'posattn_vit_{arch}' for arch in VIT_ARCHS]
    assert NAMES == expected
    assert timm.list_models('posattn_*') == sorted(expected)
    assert timm.list_models('pervit*') == [] and not timm.models.is_model('vit_tiny')
    for name in NAMES:
        assert timm.models.is_model(name) and timm.models.get_pretrained_cfg(name).paper_ids


def test_importing_posattn_leaves_timm_registry_unchanged():
    """Only ``register_timm_models()`` adds to timm's registry: once, however often it is called,
    without timm's warning about a name registered twice."""
    output = run_python("""
        import sys, warnings
        import timm
        registry = lambda: (timm.list_models(), timm.list_pretrained(), sorted(timm.list_modules()))
        before = registry()
        import posattn
        assert registry() == before, "importing posattn changed timm's registry"
        assert 'posattn.models.timm_registration' not in sys.modules
        with warnings.catch_warnings():
            warnings.simplefilter('error')
            names = posattn.register_timm_models()
            assert posattn.register_timm_models() == names
        added = sorted(set(timm.list_models()) - set(before[0]))
        assert added == sorted(names) == timm.list_models('posattn_*'), added
        assert set(timm.list_models()) - set(added) == set(before[0])
        print(len(added))
    """)
    assert output.split() == ['6']


def test_a_timm_name_taken_by_another_model_is_not_replaced():
    output = run_python("""
        import timm.models
        @timm.models.register_model
        def posattn_vit_tiny(pretrained=False, **kwargs):
            raise AssertionError('not called')
        import posattn
        try:
            posattn.register_timm_models()
        except ValueError as error:
            print(error)
        assert timm.models.model_entrypoint('posattn_vit_tiny') is posattn_vit_tiny
    """)
    assert ("timm already has a model 'posattn_vit_tiny' (__main__.posattn_vit_tiny); "
            'posattn does not replace it') in output
    assert "posattn.create_model('vit_tiny')" in output


def test_registering_without_timm_says_to_install_it():
    output = run_python("""
        import sys
        sys.modules['timm'] = None  # as if timm were not installed
        import posattn
        try:
            posattn.register_timm_models()
        except ImportError as error:
            print(error)
    """)
    assert 'which is not installed: pip install timm' in output


@pytest.mark.parametrize('name', names())
def test_forward_is_the_posattn_models(name):
    """timm builds the posattn model of that name with its defaults: the same logits from the same weights."""
    model = timm.create_model(name, pretrained=False).eval()
    reference = posattn.create_model(name[len('posattn_'):]).eval()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(1, *input_size(model, FORWARD_SIZE))
    with torch.no_grad():
        out = model(x)
        torch.testing.assert_close(out, reference(x), rtol=0, atol=0)
    assert out.shape == (1, 1000) and not out.isnan().any()


@pytest.mark.parametrize('name', names())
def test_backward_reaches_every_parameter(name):
    model = timm.create_model(name, pretrained=False, num_classes=42).train()
    out = model(torch.randn(2, *input_size(model, BACKWARD_SIZE)))
    out.mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing and out.shape[-1] == 42 and not out.isnan().any()


@pytest.mark.parametrize('phi', posattn.list_phis())
def test_backward_reaches_every_parameter_of_every_phi(phi):
    model = timm.create_model('posattn_vit_tiny', phi=phi, num_classes=42, depth=2).train()
    model(torch.randn(2, 3, BACKWARD_SIZE, BACKWARD_SIZE)).mean().backward()
    assert not [n for n, p in model.named_parameters() if p.grad is None]


@pytest.mark.parametrize('name', names())
def test_pretrained_cfg_fits_the_model(name):
    """timm's ``test_model_default_cfgs``: PerViT is a standard (NCHW) model, the ViTs are token models
    (timm's non-standard filter, as for its own ViTs)."""
    model = timm.create_model(name, pretrained=False).eval()
    cfg = model.pretrained_cfg
    assert model.default_cfg is cfg or model.default_cfg == cfg
    assert model.num_classes == 1000 and model.num_features > 0 and model.head_hidden_size > 0
    state_dict = model.state_dict()
    assert cfg['classifier'] + '.weight' in state_dict and cfg['first_conv'] + '.weight' in state_dict
    x = torch.randn(1, *input_size(model, 448))
    with torch.no_grad():
        features = model.forward_features(x)
        pre_logits = model.forward_head(features, pre_logits=True)
        assert pre_logits.shape == (1, model.head_hidden_size)
        if name.startswith('posattn_pervit'):
            assert features.shape[-2:] == cfg['pool_size'] and features.shape[1] == model.num_features
        else:
            assert features.shape[-1] == model.num_features
        assert model.get_classifier() is model.head and model.head.out_features == 1000
        model.reset_classifier(0)
        assert model(x).shape == (1, model.head_hidden_size) and model.num_classes == 0
        model.reset_classifier(0, '')
        unpooled = model(x)
        if name.startswith('posattn_pervit'):
            assert unpooled.shape[-2:] == cfg['pool_size']
            headless = timm.create_model(name, pretrained=False, num_classes=0, global_pool='').eval()
            assert headless(x).shape == (1, model.num_features, *cfg['pool_size'])
        else:
            assert unpooled.shape == features.shape
            assert timm.create_model(name, num_classes=0).eval()(x).shape == (1, model.num_features)


@pytest.mark.parametrize('name', names())
def test_forward_intermediates(name):
    model = timm.create_model(name, pretrained=False).eval()
    info = timm.models.FeatureInfo(model.feature_info, range(len(model.feature_info)))
    size = input_size(model, FEATURES_SIZE)
    x = torch.randn(2, *size)
    with torch.no_grad():
        final, intermediates = model.forward_intermediates(x)
        torch.testing.assert_close(final, model.forward_features(x))
    assert len(intermediates) == len(info.channels()) >= 3
    for channels, reduction, out in zip(info.channels(), info.reduction(), intermediates):
        assert out.shape[:2] == (2, channels) and not out.isnan().any()
        assert out.shape[2] <= math.ceil(size[1] / reduction) + 1 and out.shape[3] <= math.ceil(size[2] / reduction) + 1


@pytest.mark.parametrize('name', names())
def test_features_only(name):
    model = timm.create_model(name, pretrained=False, features_only=True).eval()
    channels = model.feature_info.channels()
    with torch.no_grad():
        outputs = model(torch.randn(1, 3, FEATURES_SIZE, FEATURES_SIZE))
    assert len(outputs) == len(channels) >= 3
    for expected, out, reduction in zip(channels, outputs, model.feature_info.reduction()):
        assert out.shape == (1, expected, FEATURES_SIZE // reduction, FEATURES_SIZE // reduction)
    assert model.pretrained_cfg['input_size'] == (3, 224, 224)


def test_intermediates_match_the_forward_pass():
    """The ViT's NLC / NCHW intermediates, prefix tokens and norm are the blocks' outputs."""
    model = timm.create_model('posattn_vit_tiny', depth=3, phi='peg').eval()
    x = torch.randn(2, 3, 48, 64)
    with torch.no_grad():
        tokens, grid = model.embed_tokens(x)
        outputs = [t for _, t in model.iter_blocks(tokens, grid)]
        final, maps = model.forward_intermediates(x, [0, -1], return_prefix_tokens=True, norm=True)
        nlc = model.forward_intermediates(x, 2, output_fmt='NLC', intermediates_only=True)
    torch.testing.assert_close(final, model.forward_features(x))
    spatial, prefix = maps[1]
    torch.testing.assert_close(prefix, model.norm(outputs[2])[:, :1])
    torch.testing.assert_close(spatial.flatten(2).transpose(1, 2), model.norm(outputs[2])[:, 1:])
    torch.testing.assert_close(nlc[0], outputs[1][:, 1:])
    assert spatial.shape == (2, 192, 3, 4)
    with pytest.raises(ValueError, match="output_fmt must be 'NCHW' or 'NLC'"):
        model.forward_intermediates(x, output_fmt='NHWC')


@pytest.mark.parametrize('name', ['posattn_pervit_tiny', 'posattn_vit_tiny'])
def test_prune_intermediate_layers(name):
    model = timm.create_model(name, pretrained=False).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        expected = model.forward_intermediates(x, [1, 3], intermediates_only=True)
        assert model.prune_intermediate_layers([1, 3], prune_norm=True) == [1, 3]
        assert len(model.blocks) == 4 and model.num_classes == 0
        for got, want in zip(model.forward_intermediates(x, [1, 3], intermediates_only=True), expected):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize('name', ['posattn_pervit_tiny', 'posattn_vit_tiny'])
def test_gradient_checkpointing_changes_no_gradient(name):
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=5, drop_path_rate=0.0).train()
    x = torch.randn(2, 3, 64, 64)
    grads = []
    for checkpointing in (False, True):
        model.set_grad_checkpointing(checkpointing)
        model.zero_grad()
        model(x).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for plain, checkpointed in zip(*grads):
        torch.testing.assert_close(checkpointed, plain)


def test_timm_optimizer_factory_reads_no_weight_decay_and_groups():
    """timm's factory: no decay on the ViT's position embedding and class token (and 1-D parameters);
    layer-wise decay through ``group_matcher``, the embeddings lowest, as for timm's own ViT."""
    model = timm.create_model('posattn_vit_tiny', depth=4, pos_embed=True, peg_after=(1,))
    optimizer = timm.optim.create_optimizer_v2(model, 'adamw', lr=1e-3, weight_decay=0.05)
    no_decay = {id(p) for g in optimizer.param_groups if g['weight_decay'] == 0 for p in g['params']}
    assert id(model.pos_embed) in no_decay and id(model.cls_token) in no_decay
    assert id(model.blocks[0].attn.qkv.weight) not in no_decay
    layered = timm.optim.create_optimizer_v2(model, 'adamw', lr=1e-3, weight_decay=0.05, layer_decay=0.5)
    scale = {id(p): g['lr_scale'] for g in layered.param_groups for p in g['params']}
    assert scale[id(model.pos_embed)] < scale[id(model.blocks[0].attn.qkv.weight)]
    assert scale[id(model.blocks[1].attn.qkv.weight)] == scale[id(model.pegs['1'].proj.weight)]
    assert scale[id(model.blocks[3].attn.qkv.weight)] == scale[id(model.norm.weight)] < scale[id(model.head.weight)] == 1
    reference = timm.create_model('vit_tiny_patch16_224', depth=4)  # timm's own ViT: the same scales
    reference_scales = {id(p): g['lr_scale'] for g in timm.optim.create_optimizer_v2(
        reference, 'adamw', weight_decay=0.05, layer_decay=0.5).param_groups for p in g['params']}
    assert [scale[id(b.attn.qkv.weight)] for b in model.blocks] == \
        [reference_scales[id(b.attn.qkv.weight)] for b in reference.blocks]
    pervit = timm.create_model('posattn_pervit_tiny')
    groups = timm.optim.create_optimizer_v2(pervit, 'adamw', weight_decay=0.05, layer_decay=0.8).param_groups
    scale = {id(p): g['lr_scale'] for g in groups for p in g['params']}
    assert scale[id(pervit.stem.proj.weight)] < scale[id(pervit.blocks[0].attn.qkv.weight)] \
        < scale[id(pervit.blocks[11].attn.qkv.weight)] < scale[id(pervit.head.weight)]


@pytest.mark.parametrize('name,options', [('posattn_pervit_tiny', {}),
                                          ('posattn_vit_tiny', dict(phi='peripheral')),
                                          ('posattn_vit_tiny', dict(phi='irpe'))])
def test_models_pickle_after_use(name, options):
    """``torch.save(model)`` / pickle, inside a filled position cache."""
    model = timm.create_model(name, **options).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad(), posattn.cache_positions(model):
        expected = model(x)
        restored = pickle.loads(pickle.dumps(model))
        torch.testing.assert_close(restored(x), expected)


def test_pretrained_from_a_local_release_checkpoint(tmp_path):
    """``pretrained=True`` with a file in the PerViT release's layout (as the release saves it, with its
    argparse arguments); a classifier of another size is left out with a warning, as timm does."""
    release = ReleasePerViT('tiny')
    path = tmp_path / 'pervit_tiny.pth'
    torch.save({'model': release.state_dict(), 'args': argparse.Namespace(model='pervit_tiny')}, path)
    model = timm.create_model('posattn_pervit_tiny', pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    assert torch.equal(model.distance_embedding.weight, release.state_dict()['rpe_proj.weight'])
    assert torch.equal(model.head.weight, release.state_dict()['head.weight'])
    with pytest.warns(UserWarning, match=r'classifier of checkpoint .* \(1000 classes\) is not loaded: the model has 10'):
        ten = timm.create_model('posattn_pervit_tiny', pretrained=True, num_classes=10,
                                pretrained_cfg_overlay=dict(file=str(path)))
    assert torch.equal(ten.blocks[3].attn.qkv.weight, model.blocks[3].attn.qkv.weight)


def test_pretrained_deit_weights_into_a_phi_model(tmp_path):
    deit = timm.create_model('deit_tiny_patch16_224')
    path = tmp_path / 'deit_tiny.pth'
    torch.save(deit.state_dict(), path)
    with pytest.warns(UserWarning, match=r'Φp keys are not in it and start from their own initialisation'):
        model = timm.create_model('posattn_vit_tiny', phi='peripheral', pretrained=True,
                                  pretrained_cfg_overlay=dict(file=str(path)))
    assert torch.equal(model.blocks[5].mlp.fc1.weight, deit.blocks[5].mlp.fc1.weight)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        timm.create_model('posattn_vit_tiny', pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    path = tmp_path / 'vit_small.pth'
    torch.save(timm.create_model('posattn_vit_small').state_dict(), path)
    with pytest.raises(ValueError, match="this is a vit_small checkpoint"):
        timm.create_model('posattn_vit_tiny', pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))


def test_pretrained_from_a_safetensors_file(tmp_path):
    """timm's weights as timm ships them: a ``.safetensors`` file."""
    from safetensors.torch import save_file
    deit = timm.create_model('deit_tiny_patch16_224')
    path = tmp_path / 'deit_tiny.safetensors'
    save_file(deit.state_dict(), path)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        model = timm.create_model('posattn_vit_tiny', pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    assert all(torch.equal(value, deit.state_dict()[key]) for key, value in model.state_dict().items())


def test_docs_example_runs(tmp_path, monkeypatch):
    """The example of docs/models.md's 'As timm models', with the files it names made here."""
    from safetensors.torch import save_file
    card = (Path(__file__).resolve().parents[1] / 'docs' / 'models.md').read_text()
    section = card[card.index('## As timm models'):]
    (example,) = re.findall(r'```py\n(.*?)```', section[:section.index('\n## ')], flags=re.S)
    monkeypatch.chdir(tmp_path)
    torch.save(posattn.create_model('pervit_tiny').state_dict(), 'pervit_tiny.pth')
    deit = timm.create_model('deit_small_patch16_224')
    save_file(deit.state_dict(), 'deit_small_patch16_224.safetensors')
    namespace = {}
    with pytest.warns(UserWarning, match='Φp keys are not in it'):
        exec(compile(example, 'docs/models.md', 'exec'), namespace)
    assert torch.equal(namespace['model'].blocks[2].mlp.fc2.weight, deit.blocks[2].mlp.fc2.weight)
    assert len(namespace['backbone'](torch.randn(1, 3, 64, 64))) == 3


def test_pretrained_224_weights_into_a_model_of_another_size(tmp_path):
    """timm's fine-tuning call: 224 weights into a model built for (384, 256); the position embedding
    is resampled as timm's own ``checkpoint_filter_fn`` resamples it, with one warning saying so."""
    from timm.layers import resample_abs_pos_embed
    deit = timm.create_model('deit_tiny_patch16_224')
    path = tmp_path / 'deit_tiny.pth'
    torch.save(deit.state_dict(), path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        model = timm.create_model('posattn_vit_tiny', img_size=(384, 256), pretrained=True,
                                  pretrained_cfg_overlay=dict(file=str(path)))
    assert [str(w.message) for w in caught] == [
        f"VisionTransformer from checkpoint {path} (posattn layout): its pos_embed (1, 197, 192) is resampled from a "
        f"14x14 grid to the model's 24x16 (1, 385, 192) (bicubic, 1 prefix token kept)"]
    expected = resample_abs_pos_embed(deit.pos_embed.detach(), new_size=[24, 16], num_prefix_tokens=1)
    torch.testing.assert_close(model.pos_embed.detach(), expected, rtol=0, atol=1e-6)
    assert torch.equal(model.blocks[4].mlp.fc2.weight, deit.blocks[4].mlp.fc2.weight)


def test_dynamic_img_size_and_pad_are_timms():
    """``dynamic_img_size`` (posattn's ViT default: any input size) and ``dynamic_img_pad`` as timm
    takes them, against timm's ViT with the same weights and options."""
    for options, size in [(dict(dynamic_img_size=True), (96, 160)),
                          (dict(dynamic_img_size=True, dynamic_img_pad=True), (100, 150))]:
        reference = timm.create_model('vit_tiny_patch16_224', pretrained=False, depth=2, **options).eval()
        model = timm.create_model('posattn_vit_tiny', phi='none', depth=2, **options).eval()
        model.load_state_dict(reference.state_dict())
        x = torch.randn(2, 3, *size)
        with torch.no_grad():
            torch.testing.assert_close(model(x), reference(x), rtol=0, atol=1e-5)
    fixed = timm.create_model('posattn_vit_tiny', phi='peripheral', depth=1, dynamic_img_size=False)
    assert fixed(torch.randn(1, 3, 224, 224)).shape == (1, 1000)
    with pytest.raises(ValueError, match=r"input of 96x160 pixels gives a 6x10 grid, the model's is 14x14 "
                                         r'\(dynamic_img_size=False\): resize the input or build the model with '
                                         r'dynamic_img_size=True'):
        fixed(torch.randn(1, 3, 96, 160))
    with pytest.raises(ValueError, match='input of 100x150 pixels does not split into 16-pixel patches'):
        timm.create_model('posattn_vit_tiny', depth=1)(torch.randn(1, 3, 100, 150))
