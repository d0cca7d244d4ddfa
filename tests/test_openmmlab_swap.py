"""posattn.swap_attention on the OpenMMLab backbones (mmpretrain's and mmseg's ViTs, mmdet's Swin) and
PosattnSwappedBackbone: 'none' keeps every output, every Φp trains, refusals name the reason; the
wrapper loads the original weights, then swaps, at construction, and nothing re-initialises them
later; its checkpoints load back exactly; the configs in configs/swap/ build, and each embedded one
trains through tools/train.py (slow)."""
import copy
import sys

import pytest
import torch

from conftest import require_openmmlab

require_openmmlab()  # before the OpenMMLab imports

from mmengine.config import Config
from mmengine.registry import MODELS, DefaultScope
from mmengine.runner import load_checkpoint, save_checkpoint
from mmpretrain.models.backbones import DeiT3, DistilledVisionTransformer, ViTEVA02, VisionTransformer
from mmpretrain.models.selfsup.mae import MAEViT
from mmpretrain.models.utils import MultiheadAttention
from mmseg.models.backbones import VisionTransformer as SegViT
from torch import nn

import posattn
from conftest import REPO, assert_swap_keeps_outputs, assert_trains_with_every_phi, randomised, run_tool
from posattn.swap import SwappedAttention
from posattn_openmmlab.runner import load_model_weights
from posattn_openmmlab.swap_backbone import PosattnSwappedBackbone
from posattn_openmmlab.swap_vit import MMCVAttention, MMPretrainAttention
from test_openmmlab_detseg import short_options

SWAP_CONFIGS = REPO / 'configs' / 'swap'
ARCH = dict(embed_dims=32, num_layers=2, num_heads=2, feedforward_channels=64)
SMALL = dict(arch=ARCH, img_size=32, patch_size=8)  # mmpretrain's ViTs
SEG_SMALL = dict(img_size=32, patch_size=8, embed_dims=32, num_layers=2, num_heads=2)  # mmseg's
PRETRAIN_VIT = dict(type='mmpretrain.VisionTransformer', **SMALL)
SEG_VIT = dict(type='mmseg.VisionTransformer', **SEG_SMALL)
IMAGES = torch.randn(2, 3, 24, 40, generator=torch.Generator().manual_seed(0))  # a 3 x 5 grid of 8-pixel patches


def in_container(backbone):
    """The backbones' train() returns None; swap_attention finds them inside any module."""
    return nn.Sequential(backbone)


def swin_family():
    """The OpenMMLab Swin families, a module of its own that registers itself with posattn_openmmlab."""
    return pytest.importorskip('posattn_openmmlab.swap_swin',
                               reason="the OpenMMLab SwinTransformer families (posattn_openmmlab.swap_swin) are absent")


# ---------------------------------------------------------------- the families

FAMILIES = {  # name: (builder, the adapter, prefix tokens)
    'mmpretrain ViT, featmaps of both layers': (
        lambda: VisionTransformer(**SMALL, out_indices=(0, 1), out_type='featmap'), MMPretrainAttention, 1),
    'mmpretrain DeiT distilled, all tokens': (
        lambda: DistilledVisionTransformer(**SMALL, out_type='raw'), MMPretrainAttention, 2),
    'mmpretrain DeiT III, layer scale, all tokens': (
        lambda: DeiT3(**SMALL, out_type='raw'), MMPretrainAttention, 1),
    'mmpretrain ViT without class token': (
        lambda: VisionTransformer(**SMALL, with_cls_token=False, out_type='avg_featmap'), MMPretrainAttention, 0),
    'mmseg ViT, final norm, both layers': (
        lambda: SegViT(**SEG_SMALL, out_indices=(0, 1), final_norm=True, output_cls_token=True), MMCVAttention, 1),
    'mmseg ViT without class token or qkv bias': (
        lambda: SegViT(**SEG_SMALL, with_cls_token=False, qkv_bias=False), MMCVAttention, 0),
}


