"""Starting posattn's ViT with any Φp from timm's and mmpretrain's ViT / DeiT weights.

The sources are built here with random weights (no downloads): timm's ``deit_tiny_patch16_224``,
saved bare, as safetensors (as timm ships its weights) and as a DeiT training checkpoint
(``{'model': ...}``), and mmpretrain's DeiT-Tiny classifier, saved as mmengine saves it
(``{'state_dict': ..., 'meta': ...}``).
"""
import re
import warnings
from pathlib import Path

import pytest
import torch

import posattn
from posattn.convert import read_checkpoint, to_posattn_layout

from conftest import MISSING_OPENMMLAB, needs_openmmlab, randomised

timm = pytest.importorskip('timm')


def mmpretrain_name(key):
    """The name mmpretrain's DeiT classifier gives the tensor posattn's ViT calls ``key``."""
    for posattn_name, mmpretrain in ((r'^patch_embed\.proj\.', 'backbone.patch_embed.projection.'),
                                     (r'^(cls_token|pos_embed)$', r'backbone.\1'),
                                     (r'^blocks\.(\d+)\.norm([12])\.', r'backbone.layers.\1.ln\2.'),
                                     (r'^blocks\.(\d+)\.attn\.', r'backbone.layers.\1.attn.'),
                                     (r'^blocks\.(\d+)\.mlp\.fc1\.', r'backbone.layers.\1.ffn.layers.0.0.'),
                                     (r'^blocks\.(\d+)\.mlp\.fc2\.', r'backbone.layers.\1.ffn.layers.1.'),
                                     (r'^norm\.', 'backbone.ln1.'), (r'^head\.', 'head.layers.head.')):
        if re.match(posattn_name, key):
            return re.sub(posattn_name, mmpretrain, key)
    raise KeyError(key)


@pytest.fixture(scope='module')
def timm_deit():
    return randomised(timm.create_model('deit_tiny_patch16_224', pretrained=False, dynamic_img_size=True), seed=1)


def build_mmpretrain_deit(**backbone_options):
    import posattn_openmmlab  # noqa: F401  (first, as the tools do: mmpretrain imports beside transformers 5)
    from mmpretrain.registry import MODELS
    return MODELS.build(dict(type='ImageClassifier',
                             backbone=dict(type='VisionTransformer', arch='deit-tiny', **backbone_options),
                             head=dict(type='VisionTransformerClsHead', num_classes=1000, in_channels=192)))


@pytest.fixture(scope='module')
def mmpretrain_deit():
    """mmpretrain's DeiT-Tiny classifier, random; None without OpenMMLab."""
    return None if MISSING_OPENMMLAB else randomised(build_mmpretrain_deit(), seed=2)


def sources(*names):
    """The checkpoint sources as parameters, mmpretrain's skipped without OpenMMLab."""
    return [pytest.param(name, marks=[needs_openmmlab] if name == 'mmpretrain' else []) for name in names]


@pytest.fixture(scope='module')
def checkpoints(tmp_path_factory, timm_deit, mmpretrain_deit):
    """name -> (path, {posattn key: source tensor}); 'mmpretrain' only with OpenMMLab."""
    folder = tmp_path_factory.mktemp('vit_weights')
    timm_weights = timm_deit.state_dict()
    saved = {'timm': timm_weights, 'deit_training': {'model': timm_weights, 'epoch': 299}}
    expected = {'timm': timm_weights, 'deit_training': timm_weights}
    if mmpretrain_deit is not None:
        mmpretrain_weights = mmpretrain_deit.state_dict()
        saved['mmpretrain'] = {'state_dict': mmpretrain_weights, 'meta': {}}
        expected['mmpretrain'] = {k: mmpretrain_weights[mmpretrain_name(k)]
                                  for k in posattn.create_model('vit_tiny').state_dict()}
    paths = {name: folder / f'{name}.pth' for name in saved}
    for name, content in saved.items():
        torch.save(content, paths[name])
    from safetensors.torch import save_file
    paths['timm_safetensors'] = folder / 'timm.safetensors'
    save_file(timm_weights, paths['timm_safetensors'])
    expected['timm_safetensors'] = timm_weights
    return {name: (path, expected[name]) for name, path in paths.items()}


