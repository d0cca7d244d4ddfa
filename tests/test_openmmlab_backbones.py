"""PosattnPerViT / PosattnViT as OpenMMLab backbones: registration, outputs, freezing, Pretrained."""
import argparse
import sys

import pytest
import torch

import posattn

from conftest import require_openmmlab

require_openmmlab()  # before the OpenMMLab imports

from posattn_openmmlab import PosattnPerViT, PosattnViT
from mmengine.registry import MODELS

from release_pervit import ReleasePerViT

IRPE_K = dict(method='product', mode='ctx', on='k', shared_head=True, ratio=1.9)


def test_registered_once_in_the_root_registry_and_seen_by_every_toolbox():
    from mmdet.registry import MODELS as MMDET_MODELS
    from mmpretrain.registry import MODELS as MMPRETRAIN_MODELS
    from mmseg.registry import MODELS as MMSEG_MODELS
    assert MODELS.get('PosattnPerViT') is PosattnPerViT and MODELS.get('PosattnViT') is PosattnViT
    for registry in (MMPRETRAIN_MODELS, MMDET_MODELS, MMSEG_MODELS):
        assert 'PosattnPerViT' not in registry.module_dict  # found through the parent, not copied
        assert registry.get('PosattnPerViT') is PosattnPerViT and registry.get('PosattnViT') is PosattnViT


def test_core_package_imports_nothing_from_openmmlab():
    import subprocess
    code = ('import sys, posattn; posattn.create_model("pervit_tiny"); '
            'bad = [m for m in sys.modules if m.split(".")[0] in ("mmengine", "mmcv", "mmpretrain", "mmdet", "mmseg")]; '
            'assert not bad, bad')
    subprocess.run([sys.executable, '-c', code], check=True)