@pytest.mark.parametrize('name', FAMILIES)
def test_none_keeps_the_outputs_on_a_non_square_input(name):
    build, adapter, prefix_tokens = FAMILIES[name]
    swapped = assert_swap_keeps_outputs(in_container(build()), IMAGES)[0]
    layers = [layer.attn for layer in swapped.layers]
    assert all(type(layer) is adapter for layer in layers) and len(layers) == 2
    assert layers[1].num_prefix_tokens == prefix_tokens
    assert layers[1].current_grid() == posattn.TokenGrid(3, 5, prefix_tokens)


@pytest.mark.parametrize('name', FAMILIES)
def test_every_phi_trains(name):
    build = FAMILIES[name][0]
    # randomised: DeiT III's layer scale starts at 1e-5, where the Φp gradients underflow
    assert_trains_with_every_phi(lambda: randomised(in_container(build())), IMAGES)


def test_mmpretrain_names_stay_and_mmseg_projections_become_qkv_and_proj():
    """The same tensors and dropout modules move in; the probability of attention dropout too."""
    model = VisionTransformer(**SMALL, drop_rate=0.1, drop_path_rate=0.3, layer_cfgs=dict(attn_drop_rate=0.2))
    names, old = set(model.state_dict()), model.layers[1].attn
    posattn.swap_attention(model, phi='none')
    new = model.layers[1].attn
    assert set(model.state_dict()) == names and new.qkv.weight is old.qkv.weight
    assert (new.proj_drop, new.out_drop, new.attn_drop.p) == (old.proj_drop, old.out_drop, 0.2)

    model = SegViT(**SEG_SMALL, drop_rate=0.1, attn_drop_rate=0.2, drop_path_rate=0.3)
    old = model.layers[1].attn
    in_proj, out_proj = old.attn.in_proj_weight, old.attn.out_proj.weight
    posattn.swap_attention(model, phi='none')
    new = model.layers[1].attn
    assert new.qkv.weight is in_proj and new.proj.weight is out_proj
    assert (new.proj_drop, new.dropout_layer, new.attn_drop.p) == (old.proj_drop, old.dropout_layer, 0.2)
    assert 'layers.1.attn.qkv.weight' in model.state_dict() and 'layers.1.attn.attn.in_proj_weight' not in model.state_dict()


@pytest.mark.parametrize('build', [lambda: VisionTransformer(**SMALL), lambda: SegViT(**SEG_SMALL)])
def test_own_positions_false_zeroes_and_freezes_the_position_embedding(build):
    model = randomised(in_container(build()))[0]
    posattn.swap_attention(model, phi='peripheral', own_positions=False)
    assert not model.pos_embed.requires_grad and not model.pos_embed.any()


def test_refusals_name_the_reason_and_leave_the_model_as_it_was():
    for attn, error, reason in [
            (MultiheadAttention(32, 2, v_shortcut=True), ValueError, r'adds its values to the output \(v_shortcut'),
            (MultiheadAttention(32, 2, input_dims=16), ValueError, r'projects 16 input channels to 32'),
            (MultiheadAttention(32, 2, qk_scale=0.5), ValueError, r'built with qk_scale.*qk_scale=None'),
            (nn.Identity(), TypeError, r"layer 1 \(mmpretrain.*TransformerEncoderLayer\) holds "
                                       r"torch.nn.modules.linear.Identity, not mmpretrain's MultiheadAttention")]:
        model = VisionTransformer(**SMALL)
        model.layers[1].attn = attn
        with pytest.raises(error, match=reason):
            posattn.swap_attention(model)
        assert type(model.layers[0].attn) is MultiheadAttention and not model.patch_embed.projection._forward_hooks
    with pytest.raises(TypeError, match=r'holds mmpretrain.models.backbones.vit_eva02.AttentionWithRoPE'):
        posattn.swap_attention(ViTEVA02(**SMALL))
    with pytest.raises(TypeError, match=r'MAEViT: it drops the masked patches in its forward'):
        posattn.swap_attention(MAEViT(**SMALL))

    model = SegViT(**SEG_SMALL)
    model.layers[0].attn.batch_first = False
    with pytest.raises(TypeError, match='layer 0 of .* is not batch-first self-attention'):
        posattn.swap_attention(model)
    model = posattn.swap_attention(SegViT(**SEG_SMALL))
    model(IMAGES)
    tokens = torch.randn(2, 16, 32)
    with pytest.raises(ValueError, match=r"takes no positional inputs or masks .*got \['attn_mask'\]"):
        model.layers[0].attn(tokens, attn_mask=torch.zeros(16, 16))
    with pytest.raises(ValueError, match='key and value must be None or the query'):
        model.layers[0].attn(tokens, key=torch.randn(2, 16, 32))