def create_reporting(*args, **kwargs):
    """create_model(*args, **kwargs) and the messages of the warnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        model = posattn.create_model(*args, **kwargs)
    return model, reports(caught)


def reports(caught):
    """The messages of the warnings about the weights loaded (not that a Φp gets no gradient)."""
    return [str(w.message) for w in caught if not issubclass(w.category, posattn.UnreachedPhiWarning)]


def test_layouts_are_recognised(checkpoints):
    layouts = {name: to_posattn_layout(read_checkpoint(path)) for name, (path, _) in checkpoints.items()}
    expected = {'timm': 'posattn', 'deit_training': 'posattn', 'mmpretrain': 'mmpretrain ViT', 'timm_safetensors': 'posattn'}
    assert {name: layout for name, (_, layout) in layouts.items()} == {name: expected[name] for name in checkpoints}
    keys = list(posattn.create_model('vit_tiny').state_dict())
    for state_dict, _ in layouts.values():
        assert sorted(state_dict) == sorted(keys)


@pytest.mark.parametrize('source', sources('timm', 'deit_training', 'mmpretrain', 'timm_safetensors'))
def test_phi_none_gives_the_source_logits(checkpoints, timm_deit, mmpretrain_deit, source):
    model, reports = create_reporting('vit_tiny', checkpoint=checkpoints[source][0])
    assert reports == []
    images = torch.randn(2, 3, 224, 224) if source == 'mmpretrain' else torch.randn(2, 3, 48, 64)
    with torch.no_grad():
        expected = mmpretrain_deit(images, mode='tensor') if source == 'mmpretrain' else timm_deit(images)
        torch.testing.assert_close(model.eval()(images), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize('phi', posattn.list_phis())
@pytest.mark.parametrize('source', sources('timm', 'mmpretrain'))
def test_every_phi_starts_fresh_and_everything_else_loads(checkpoints, phi, source):
    path, source_weights = checkpoints[source]
    torch.manual_seed(3)
    own_init = posattn.create_model('vit_tiny', phi=phi).state_dict()
    torch.manual_seed(3)
    model, reports = create_reporting('vit_tiny', phi=phi, checkpoint=path)
    phi_keys = [k for k in own_init if '.attn.phi.' in k]
    for key, value in model.state_dict().items():
        assert torch.equal(value, own_init[key] if key in phi_keys else source_weights[key]), key
    assert len(reports) == (1 if phi_keys else 0)
    if not phi_keys:
        return
    suffixes = sorted({k.split('.attn.phi.')[1] for k in phi_keys})
    layout = 'mmpretrain ViT' if source == 'mmpretrain' else 'posattn'
    assert reports[0].startswith(f'vit_tiny from checkpoint {path} ({layout} layout): {len(phi_keys)} Φp keys are '
                                 f'not in it and start from their own initialisation: blocks.{{0..11}}.attn.phi.')
    assert '\n' not in reports[0] and all(suffix in reports[0] for suffix in suffixes)


def test_cpvt_from_deit_drops_the_pos_embed_with_the_report(checkpoints):
    path, source_weights = checkpoints['timm']
    torch.manual_seed(4)
    own_init = posattn.create_model('vit_tiny', phi='peg', pos_embed=False, peg_after=(0, 2, 5)).state_dict()
    torch.manual_seed(4)
    model, reports = create_reporting('vit_tiny', phi='peg', pos_embed=False, peg_after=(0, 2, 5), checkpoint=path)
    assert reports == [f'vit_tiny from checkpoint {path} (posattn layout): 30 Φp keys are not in it and start from '
                       f'their own initialisation: blocks.{{0..11}}.attn.phi.{{proj.weight, proj.bias}}, '
                       f'pegs.{{0,2,5}}.{{proj.weight, proj.bias}}; its pos_embed is not loaded: the model has no '
                       f'learned position embedding (pos_embed=False)']
    for key, value in model.state_dict().items():
        fresh = '.attn.phi.' in key or key.startswith('pegs.')
        assert torch.equal(value, own_init[key] if fresh else source_weights[key]), key
    _, reports = create_reporting('vit_tiny', pos_embed=False, peg_after=(0,), checkpoint=path)
    assert reports[0].endswith(': 2 Φp keys are not in it and start from their own initialisation: '
                               'pegs.0.{proj.weight, proj.bias}; its pos_embed is not loaded: the model has no '
                               'learned position embedding (pos_embed=False)')


def saved(tmp_path, state_dict):
    path = tmp_path / 'weights.pth'
    torch.save(state_dict, path)
    return path


def test_a_missing_unexpected_or_mis_shaped_non_phi_key_is_an_error(tmp_path, timm_deit):
    weights = timm_deit.state_dict()
    missing = {k: v for k, v in weights.items() if k != 'blocks.3.mlp.fc1.weight'}
    with pytest.raises(ValueError, match=r'does not fit vit_tiny:\n  missing keys \(1\): blocks.3.mlp.fc1.weight$'):
        posattn.create_model('vit_tiny', phi='peripheral', checkpoint=saved(tmp_path, missing))
    mis_shaped = dict(weights, **{'norm.weight': torch.ones(191)})
    with pytest.raises(ValueError, match=r'wrong shapes \(1\): norm.weight: checkpoint \(191,\), model \(192,\)$'):
        posattn.create_model('vit_tiny', phi='irpe', checkpoint=saved(tmp_path, mis_shaped))
    unexpected = dict(weights, **{'blocks.0.attn.scale': torch.ones(1)})
    with pytest.raises(ValueError, match=r'unexpected keys \(1\): blocks.0.attn.scale$'):
        posattn.create_model('vit_tiny', phi='peg', checkpoint=saved(tmp_path, unexpected))
    no_pos_embed = {k: v for k, v in weights.items() if k != 'pos_embed'}
    with pytest.raises(ValueError, match=r'missing keys \(1\): pos_embed$'):
        posattn.create_model('vit_tiny', phi='peripheral', checkpoint=saved(tmp_path, no_pos_embed))


def test_weights_of_another_or_part_of_a_phi_are_not_a_plain_vit(tmp_path):
    irpe = posattn.create_model('vit_tiny', phi='irpe').state_dict()
    with pytest.raises(ValueError, match=r'missing keys \(84\): blocks.0.attn.phi.proj1_weight;.*\n'
                                         r'  unexpected keys \(12\): blocks.0.attn.phi.rpe_k.lookup_table_weight'):
        posattn.create_model('vit_tiny', phi='peripheral', checkpoint=saved(tmp_path, irpe))
    peripheral = posattn.create_model('vit_tiny', phi='peripheral').state_dict()
    part = {k: v for k, v in peripheral.items() if not k.startswith('blocks.5.attn.phi.')}
    with pytest.raises(ValueError, match=r'missing keys \(7\): blocks.5.attn.phi.proj1_weight'):
        posattn.create_model('vit_tiny', phi='peripheral', checkpoint=saved(tmp_path, part))


@needs_openmmlab
def test_classifier_and_distilled_deit_errors_name_the_fix(tmp_path, checkpoints):
    with pytest.raises(ValueError, match=r'only the classifier differs: pass num_classes=1000\n'
                                         r'  wrong shapes \(2\): head.weight'):
        posattn.create_model('vit_tiny', phi='peripheral', num_classes=10, checkpoint=checkpoints['mmpretrain'][0])
    distilled = timm.create_model('deit_tiny_distilled_patch16_224', pretrained=False).state_dict()
    with pytest.raises(ValueError, match=r"these are a distilled DeiT's weights \(dist_token, head_dist\): posattn's "
                                         r'ViT has a class token only; start from the DeiT weights without distillation'):
        posattn.create_model('vit_tiny', phi='peripheral', checkpoint=saved(tmp_path, distilled))


def loading_reporting(model, path):
    """The warnings of loading ``path`` into ``model`` as timm's ``pretrained=True`` does (a classifier
    of another size left out)."""
    from posattn.models.registry import load_checkpoint
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        load_checkpoint(model, path, target='vit_tiny', classifier_may_differ=True)
    return reports(caught)


def test_a_classifier_left_out_is_reported_with_both_sizes(checkpoints):
    """The checkpoints' classifier has 1000 classes from 192 features; the model's what it was built with."""
    path, weights = checkpoints['timm']
    source = f'vit_tiny: the classifier of checkpoint {path} (posattn layout)'
    ten = posattn.create_model('vit_tiny', num_classes=10)
    assert loading_reporting(ten, path) == [f'{source} (1000 classes) is not loaded: the model has 10 classes']
    assert torch.equal(ten.blocks[2].mlp.fc1.weight, weights['blocks.2.mlp.fc1.weight'])
    headless = posattn.create_model('vit_tiny', num_classes=0)
    assert loading_reporting(headless, path) == [
        f'{source} (1000 classes) is not loaded: the model has no classifier (num_classes=0)']
    narrow = posattn.create_model('vit_tiny')
    narrow.head = torch.nn.Linear(96, 1000)  # the same classes over other features
    assert loading_reporting(narrow, path) == [f'{source} (1000 classes, weight (1000, 192)) is not loaded: the '
                                               f'model has 1000 classes, weight (1000, 96)']
    assert loading_reporting(posattn.create_model('vit_tiny'), path) == []


@needs_openmmlab
def test_mmpretrain_options_posattn_lacks_are_reported(tmp_path):
    pre_norm = build_mmpretrain_deit(pre_norm=True).state_dict()
    with pytest.raises(ValueError, match=r'\(mmpretrain ViT layout\) does not fit vit_tiny:\n'
                                         r'  missing keys \(1\): patch_embed.proj.bias\n'
                                         r'  unexpected keys \(2\): backbone.pre_norm.weight; backbone.pre_norm.bias$'):
        posattn.create_model('vit_tiny', phi='peripheral', checkpoint=saved(tmp_path, {'state_dict': pre_norm}))


@needs_openmmlab
@pytest.mark.parametrize('source', sources('timm', 'mmpretrain', 'timm_safetensors'))
def test_posattn_vit_pretrained_init_starts_the_phi_fresh(checkpoints, monkeypatch, source):
    from posattn_openmmlab import PosattnViT, backbones
    logged = []
    monkeypatch.setattr(backbones, 'print_log', lambda message, **kwargs: logged.append(message))
    path, source_weights = checkpoints[source]
    torch.manual_seed(5)
    own_init = PosattnViT(arch='tiny', phi='peripheral').model.state_dict()
    torch.manual_seed(5)
    backbone = PosattnViT(arch='tiny', phi='peripheral', init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    backbone.init_weights()
    for key, value in backbone.model.state_dict().items():
        assert torch.equal(value, own_init[key] if '.attn.phi.' in key else source_weights[key]), key
    layout = 'mmpretrain ViT' if source == 'mmpretrain' else 'posattn'
    assert logged == [
        f'PosattnViT from checkpoint {path} ({layout} layout): 84 Φp keys are not in it and start from their own '
        f'initialisation: blocks.{{0..11}}.attn.phi.{{proj1_weight, norm1_weight, norm1_bias, proj2_weight, '
        f'norm2_weight, norm2_bias, distance_embedding.weight}}',
        f'PosattnViT: loaded every other backbone weight from {path} ({layout} layout); not loaded, the '
        f'classifier: head.bias, head.weight']
    with pytest.raises(ValueError, match=r"reads only checkpoint, prefix, map_location and strict from a "
                                         r"Pretrained init_cfg; got \['revise_keys'\] too"):
        PosattnViT(init_cfg=dict(type='Pretrained', checkpoint=str(path), revise_keys=[])).init_weights()


@needs_openmmlab
def test_docs_examples_run_and_show_the_report(tmp_path, monkeypatch, timm_deit):
    from mmengine.registry import MODELS
    from posattn_openmmlab import backbones
    card = (Path(__file__).resolve().parents[1] / 'docs' / 'models.md').read_text()
    section = card[card.index('## Starting from ViT and DeiT weights'):]
    call, config = re.findall(r'```py\n(.*?)```', section, flags=re.S)
    shown_report = re.search(r'```\n(vit_tiny from .*?)\n```', section).group(1)
    monkeypatch.chdir(tmp_path)
    torch.save(timm_deit.state_dict(), 'deit_tiny_patch16_224.pth')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        exec(compile(call, 'docs/models.md', 'exec'), {'posattn': posattn})
    assert reports(caught) == [shown_report]
    logged = []
    monkeypatch.setattr(backbones, 'print_log', lambda message, **kwargs: logged.append(message))
    namespace = {}
    exec(compile(config, 'docs/models.md', 'exec'), namespace)
    MODELS.build(namespace['model']['backbone']).init_weights()
    assert logged[0] == shown_report.replace('vit_tiny', 'PosattnViT', 1)


def timm_resampled(pos_embed, grid_size, num_prefix_tokens=1):
    """The oracle: timm's own resampling of a checkpoint's position embedding at load time."""
    from timm.layers import resample_abs_pos_embed
    return resample_abs_pos_embed(pos_embed, new_size=list(grid_size), num_prefix_tokens=num_prefix_tokens)


def resample_report(grid_size):
    tokens = 1 + grid_size[0] * grid_size[1]
    return (f'its pos_embed (1, 197, 192) is resampled from a 14x14 grid to the model\'s {grid_size[0]}x{grid_size[1]} '
            f'(1, {tokens}, 192) (bicubic, 1 prefix token kept)')


@pytest.mark.parametrize('img_size,grid_size', [(384, (24, 24)), ((384, 256), (24, 16)), (160, (10, 10))])
@pytest.mark.parametrize('source', sources('timm', 'mmpretrain', 'timm_safetensors'))
def test_224_weights_load_into_a_model_of_another_size(checkpoints, source, img_size, grid_size):
    """The position embedding is resampled as timm resamples it; everything else loads as it is."""
    path, source_weights = checkpoints[source]
    model, reports = create_reporting('vit_tiny', img_size=img_size, checkpoint=path)
    layout = 'mmpretrain ViT' if source == 'mmpretrain' else 'posattn'
    assert reports == [f'vit_tiny from checkpoint {path} ({layout} layout): {resample_report(grid_size)}']
    expected = timm_resampled(source_weights['pos_embed'], grid_size)
    assert model.pos_embed.shape == expected.shape
    torch.testing.assert_close(model.pos_embed.detach(), expected, rtol=0, atol=1e-6)
    for key, value in model.state_dict().items():
        assert key == 'pos_embed' or torch.equal(value, source_weights[key]), key


def test_resampled_model_gives_timm_logits_at_384(checkpoints):
    """timm's own path: a deit_tiny built for 384 whose 224 weights went through its checkpoint_filter_fn."""
    from timm.models.vision_transformer import checkpoint_filter_fn
    path, source_weights = checkpoints['timm']
    reference = timm.create_model('deit_tiny_patch16_224', pretrained=False, img_size=384).eval()
    reference.load_state_dict(checkpoint_filter_fn(dict(source_weights), reference))
    model, _ = create_reporting('vit_tiny', img_size=384, checkpoint=path)
    images = torch.randn(1, 3, 384, 384)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(images), reference(images), rtol=0, atol=1e-5)


