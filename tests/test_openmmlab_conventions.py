"""PosattnPerViT and PosattnViT against mmpretrain's backbone conventions (its VisionTransformer's tests
as the model): arch names and dicts, out_indices, out_type, frozen_stages, norm_eval, with_cp,
Pretrained with prefix, get_layer_depth under mmpretrain's layer-decay constructor; mmengine's
complexity tool, mmpretrain's get_model and inferencer on the classification configs; the
optimiser constructor's log."""
import logging
import re

import numpy as np
import pytest
import torch

from conftest import require_openmmlab

require_openmmlab()  # before the OpenMMLab imports

from mmengine.config import Config
from mmengine.logging import MMLogger
from mmengine.optim import build_optim_wrapper
from mmengine.registry import DefaultScope
from mmpretrain.registry import MODELS

import posattn
from posattn import TokenGrid
from posattn_openmmlab import PosattnPerViT, PosattnViT, backbones
from posattn_openmmlab.shapes_dataset import CLASSES
from conftest import REPO

PERVIT_ARCH = dict(embed_dims=(16, 24), depths=(1, 2), num_heads=2, stem_dims=(4, 4, 4, 8))  # 3 blocks, stride 16
VIT_ARCH = dict(embed_dims=32, num_layers=3, num_heads=2, feedforward_channels=64)  # mmpretrain's keys
IMAGES = (2, 3, 32, 48)  # a 2 x 3 grid for both
SHAPES_CONFIGS = ['pervit_t_shapes.py', 'deit_t_none_shapes.py', 'deit_t_peripheral_shapes.py',
                  'deit_t_irpe_shapes.py', 'deit_t_peg_shapes.py']


def pervit(**kwargs):
    return PosattnPerViT(arch=PERVIT_ARCH, **kwargs)


def vit(**kwargs):
    return PosattnViT(arch=VIT_ARCH, img_size=32, **kwargs)


def frozen_names(backbone):
    return {name for name, param in backbone.model.named_parameters() if not param.requires_grad}


# ---- arch --------------------------------------------------------------------------------------


def test_vit_arch_names_are_mmpretrains_with_its_sizes_tiny_and_small_are_deits():
    from mmpretrain.models.backbones import VisionTransformer
    deit_names = {'t': 'deit-t', 'tiny': 'deit-t', 's': 'deit-s', 'small': 'deit-s'}
    for name, sizes in backbones.VIT_ARCH_ZOO.items():
        assert sizes == VisionTransformer.arch_zoo[deit_names.get(name, name)], name
    tiny = PosattnViT(arch='DeiT-T').model
    reference = posattn.create_model('vit_tiny', num_classes=0)
    assert {k: v.shape for k, v in tiny.state_dict().items()} == {k: v.shape for k, v in reference.state_dict().items()}


def test_pervit_arch_names_and_their_first_letters():
    for name, sizes in posattn.models.pervit.PERVIT_ARCHS.items():
        assert backbones.PERVIT_ARCH_ZOO[name] == backbones.PERVIT_ARCH_ZOO[name[0]] == sizes
    assert len(PosattnPerViT(arch='T').model.blocks) == 12


def test_arch_dicts_build_those_sizes():
    model = vit().model
    assert len(model.blocks) == 3 and model.embed_dim == 32 and model.blocks[0].mlp.fc1.out_features == 64
    assert model.blocks[0].attn.num_heads == 2
    model = pervit().model  # a stage's last block widens the tokens to the next stage's width
    assert [block.norm1.normalized_shape[0] for block in model.blocks] == [16, 24, 24]