def test_mmdet_swin_none_keeps_the_outputs_and_every_phi_trains():
    swin_family()
    from mmdet.models.backbones import SwinTransformer

    def build():
        return SwinTransformer(pretrain_img_size=32, embed_dims=32, depths=(2, 2), num_heads=(2, 4), window_size=4,
                               strides=(4, 2), out_indices=(0, 1), drop_path_rate=0.0)
    images = torch.randn(2, 3, 40, 56)  # a 10 x 14 grid: padded windows
    swapped = assert_swap_keeps_outputs(in_container(build()), images)
    assert sum(isinstance(m, SwappedAttention) for m in swapped.modules()) == 4
    assert_trains_with_every_phi(lambda: randomised(in_container(build())), images)


@pytest.mark.parametrize('library', ['mmdet', 'mmseg', 'mmpretrain'])
def test_openmmlab_swin_own_tables_become_rpb_with_the_outputs(library):
    """phi='own': each window attention's table is its Φp's (rpb, the same Parameter), float64 outputs kept."""
    swin_family()
    from mmdet.models.backbones import SwinTransformer as DetSwin
    from mmpretrain.models import SwinTransformer as PretrainSwin
    from mmseg.models.backbones import SwinTransformer as SegSwin
    from posattn.phi.rpb import RelativePositionBias
    if library == 'mmpretrain':
        model = PretrainSwin(arch=dict(embed_dims=32, depths=[2, 2], num_heads=[2, 4]), img_size=32, window_size=4,
                             out_indices=(0, 1), drop_path_rate=0.0)
    else:
        model = (DetSwin if library == 'mmdet' else SegSwin)(
            pretrain_img_size=32, embed_dims=32, depths=(2, 2), num_heads=(2, 4), window_size=4, strides=(4, 2),
            out_indices=(0, 1), drop_path_rate=0.0)
    model = randomised(in_container(model)).double()
    tables = [p for name, p in model.named_parameters() if name.endswith('relative_position_bias_table')]
    with torch.no_grad():
        for table in tables:
            table.mul_(40)  # as large as trained tables
    swapped = posattn.swap_attention(copy.deepcopy(model), phi='own')
    layers = [m for m in swapped.modules() if isinstance(m, SwappedAttention)]
    assert len(layers) == 4 and all(isinstance(layer.phi, RelativePositionBias) for layer in layers)
    images = torch.randn(2, 3, 40, 56, dtype=torch.float64)  # padded windows
    with torch.no_grad():
        for got, expected in zip(swapped(images), model(images)):
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    swapped.load_state_dict(model.state_dict())  # the model's own weights load strictly


# ---------------------------------------------------------------- PosattnSwappedBackbone


def saved_weights(model, path):
    """Random weights (no value left at an initialisation) saved to ``path``; returns them."""
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()
    torch.save(model.state_dict(), path)
    return model.state_dict()


def wrapper_cfg(backbone, checkpoint=None, **options):
    init_cfg = dict(type='Pretrained', checkpoint=str(checkpoint)) if checkpoint else None
    return dict(type='PosattnSwappedBackbone', backbone=dict(backbone, init_cfg=init_cfg), **options)