def test_resampling_joins_the_phi_report_in_one_line(checkpoints):
    path, _ = checkpoints['timm']
    _, reports = create_reporting('vit_tiny', phi='peripheral', img_size=(384, 256), checkpoint=path)
    assert len(reports) == 1 and '\n' not in reports[0]
    assert reports[0].startswith(f'vit_tiny from checkpoint {path} (posattn layout): 84 Φp keys are not in it')
    assert reports[0].endswith('; ' + resample_report((24, 16)))


def test_a_pos_embed_that_cannot_be_resampled_is_a_wrong_shape(tmp_path, timm_deit):
    weights = timm_deit.state_dict()
    narrow = dict(weights, pos_embed=weights['pos_embed'][..., :100])
    with pytest.raises(ValueError, match=r'does not fit vit_tiny:\n  wrong shapes \(1\): pos_embed: checkpoint '
                                         r'\(1, 197, 100\), model \(1, 577, 192\)$'):
        posattn.create_model('vit_tiny', img_size=384, checkpoint=saved(tmp_path, narrow))
    not_square = dict(weights, pos_embed=weights['pos_embed'][:, :150])
    with pytest.raises(ValueError, match=r'wrong shapes \(1\): pos_embed: checkpoint \(1, 150, 192\), model '
                                         r'\(1, 577, 192\)$'):
        posattn.create_model('vit_tiny', img_size=384, checkpoint=saved(tmp_path, not_square))