@pytest.mark.parametrize('build,arch,error,message', [
    (PosattnViT, 'unknown', ValueError, r"unknown arch 'unknown'; choose one of \['b', 'base', 'deit-b'"),
    (PosattnPerViT, 'huge', ValueError, r"unknown arch 'huge'; choose one of \['m', 'medium', 's', 'small'"),
    (PosattnViT, dict(embed_dims=32, num_layers=3, num_heads=2), ValueError,
     r"an arch dict needs exactly the keys \['embed_dims', 'num_layers', 'num_heads', 'feedforward_channels'\]; "
     r"missing \['feedforward_channels'\]$"),
    (PosattnPerViT, dict(PERVIT_ARCH, depth=3), ValueError, r"; unknown \['depth'\]$"),
    (PosattnViT, ['tiny'], TypeError, r"arch must be a name or a dict with \['embed_dims'"),
    (PosattnViT, dict(VIT_ARCH, embed_dims=56, feedforward_channels=61), ValueError,
     r"feedforward_channels 61 is not int\(embed_dims \* mlp_ratio\) for any mlp_ratio with embed_dims 56"),
])
def test_bad_archs_are_refused_with_the_choices(build, arch, error, message):
    with pytest.raises(error, match=message):
        build(arch=arch)


# ---- out_indices and out_type --------------------------------------------------------------------


@pytest.mark.parametrize('build', [pervit, vit])
def test_out_indices_negative_in_the_order_given(build):
    backbone = build(out_indices=(-1, 0, -2), out_type='featmap').eval()
    assert backbone.out_indices == (2, 0, 1) and len(backbone.out_channels) == 3
    with torch.no_grad():
        outputs = backbone(torch.randn(*IMAGES))
    assert len(outputs) == 3 and all(o.shape[-2:] == (2, 3) for o in outputs)


@pytest.mark.parametrize('build', [pervit, vit])
@pytest.mark.parametrize('out_indices,error,message', [
    (3, ValueError, r'out_indices \(3,\) must name blocks in 0..2 \(or -3..-1\)'),
    ((0, -4), ValueError, r'out_indices \(0, -4\) must name blocks in 0..2'),
    ((), ValueError, r'out_indices \(\) must name blocks'),
    ({1: 1}, TypeError, r'out_indices must be a block index or a sequence of them, got \{1: 1\}'),
])
def test_invalid_out_indices(build, out_indices, error, message):
    with pytest.raises(error, match=message):
        build(out_indices=out_indices)


def test_vit_out_types_agree_with_each_other():
    backbone = vit(out_indices=(0, -1), out_type='raw').eval()
    images = torch.randn(*IMAGES)
    with torch.no_grad():
        raw = backbone(images)
        shapes = {}
        for out_type in ('cls_token', 'featmap', 'avg_featmap'):
            backbone.out_type = out_type
            shapes[out_type] = backbone(images)
    assert [tuple(t.shape) for t in raw] == [(2, 7, 32)] * 2
    for i in range(2):
        assert torch.equal(shapes['cls_token'][i], raw[i][:, 0])
        assert torch.equal(shapes['featmap'][i], raw[i][:, 1:].transpose(1, 2).reshape(2, 32, 2, 3))
        torch.testing.assert_close(shapes['avg_featmap'][i], raw[i][:, 1:].mean(dim=1))


def test_pervit_out_types_and_no_class_token():
    backbone = pervit(out_indices=(0, 2)).eval()  # block 0 ends stage 0: 24 channels out
    images = torch.randn(*IMAGES)
    with torch.no_grad():
        maps = backbone(images)
        backbone.out_type = 'raw'
        tokens = backbone(images)
        backbone.out_type = 'avg_featmap'
        pooled = backbone(images)
    assert [tuple(m.shape) for m in maps] == [(2, 24, 2, 3)] * 2
    assert [tuple(t.shape) for t in tokens] == [(2, 6, 24)] * 2
    for i in range(2):
        torch.testing.assert_close(pooled[i], maps[i].mean(dim=(-2, -1)))
    with pytest.raises(ValueError, match="out_type='cls_token': PerViT has no class token; use 'avg_featmap'"):
        pervit(out_type='cls_token')
    with pytest.raises(ValueError, match=r"out_type must be one of \('raw', 'cls_token', 'featmap', 'avg_featmap'\), "
                                         r"got 'tokens'"):
        pervit(out_type='tokens')