@pytest.mark.parametrize('inner,renamed', [
    (PRETRAIN_VIT, {}),
    (SEG_VIT, {'attn.qkv.weight': 'attn.attn.in_proj_weight', 'attn.qkv.bias': 'attn.attn.in_proj_bias',
               'attn.proj.': 'attn.attn.out_proj.'}),
])
def test_wrapper_loads_the_checkpoint_then_swaps_at_construction(inner, renamed, tmp_path):
    original = MODELS.build(dict(inner))
    weights = saved_weights(original, tmp_path / 'original.pth')
    wrapper = MODELS.build(wrapper_cfg(inner, tmp_path / 'original.pth', phi='peripheral'))
    assert isinstance(wrapper, PosattnSwappedBackbone)
    assert all(isinstance(layer.attn, SwappedAttention) for layer in wrapper.backbone.layers)
    state = wrapper.state_dict()
    phi_keys = {key for key in state if '.attn.phi.' in key}
    assert phi_keys and all(key.startswith('backbone.') for key in state)
    for key, value in state.items():
        if key not in phi_keys:
            for new, old in renamed.items():
                key = key.replace(new, old)
            torch.testing.assert_close(value, weights[key[len('backbone.'):]], rtol=0, atol=0, msg=key)

    # the optimiser, built before init_weights, holds the Φp parameters
    optimised = {id(p) for p in wrapper.parameters()}
    assert all(id(p) in optimised for layer in wrapper.backbone.layers for p in layer.attn.phi.parameters())
    wrapper.init_weights()
    assert wrapper.is_init
    assert all(torch.equal(value, state[key]) for key, value in wrapper.state_dict().items())
    with torch.no_grad():
        outputs = wrapper(IMAGES)
    assert isinstance(outputs, tuple) and outputs[-1].shape[0] == 2


@pytest.mark.parametrize('phi', sorted(set(posattn.list_phis()) - {'none', 'peripheral', 'irpe', 'peg'}))
def test_wrapper_swaps_in_each_later_phi_and_trains_it(phi):
    """rope, rpb, alibi, gpsa, decomposed_rpb (and any Φp registered later) through the config wrapper:
    built, called on a non-square grid, and a backward reaches the Φp of every layer."""
    wrapper = MODELS.build(wrapper_cfg(dict(PRETRAIN_VIT, out_type='featmap'), phi=phi)).train()  # every token
    layers = [layer.attn for layer in wrapper.backbone.layers]
    assert all(isinstance(layer, SwappedAttention) and type(layer.phi) is posattn.phi.phi_class(phi) for layer in layers)
    randomised(wrapper)  # tables that start at zero: every term counts
    sum(out.square().mean() for out in wrapper(IMAGES)).backward()
    for layer in layers:  # (gpsa's pos_proj bias has no gradient, and resampling reads some table rows only)
        grads = [p.grad for p in layer.phi.parameters()]  # none for alibi and axial rope
        assert all(g is not None for g in grads) and (not grads or sum(g.abs().sum() for g in grads) > 0)


def test_the_model_around_the_wrapper_initialises_its_head_and_leaves_the_backbone(tmp_path):
    from mmpretrain.registry import MODELS as PRETRAIN_MODELS
    saved_weights(MODELS.build(dict(PRETRAIN_VIT)), tmp_path / 'vit.pth')
    classifier = dict(type='ImageClassifier', backbone=wrapper_cfg(PRETRAIN_VIT, tmp_path / 'vit.pth'), neck=None,
                      head=dict(type='LinearClsHead', num_classes=3, in_channels=32,
                                init_cfg=dict(type='Constant', layer='Linear', val=0.5)))
    model = PRETRAIN_MODELS.build(classifier)
    backbone = copy.deepcopy(model.backbone.state_dict())
    model.init_weights()
    assert all(torch.equal(value, backbone[key]) for key, value in model.backbone.state_dict().items())
    assert (model.head.fc.weight == 0.5).all()

    model = PRETRAIN_MODELS.build(dict(classifier, init_cfg=dict(type='TruncNormal', layer='Linear', std=0.02)))
    with pytest.raises(RuntimeError, match=r"16 weights of the VisionTransformer loaded from .*vit.pth were written "
                                           r"again .*set model.init_cfg=None.*Changed: backbone.layers.0.attn.qkv"):
        model.init_weights()