def test_resample_abs_pos_embed_is_timms():
    from posattn.models.pos_embed import resample_abs_pos_embed
    generator = torch.Generator().manual_seed(6)
    pos_embed = torch.randn(1, 1 + 14 * 14, 8, generator=generator)
    for new_size in [(24, 16), (7, 9), (14, 14)]:
        torch.testing.assert_close(resample_abs_pos_embed(pos_embed, new_size), timm_resampled(pos_embed, new_size),
                                   rtol=0, atol=1e-6)
    half = pos_embed.half()
    torch.testing.assert_close(resample_abs_pos_embed(half, (20, 20)), timm_resampled(half, (20, 20)), rtol=0, atol=0)
    no_prefix = pos_embed[:, 1:]
    torch.testing.assert_close(resample_abs_pos_embed(no_prefix, (5, 6), num_prefix_tokens=0),
                               timm_resampled(no_prefix, (5, 6), num_prefix_tokens=0), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match='of 197 tokens with 0 prefix tokens has 197 grid tokens, not a square grid'):
        resample_abs_pos_embed(pos_embed, (5, 5), num_prefix_tokens=0)
    with pytest.raises(ValueError, match='a position embedding of 196 grid tokens is not a 10x20 grid'):
        resample_abs_pos_embed(pos_embed, (5, 5), old_size=(10, 20))