def test_vit_cls_token_output_needs_the_class_token():
    assert vit(class_token=False, out_type='avg_featmap')(torch.randn(*IMAGES))[0].shape == (2, 32)
    with pytest.raises(ValueError, match="out_type='cls_token' needs the class token: pass class_token=True"):
        vit(class_token=False)


# ---- frozen_stages, norm_eval, with_cp -----------------------------------------------------------


def test_vit_frozen_stages_as_mmpretrain():
    assert not frozen_names(vit(frozen_stages=0)) and not frozen_names(vit(frozen_stages=-1))
    backbone = vit(frozen_stages=1, pos_embed=True, peg_after=(0, 1)).train()
    assert frozen_names(backbone) == {'cls_token', 'pos_embed', 'patch_embed.proj.weight', 'patch_embed.proj.bias',
                                      *(f'blocks.0.{n}' for n, _ in backbone.model.blocks[0].named_parameters()),
                                      *(f'pegs.0.{n}' for n, _ in backbone.model.pegs['0'].named_parameters())}
    model = backbone.model
    assert not model.blocks[0].training and not model.patch_embed.training and not model.pos_drop.training
    assert model.blocks[1].training and model.pegs['1'].training and model.norm.training
    everything = vit(frozen_stages=3).train()
    assert frozen_names(everything) == {n for n, _ in everything.model.named_parameters()}
    assert not everything.model.norm.training
    with pytest.raises(ValueError, match=r'frozen_stages must be in -1..3 \(the number of blocks\), got 4'):
        vit(frozen_stages=4)


def test_pervit_frozen_stages_count_its_stages():
    assert not frozen_names(pervit(frozen_stages=0))
    backbone = pervit(frozen_stages=1).train()
    assert {n.split('.')[0] + ('.' + n.split('.')[1] if n.startswith('blocks') else '')
            for n in frozen_names(backbone)} == {'stem', 'distance_embedding', 'blocks.0'}
    assert not backbone.model.stem.training and not backbone.model.blocks[0].training
    assert backbone.model.blocks[1].training and backbone.model.norm.training
    everything = pervit(frozen_stages=2).train()
    assert frozen_names(everything) == {n for n, _ in everything.model.named_parameters()}
    with pytest.raises(ValueError, match=r'frozen_stages must be in -1..2 \(the stages of depths \(1, 2\)\), got 3'):
        pervit(frozen_stages=3)


def test_norm_eval_holds_pervits_batchnorms_and_is_refused_for_the_vit():
    batch_norms = [m for m in pervit(norm_eval=True).train().modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert batch_norms and not any(m.training for m in batch_norms)
    assert all(m.training for m in pervit().train().modules() if isinstance(m, torch.nn.BatchNorm2d))
    with pytest.raises(ValueError, match='norm_eval=True: PosattnViT has no BatchNorm; its LayerNorms keep no '
                                         'running statistics'):
        vit(norm_eval=True)


def _gradients(backbone, images):
    loss = sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in backbone(images))
    loss.backward()
    return {n: p.grad for n, p in backbone.named_parameters() if p.grad is not None}


@pytest.mark.parametrize('build', [pervit, vit])
def test_with_cp_gives_the_same_gradients_and_checkpoints_each_block_while_training(build, monkeypatch):
    plain = build(out_indices=(1, 2), out_type='featmap', frozen_stages=1).train()
    checkpointed = build(out_indices=(1, 2), out_type='featmap', frozen_stages=1, with_cp=True).train()
    checkpointed.load_state_dict(plain.state_dict())
    calls = []
    original = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, 'checkpoint', lambda *a, **kw: calls.append(1) or original(*a, **kw))
    images = torch.randn(*IMAGES)
    expected, got = _gradients(plain, images), _gradients(checkpointed, images)
    assert len(calls) == 3 and got.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, msg=name)
    checkpointed.eval()(images)
    assert len(calls) == 3