def test_wrapper_passes_train_norm_eval_and_frozen_stages_through():
    wrapper = MODELS.build(wrapper_cfg(dict(SEG_VIT, norm_eval=True, out_indices=(0, 1)), phi='none'))
    wrapper.train()
    norms = [m for m in wrapper.modules() if isinstance(m, nn.LayerNorm)]
    assert norms and not any(m.training for m in norms) and wrapper.backbone.layers[0].attn.training
    assert len(wrapper(IMAGES)) == 2

    wrapper = MODELS.build(wrapper_cfg(dict(PRETRAIN_VIT, frozen_stages=1), phi='peripheral'))
    frozen = wrapper.backbone.layers[0]
    assert not any(p.requires_grad for name, p in frozen.named_parameters() if '.phi.' not in name)
    assert all(p.requires_grad for p in frozen.attn.phi.parameters())  # new, so trained in every layer


def test_wrapper_swaps_a_timm_model_inside_timm_backbone(tmp_path):
    timm = pytest.importorskip('timm')
    options = dict(model_name='vit_tiny_patch16_224', img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)
    original = timm.create_model(**options)
    weights = saved_weights(original, tmp_path / 'timm.pth')
    wrapper = MODELS.build(dict(type='PosattnSwappedBackbone', phi='irpe',
                                backbone=dict(type='mmpretrain.TIMMBackbone', checkpoint_path=str(tmp_path / 'timm.pth'),
                                              **options)))
    model = wrapper.backbone.timm_model
    assert all(isinstance(block.attn, SwappedAttention) for block in model.blocks)
    assert torch.equal(model.blocks[1].attn.qkv.weight, weights['blocks.1.attn.qkv.weight'])
    backbone = copy.deepcopy(wrapper.state_dict())
    wrapper.init_weights()  # timm loaded the weights: nothing may overwrite them
    assert all(torch.equal(value, backbone[key]) for key, value in wrapper.state_dict().items())


def test_wrapper_errors_say_what_to_set(tmp_path):
    missing = str(tmp_path / 'nowhere.pth')
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at '.*nowhere.pth' for the mmseg.VisionTransformer "
                                                r"backbone's Pretrained init_cfg.*model.backbone.backbone.init_cfg=None"):
        MODELS.build(wrapper_cfg(SEG_VIT, missing))
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at '.*nowhere.pth'"):  # mmseg's own way to name it
        MODELS.build(dict(type='PosattnSwappedBackbone', backbone=dict(SEG_VIT, pretrained=missing)))
    with pytest.raises(ValueError, match=r"pretrained='.*nowhere.pth'.*set model.pretrained=None and the inner "
                                         r"backbone's init_cfg=dict\(type='Pretrained'"):
        MODELS.build(wrapper_cfg(SEG_VIT, pretrained=missing))
    with pytest.raises(TypeError, match=r"Φp 'irpe' got unknown option\(s\) 'methd' \(did you mean 'method'\?\)"):
        MODELS.build(wrapper_cfg(SEG_VIT, phi='irpe', phi_cfg=dict(methd='euc')))