def test_pervit_multi_scale_outputs_on_a_non_square_input():
    backbone = MODELS.build(dict(type='PosattnPerViT', arch='tiny', out_indices=(1, 3, 9, 11))).eval()
    images = torch.randn(2, 3, 96, 160)
    maps = backbone(images)
    assert [tuple(m.shape) for m in maps] == [(2, 192, 6, 10), (2, 224, 6, 10), (2, 280, 6, 10), (2, 280, 6, 10)]
    assert backbone.out_channels == [192, 224, 280, 280]
    reference = posattn.create_model('pervit_tiny', num_classes=0).eval()
    reference.load_state_dict(backbone.model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(maps[-1], reference.forward_features(images))
        torch.testing.assert_close(maps[0], reference.forward_intermediates(images, [1], intermediates_only=True)[0])


def test_pervit_arch_dict_and_bad_arguments():
    arch = dict(embed_dims=(32, 48), depths=(1, 1), num_heads=2, stem_dims=(8, 16))
    backbone = PosattnPerViT(arch=arch, out_indices=(0, -1))
    assert [tuple(m.shape) for m in backbone(torch.randn(1, 3, 32, 48))] == [(1, 48, 8, 12), (1, 48, 8, 12)]
    with pytest.raises(ValueError, match="unknown arch 'huge'"):
        PosattnPerViT(arch='huge')
    with pytest.raises(ValueError, match='an arch dict needs exactly the keys'):
        PosattnPerViT(arch=dict(embed_dims=(32,)))
    with pytest.raises(ValueError, match=r'out_indices \(12,\) must name blocks in 0..11'):
        PosattnPerViT(out_indices=12)
    with pytest.raises(ValueError, match='frozen_stages must be in -1..4'):
        PosattnPerViT(frozen_stages=5)


def test_pervit_frozen_stages_and_norm_eval():
    backbone = PosattnPerViT(arch='tiny', frozen_stages=2, norm_eval=True).train()
    model = backbone.model
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert all(n.startswith(('stem.', 'distance_embedding.', 'blocks.0.', 'blocks.1.', 'blocks.2.', 'blocks.3.'))
               for n in frozen)
    assert any(n.startswith('blocks.3.') for n in frozen) and all(p.requires_grad for p in model.blocks[4].parameters())
    assert not model.stem.training and not model.blocks[0].training and model.blocks[4].training
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    unfrozen = PosattnPerViT(arch='tiny', norm_eval=True).train()
    assert norms and all(not m.training for m in unfrozen.modules() if isinstance(m, torch.nn.BatchNorm2d))
    assert unfrozen.model.stem.layers[0].conv.weight.requires_grad


@pytest.mark.parametrize('kwargs,grid_tokens', [
    (dict(phi='none'), 1 + 6 * 10),
    (dict(phi='peripheral'), 1 + 6 * 10),
    (dict(phi='irpe', phi_cfg=IRPE_K), 1 + 6 * 10),
    (dict(pos_embed=False, peg_after=(0, 1, 2, 3, 4)), 1 + 6 * 10),
])
def test_vit_matches_posattn_model_with_any_phi(kwargs, grid_tokens):
    backbone = PosattnViT(arch='tiny', out_indices=(5, 11), out_type='featmap', **kwargs).eval()
    reference = posattn.create_model('vit_tiny', num_classes=0, **kwargs).eval()
    reference.load_state_dict(backbone.model.state_dict())
    images = torch.randn(2, 3, 96, 160)
    with torch.no_grad():
        middle, last = backbone(images)
        tokens = reference.forward_features(images)
    assert tokens.shape[1] == grid_tokens and middle.shape == last.shape == (2, 192, 6, 10)
    torch.testing.assert_close(last, tokens[:, 1:].transpose(1, 2).reshape(2, 192, 6, 10))
    backbone.out_type = 'cls_token'
    with torch.no_grad():
        torch.testing.assert_close(backbone(images)[-1], reference.forward_head(tokens))


def test_vit_frozen_stages_and_bad_arguments():
    backbone = PosattnViT(arch='tiny', frozen_stages=3, pos_embed=False, peg_after=(0, 4)).train()
    frozen = {n.split('.')[0] + ('.' + n.split('.')[1] if n.startswith(('blocks', 'pegs')) else '')
              for n, p in backbone.model.named_parameters() if not p.requires_grad}
    assert frozen == {'patch_embed', 'cls_token', 'blocks.0', 'blocks.1', 'blocks.2', 'pegs.0'}
    with pytest.raises(ValueError, match="out_type must be one of"):
        PosattnViT(out_type='tokens')
    with pytest.raises(ValueError, match="out_type='cls_token' needs the class token"):
        PosattnViT(class_token=False, global_pool='avg')


def test_pretrained_release_checkpoint_gives_create_model_logits(tmp_path):
    release = ReleasePerViT('tiny')
    with torch.no_grad():  # BatchNorm statistics other than the defaults, so that buffers matter too
        for module in release.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 1.5)
    path = tmp_path / 'pervit_tiny_release.pth'
    torch.save({'model': release.state_dict(), 'epoch': 299, 'args': argparse.Namespace(model='pervit_tiny')}, path)
    from mmpretrain.registry import MODELS as MMPRETRAIN_MODELS
    classifier = MMPRETRAIN_MODELS.build(dict(
        type='ImageClassifier',
        backbone=dict(type='PosattnPerViT', arch='tiny', init_cfg=dict(type='Pretrained', checkpoint=str(path))),
        neck=dict(type='GlobalAveragePooling'),
        head=dict(type='LinearClsHead', num_classes=1000, in_channels=280)))
    classifier.init_weights()
    reference = posattn.create_model('pervit_tiny', checkpoint=path).eval()
    classifier.head.fc.load_state_dict({'weight': reference.head.weight, 'bias': reference.head.bias})
    classifier.eval()
    images = torch.randn(2, 3, 112, 144)
    with torch.no_grad():
        torch.testing.assert_close(classifier(images, mode='tensor'), reference(images), rtol=0, atol=1e-5)


def test_pretrained_posattn_checkpoint_and_a_wrong_one(tmp_path):
    model = posattn.create_model('vit_tiny', phi='peripheral')
    path = tmp_path / 'vit.pth'
    torch.save(model.state_dict(), path)
    backbone = PosattnViT(arch='tiny', phi='peripheral', init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    backbone.init_weights()
    for key, value in backbone.model.state_dict().items():
        assert torch.equal(value, model.state_dict()[key]), key
    wrong = PosattnViT(arch='tiny', phi='none', init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    phi_keys = sum('.attn.phi.' in key for key in model.state_dict())
    with pytest.raises(ValueError, match=rf'posattn layout\) does not fit PosattnViT:\n  '
                                         rf'unexpected keys \({phi_keys}\): blocks.0.attn.phi.proj1_weight'):
        wrong.init_weights()