# ---- Pretrained with prefix ----------------------------------------------------------------------


def _randomised(module, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return module


def _logged(monkeypatch):
    messages = []
    monkeypatch.setattr(backbones, 'print_log', lambda message, **kwargs: messages.append(message))
    return messages


def test_prefix_backbone_of_a_classifier_trained_here(tmp_path, monkeypatch):
    classifier = _randomised(MODELS.build(dict(
        type='ImageClassifier', backbone=dict(type='PosattnPerViT', arch=PERVIT_ARCH),
        neck=dict(type='GlobalAveragePooling'), head=dict(type='LinearClsHead', num_classes=6, in_channels=24))), 1)
    path = tmp_path / 'classifier.pth'
    torch.save({'state_dict': classifier.state_dict(), 'meta': {}}, path)
    logged = _logged(monkeypatch)
    for prefix in ('backbone.', 'backbone', 'backbone.model.'):
        backbone = pervit(init_cfg=dict(type='Pretrained', checkpoint=str(path), prefix=prefix))
        backbone.init_weights()
        for key, value in backbone.state_dict().items():
            assert torch.equal(value, classifier.backbone.state_dict()[key]), (prefix, key)
    loaded = f'PosattnPerViT: loaded every backbone weight from {path} under'
    assert logged[0] == f"{loaded} 'backbone.' (posattn backbone layout)" == logged[1]
    assert logged[2] == f"{loaded} 'backbone.model.' (posattn layout)"
    with pytest.raises(ValueError, match=re.escape(f"no key of {path} starts with prefix 'neck.'; its keys start with "
                                                   "['backbone.', 'head.']")):
        pervit(init_cfg=dict(type='Pretrained', checkpoint=str(path), prefix='neck.')).init_weights()


def test_prefix_backbone_of_an_mmpretrain_vit_gives_its_features(tmp_path, monkeypatch):
    """mmpretrain's own VisionTransformer is the reference: the same weights, the same class token."""
    classifier = _randomised(MODELS.build(dict(
        type='ImageClassifier', backbone=dict(type='VisionTransformer', arch=VIT_ARCH, img_size=32, patch_size=16),
        head=dict(type='VisionTransformerClsHead', num_classes=6, in_channels=32))), 2).eval()
    path = tmp_path / 'mmpretrain_vit.pth'
    torch.save({'state_dict': classifier.state_dict(), 'meta': {}}, path)
    logged = _logged(monkeypatch)
    backbone = vit(phi='none', init_cfg=dict(type='Pretrained', checkpoint=str(path), prefix='backbone.'))
    backbone.init_weights()
    assert logged == [f"PosattnViT: loaded every backbone weight from {path} under 'backbone.' (mmpretrain ViT layout)"]
    images = torch.randn(2, 3, 32, 32)  # the training grid: no resized position embedding
    with torch.no_grad():
        torch.testing.assert_close(backbone.eval()(images)[0], classifier.backbone(images)[0], rtol=1e-4, atol=1e-5)


# ---- layer-wise learning-rate decay -------------------------------------------------------------


def test_get_layer_depth_follows_mmpretrains_vit():
    backbone = vit(peg_after=(1,))
    depths = {name: backbone.get_layer_depth('backbone.' + name, prefix='backbone.')
              for name in ('model.cls_token', 'model.pos_embed', 'model.patch_embed.proj.weight',
                           'model.blocks.0.attn.qkv.weight', 'model.blocks.2.norm1.bias', 'model.pegs.1.proj.weight',
                           'model.norm.weight')}
    assert depths == {'model.cls_token': (0, 5), 'model.pos_embed': (0, 5), 'model.patch_embed.proj.weight': (0, 5),
                      'model.blocks.0.attn.qkv.weight': (1, 5), 'model.blocks.2.norm1.bias': (3, 5),
                      'model.pegs.1.proj.weight': (2, 5), 'model.norm.weight': (4, 5)}
    assert backbone.get_layer_depth('head.fc.weight', prefix='backbone.') == (4, 5)
    backbone = pervit()
    assert [backbone.get_layer_depth(name)[0] for name in (
        'model.stem.proj.weight', 'model.distance_embedding.weight', 'model.blocks.1.attn.phi.proj1_weight',
        'model.norm.bias')] == [0, 0, 2, 4]


@pytest.mark.parametrize('config', ['pervit_t_shapes.py', 'deit_t_peripheral_shapes.py'])
def test_layer_decay_constructor_on_a_config_built_optimiser(config):
    cfg = Config.fromfile(REPO / 'configs' / config)
    model = MODELS.build(cfg.model)
    optim_wrapper = dict(cfg.optim_wrapper, constructor='LearningRateDecayOptimWrapperConstructor',
                         paramwise_cfg=dict(layer_decay_rate=0.5, norm_decay_mult=0.0))
    with DefaultScope.overwrite_default_scope('mmpretrain'):
        wrapper = build_optim_wrapper(model, optim_wrapper)
    lr = {group['param_name']: group['lr'] for group in wrapper.optimizer.param_groups}
    base = cfg.optim_wrapper.optimizer.lr
    first = 'backbone.model.blocks.0.mlp.fc1.weight'
    last = 'backbone.model.blocks.11.mlp.fc1.weight'
    embedding = 'backbone.model.stem.proj.weight' if 'pervit' in config else 'backbone.model.patch_embed.proj.weight'
    assert lr[embedding] == pytest.approx(base * 0.5 ** 13)
    assert lr[first] == pytest.approx(base * 0.5 ** 12) and lr[last] == pytest.approx(base * 0.5)
    assert lr['backbone.model.norm.weight'] == lr['head.fc.weight'] == pytest.approx(base)
    block_lrs = [lr[f'backbone.model.blocks.{i}.mlp.fc1.weight'] for i in range(12)]
    assert block_lrs == sorted(block_lrs)


# ---- the optimiser constructor's log -------------------------------------------------------------


class _Records(logging.Handler):
    def __init__(self, level):
        super().__init__(level)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def _optimiser_log(cfg, level='INFO'):
    model = MODELS.build(cfg.model)
    logger = MMLogger.get_instance(f'conventions_{level}_{id(cfg)}', log_level=level)
    records = _Records(getattr(logging, level))
    logger.addHandler(records)
    with DefaultScope.overwrite_default_scope('mmpretrain'):
        build_optim_wrapper(model, cfg.optim_wrapper)
    return [(r.levelname, r.getMessage()) for r in records.records]


def test_pervit_config_optimiser_log_states_the_multipliers_in_a_few_lines():
    cfg = Config.fromfile(REPO / 'configs' / 'pervit_t_shapes.py')
    assert cfg.optim_wrapper.constructor == 'ParamwiseSummaryOptimWrapperConstructor'
    debug = _optimiser_log(cfg, 'DEBUG')
    per_parameter = [message for level, message in debug if message.startswith('paramwise_options -- ')]
    assert {level for level, message in debug if message in per_parameter} == {'DEBUG'}
    no_decay = len(per_parameter)  # mmengine's own lines: one per parameter it sets weight_decay=0 for
    assert no_decay > 100 and all(line.endswith(':weight_decay=0.0') for line in per_parameter)
    logged = _optimiser_log(cfg)
    lines = [line for _, message in logged for line in message.splitlines()]
    assert len(lines) == 3, lines
    total = sum(p.requires_grad for p in MODELS.build(cfg.model).parameters())
    assert lines[0] == (f'paramwise_cfg (bias_decay_mult=0.0, flat_decay_mult=0.0, norm_decay_mult=0.0) on {total} '
                        'parameters (optimizer lr=0.0003, weight_decay=0.05):')
    assert lines[1].startswith(f'  {no_decay} with weight_decay=0 (x0): backbone.model.stem.layers.*.conv.bias, '
                               'backbone.model.stem.layers.*.norm.{weight, bias}, ')
    assert 'backbone.model.blocks.*.norm1.{weight, bias}' in lines[1] and lines[1].endswith('head.fc.bias')
    assert lines[2].startswith(f"  {total - no_decay} with the optimizer's settings: "
                               'backbone.model.stem.layers.*.conv.weight, ')


def test_frozen_parameters_are_one_warning():
    cfg = Config.fromfile(REPO / 'configs' / 'deit_t_none_shapes.py')
    cfg.model.backbone.frozen_stages = 12
    cfg.optim_wrapper.paramwise_cfg = dict(custom_keys={'head': dict(lr_mult=10.0)})
    logged = _optimiser_log(cfg)
    assert len(logged) == 2
    assert logged[0][1].splitlines()[1:] == ['  2 with lr=0.003 (x10), weight_decay=0.05 (x1): head.fc.{weight, bias}']
    assert logged[1] == ('WARNING', '150 parameters have requires_grad=False and are not optimised: '
                                    'backbone.model.{cls_token, pos_embed}, backbone.model.patch_embed.'
                                    'proj.{weight, bias}, backbone.model.blocks.*.norm1.{weight, bias}, '
                                    'backbone.model.blocks.*.attn.qkv.{weight, bias}, backbone.model.blocks.*.attn.'
                                    'proj.{weight, bias}, backbone.model.blocks.*.norm2.{weight, bias}, '
                                    'backbone.model.blocks.*.mlp.fc1.{weight, bias}, backbone.model.blocks.*.mlp.fc2.'
                                    '{weight, bias}, backbone.model.norm.{weight, bias}')


# ---- mmengine's complexity tool, mmpretrain's get_model and inferencer ---------------------------


@pytest.mark.filterwarnings('ignore:`torch.jit.trace` is deprecated:FutureWarning')
def test_token_grid_takes_traced_sizes_and_refuses_non_integers():
    """Tracing (mmengine's complexity tool, torch.jit.trace) hands sizes as 0-dim int tensors."""
    def scaled(x):
        return x * TokenGrid(x.shape[-2], x.shape[-1]).num_grid_tokens
    with pytest.warns(torch.jit.TracerWarning):
        traced = torch.jit.trace(scaled, torch.ones(1, 2, 3))
    assert traced(torch.ones(1, 2, 3)).sum() == 36
    for bad in (14.0, torch.tensor(14.0), torch.tensor([14]), True):
        with pytest.raises(TypeError, match=r'TokenGrid.height must be an integer, got '):
            TokenGrid(bad, 3)


@pytest.mark.parametrize('config', SHAPES_CONFIGS)
def test_model_complexity_of_each_classification_config(config):
    from mmengine.analysis import get_model_complexity_info
    model = MODELS.build(Config.fromfile(REPO / 'configs' / config).model).eval()
    info = get_model_complexity_info(model, input_shape=(3, 64, 64))
    assert info['params'] == sum(p.numel() for p in model.parameters())
    assert info['flops'] > 0


@pytest.mark.parametrize('config', SHAPES_CONFIGS)
def test_get_model_and_the_inferencer_on_each_classification_config(config, tmp_path):
    from mmpretrain import ImageClassificationInferencer, get_model
    path = REPO / 'configs' / config
    trained = _randomised(get_model(str(path)), 3)
    checkpoint = tmp_path / 'classifier.pth'
    torch.save({'state_dict': trained.state_dict(), 'meta': {}}, checkpoint)
    model = get_model(Config.fromfile(path), pretrained=str(checkpoint))
    for key, value in model.state_dict().items():
        assert torch.equal(value, trained.state_dict()[key]), key
    image = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    result = ImageClassificationInferencer(model)(image)[0]
    assert result['pred_scores'].shape == (len(CLASSES),) and result['pred_class'] in CLASSES
    assert result['pred_class'] == CLASSES[int(result['pred_scores'].argmax())]