@needs_openmmlab
@pytest.mark.parametrize('img_size,grid_size', [(384, (24, 24)), ((384, 256), (24, 16))])
def test_posattn_vit_pretrained_init_resamples_the_pos_embed(checkpoints, monkeypatch, img_size, grid_size):
    from posattn_openmmlab import PosattnViT, backbones
    logged = []
    monkeypatch.setattr(backbones, 'print_log', lambda message, **kwargs: logged.append(message))
    path, source_weights = checkpoints['mmpretrain']
    backbone = PosattnViT(arch='tiny', img_size=img_size, init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    backbone.init_weights()
    torch.testing.assert_close(backbone.model.pos_embed.detach(), timm_resampled(source_weights['pos_embed'], grid_size),
                               rtol=0, atol=1e-6)
    assert torch.equal(backbone.model.blocks[7].attn.qkv.weight, source_weights['blocks.7.attn.qkv.weight'])
    assert logged[0] == f'PosattnViT from checkpoint {path} (mmpretrain ViT layout): {resample_report(grid_size)}'
    outputs = backbone(torch.randn(1, 3, *((img_size,) * 2 if isinstance(img_size, int) else img_size)))
    assert outputs[0].shape == (1, 192)


DEIT3 = dict(init_values=1e-6, no_embed_class=True, depth=3)  # timm's deit3_small_patch16_224, 3 blocks


@pytest.fixture(scope='module')
def timm_deit3():
    return randomised(timm.create_model('deit3_small_patch16_224', pretrained=False, depth=3,
                                        dynamic_img_size=True), seed=7)


@pytest.mark.parametrize('size', [(224, 224), (160, 96)])
def test_deit3_weights_give_timms_logits(tmp_path, timm_deit3, size):
    """Layer scale under timm's names (``ls1.gamma``, ``ls2.gamma``) and DeiT III's position embedding
    without the class token: with phi='none' the model is timm's DeiT III, at any input size."""
    path = saved(tmp_path, timm_deit3.state_dict())
    model, reports = create_reporting('vit_small', phi='none', checkpoint=path, **DEIT3)
    assert reports == [] and model.pos_embed.shape == (1, 196, 384)
    images = torch.randn(2, 3, *size)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(images), timm_deit3(images), rtol=0, atol=1e-5)