def test_a_checkpoint_of_a_swapped_model_loads_back_exactly(tmp_path):
    """What --resume and tools/test.py do with a checkpoint of the swapped classifier: strict,
    through mmengine's save / load and through PosattnRunner's loader."""
    from mmpretrain.registry import MODELS as PRETRAIN_MODELS
    cfg = dict(type='ImageClassifier', backbone=wrapper_cfg(PRETRAIN_VIT, phi='peripheral'), neck=None,
               head=dict(type='LinearClsHead', num_classes=3, in_channels=32))
    trained = randomised(PRETRAIN_MODELS.build(cfg))
    path = str(tmp_path / 'swapped.pth')
    save_checkpoint({'state_dict': trained.state_dict(), 'meta': {}}, path)
    for load in (lambda model: load_checkpoint(model, path, strict=True),
                 lambda model: load_model_weights(model, torch.load(path, weights_only=True), source=path,
                                                  target='the swapped classifier')):
        torch.manual_seed(1)
        model = PRETRAIN_MODELS.build(cfg).eval()
        load(model)
        assert model.state_dict().keys() == trained.state_dict().keys()
        assert all(torch.equal(value, trained.state_dict()[key]) for key, value in model.state_dict().items())
        with torch.no_grad():
            torch.testing.assert_close(model(IMAGES, mode='tensor'), trained(IMAGES, mode='tensor'), rtol=0, atol=0)
    other = PRETRAIN_MODELS.build(dict(cfg, backbone=wrapper_cfg(PRETRAIN_VIT, phi='irpe')))
    with pytest.raises(ValueError, match=r'missing keys .*backbone.backbone.layers.0.attn.phi'):
        load_model_weights(other, torch.load(path, weights_only=True), source=path, target='a classifier with iRPE')


# ---------------------------------------------------------------- configs/swap


REAL = ['deit-s_peripheral_imagenet.py', 'upernet_vit-b16_peripheral_512x512_160k_ade20k.py',
        'mask-rcnn_swin-t_peripheral_fpn_1x_coco.py']
EMBEDDED = ['deit-s_peripheral_shapes.py', 'upernet_vit_peripheral_shapes.py', 'mask-rcnn_swin-t_peripheral_shapes.py']
# tools/compare_phis.py --experiment swap (tested with the tool): DeiT-T, then a fine-tune per Φp
EXPERIMENT = ['deit-t_shapes.py', 'deit-t_finetune_shapes.py',
              *(f'deit-t_finetune-{phi}_shapes.py' for phi in ('none', 'peg', 'irpe', 'peripheral'))]


def config(name):
    return Config.fromfile(SWAP_CONFIGS / name)


def build_in_scope(cfg, model_cfg):
    with DefaultScope.overwrite_default_scope(cfg.default_scope):
        return MODELS.build(model_cfg)


def test_every_swap_config_is_listed_here_and_wraps_its_toolbox_backbone():
    assert sorted(p.name for p in SWAP_CONFIGS.glob('*.py')) == sorted(REAL + EMBEDDED + EXPERIMENT)
    for name in EXPERIMENT:
        cfg = config(name)
        assert (cfg.runner_type, cfg.default_hooks.checkpoint.type, cfg.partial_load) == \
            ('PosattnRunner', 'SafeCheckpointHook', False), name
    for real, embedded in zip(REAL, EMBEDDED):
        pair = config(real), config(embedded)
        for name, cfg in zip((real, embedded), pair):
            assert (cfg.runner_type, cfg.default_hooks.checkpoint.type, cfg.partial_load) == \
                ('PosattnRunner', 'SafeCheckpointHook', False), name
            assert 'posattn_openmmlab' in cfg.custom_imports.imports
            assert (cfg.model.backbone.type, cfg.model.backbone.phi) == ('PosattnSwappedBackbone', 'peripheral'), name
        assert pair[0].model.backbone.backbone.type == pair[1].model.backbone.backbone.type
        init_cfg = pair[0].model.backbone.backbone.init_cfg
        assert init_cfg.type == 'Pretrained' and init_cfg.checkpoint.startswith('checkpoints/')  # never a download
        assert pair[1].model.backbone.backbone.get('init_cfg') is None