def test_deit3_weights_start_a_phi_model(tmp_path, timm_deit3):
    weights = timm_deit3.state_dict()
    path = saved(tmp_path, weights)
    torch.manual_seed(8)
    own_init = posattn.create_model('vit_small', phi='peripheral', **DEIT3).state_dict()
    torch.manual_seed(8)
    model, reports = create_reporting('vit_small', phi='peripheral', checkpoint=path, **DEIT3)
    assert reports == [f'vit_small from checkpoint {path} (posattn layout): 21 Φp keys are not in it and start from '
                       f'their own initialisation: blocks.{{0..2}}.attn.phi.{{proj1_weight, norm1_weight, norm1_bias, '
                       f'proj2_weight, norm2_weight, norm2_bias, distance_embedding.weight}}']
    for key, value in model.state_dict().items():
        assert torch.equal(value, own_init[key] if '.attn.phi.' in key else weights[key]), key
    assert torch.equal(model.blocks[1].ls2.gamma, weights['blocks.1.ls2.gamma'])


def test_layer_scale_starts_at_init_values():
    model = posattn.create_model('vit_tiny', init_values=1e-6, depth=2)
    reference = timm.create_model('deit3_small_patch16_224', pretrained=False, depth=2)
    assert [name for name, _ in model.named_parameters() if 'ls' in name] == [
        name for name, _ in reference.named_parameters() if 'ls' in name]
    assert all(torch.equal(block.ls1.gamma, torch.full((192,), 1e-6)) for block in model.blocks)
    assert not any('.ls' in name for name in posattn.create_model('vit_tiny', depth=2).state_dict())