def test_deit_config_starts_backbone_and_head_from_one_mmpretrain_checkpoint(tmp_path):
    from mmpretrain.registry import MODELS as PRETRAIN_MODELS
    cfg = config(REAL[0])
    with pytest.raises(FileNotFoundError, match="no checkpoint at 'checkpoints/deit-small_pt-4xb256_in1k.pth'"):
        PRETRAIN_MODELS.build(cfg.model)
    release = VisionTransformer(arch='deit-small', img_size=224, patch_size=16)
    head = nn.Linear(384, 1000)
    with torch.no_grad():
        for param in [*release.parameters(), *head.parameters()]:
            param.normal_()
    checkpoint = {'state_dict': {**{f'backbone.{k}': v for k, v in release.state_dict().items()},
                                 'head.layers.head.weight': head.weight, 'head.layers.head.bias': head.bias}}
    path = str(tmp_path / 'deit-small.pth')
    torch.save(checkpoint, path)
    cfg.model.backbone.backbone.init_cfg.checkpoint = cfg.model.head.init_cfg.checkpoint = path
    model = PRETRAIN_MODELS.build(cfg.model)
    model.init_weights()
    loaded = model.backbone.backbone.state_dict()
    assert all(torch.equal(loaded[key], value) for key, value in release.state_dict().items())
    assert torch.equal(model.head.layers.head.weight, head.weight)
    with torch.no_grad():
        assert model(torch.randn(1, 3, 96, 128), mode='tensor').shape == (1, 1000)


@pytest.mark.parametrize('name', REAL[1:])
def test_dense_configs_build_their_wrapped_backbone(name):
    cfg = config(name)
    with pytest.raises(FileNotFoundError, match=f"no checkpoint at '{cfg.model.backbone.backbone.init_cfg.checkpoint}'"):
        build_in_scope(cfg, cfg.model.backbone)
    if 'swin' in name:
        swin_family()
    cfg.model.backbone.backbone.init_cfg = None
    torch.manual_seed(0)
    wrapper = build_in_scope(cfg, cfg.model.backbone)
    assert sum(isinstance(m, SwappedAttention) for m in wrapper.modules()) == 12
    with torch.no_grad():
        maps = wrapper(torch.randn(1, 3, 64, 96))
    assert len(maps) == 4


@pytest.mark.slow
def test_embedded_classification_config_trains_and_tools_test_loads_its_checkpoint(tmp_path):
    short = ['train_cfg.max_epochs=1', 'train_dataloader.dataset.num_images=16', 'train_dataloader.batch_size=8',
             'val_dataloader.dataset.num_images=8', 'default_hooks.logger.interval=1']
    config_path = f'configs/swap/{EMBEDDED[0]}'
    output = run_tool(sys.executable, 'tools/train.py', config_path, '--work-dir', str(tmp_path / 'work'),
                      '--cfg-options', *short, timeout=600)
    assert 'Epoch(train) [1][2/2]' in output
    checkpoint = tmp_path / 'work' / 'epoch_1.pth'
    output = run_tool(sys.executable, 'tools/test.py', config_path, str(checkpoint), '--work-dir',
                      str(tmp_path / 'test'), '--cfg-options', 'test_dataloader.dataset.num_images=8', timeout=600)
    assert f'Load checkpoint from {checkpoint}' in output and 'accuracy/top1: ' in output


@pytest.mark.slow
@pytest.mark.parametrize('name', EMBEDDED[1:])
def test_embedded_dense_config_trains(name, tmp_path):
    if 'swin' in name:
        swin_family()
    options = short_options(tmp_path / 'shapes', detection=name.startswith('mask-rcnn'))  # 4 iterations, 6 images
    output = run_tool(sys.executable, 'tools/train.py', f'configs/swap/{name}', '--work-dir', str(tmp_path / 'work'),
                      '--cfg-options', *options, timeout=900)
    assert 'Iter(train) [4/4]' in output and (tmp_path / 'work' / 'iter_4.pth').is_file()