def test_deit3_weights_in_a_model_without_layer_scale_name_the_fix(tmp_path, timm_deit3):
    path = saved(tmp_path, timm_deit3.state_dict())
    with pytest.raises(ValueError, match=r'does not fit vit_small:\n  these weights have layer scale \(ls1.gamma, '
                                         r'ls2.gamma\) and a position embedding without the class token: DeiT III\'s; '
                                         r'build the model with init_values=1e-6 \(or any value: the weights set it\) '
                                         r'and no_embed_class=True\n'
                                         r'  unexpected keys \(6\): blocks.0.ls1.gamma; blocks.0.ls2.gamma'):
        posattn.create_model('vit_small', depth=3, checkpoint=path)
    with pytest.raises(ValueError, match=r'\n  these weights have layer scale \(ls1.gamma, ls2.gamma\): build the '
                                         r'model with init_values=1e-6 \(or any value: the weights set it\)\n'):
        posattn.create_model('vit_small', depth=3, no_embed_class=True, checkpoint=path)
    with pytest.raises(ValueError, match=r"\n  their pos_embed \(1, 196, 384\) has no entry for the class token "
                                         r"\(DeiT III's layout\): build the model with no_embed_class=True\n"):
        posattn.create_model('vit_small', depth=3, init_values=1e-6, checkpoint=path)
    deit = saved(tmp_path, posattn.create_model('vit_small', depth=3).state_dict())
    with pytest.raises(ValueError, match=r'\n  the model has layer scale \(init_values\) and these weights do not: '
                                         r'build it without init_values\n  missing keys \(6\): blocks.0.ls1.gamma'):
        posattn.create_model('vit_small', depth=3, init_values=1e-6, checkpoint=deit)


@needs_openmmlab
def test_deit3_release_and_mmpretrain_layer_scale_load(tmp_path, timm_deit3):
    """The DeiT III release's names (``blocks.{i}.gamma_1``, renamed as timm's checkpoint_filter_fn
    does) and mmpretrain's layer scale (``attn.gamma1.weight``, ``ffn.gamma2.weight``)."""
    weights = timm_deit3.state_dict()
    release = {re.sub(r'\.ls([12])\.gamma$', r'.gamma_\1', k): v for k, v in weights.items()}
    assert 'blocks.2.gamma_2' in release
    path = saved(tmp_path, {'model': release})
    model, reports = create_reporting('vit_small', checkpoint=path, **DEIT3)
    assert reports == [] and to_posattn_layout(read_checkpoint(path))[1] == 'DeiT III release'
    assert all(torch.equal(value, weights[key]) for key, value in model.state_dict().items())
    mmpretrain = randomised(build_mmpretrain_deit(layer_scale_init_value=1e-5), seed=9)
    assert 'backbone.layers.3.ffn.gamma2.weight' in mmpretrain.state_dict()
    path = saved(tmp_path, {'state_dict': mmpretrain.state_dict(), 'meta': {}})
    model, reports = create_reporting('vit_tiny', init_values=1e-5, checkpoint=path)
    assert reports == []
    images = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(images), mmpretrain(images, mode='tensor'), rtol=0, atol=1e-5)
