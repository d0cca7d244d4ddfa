"""Mask R-CNN and UPerNet with PerViT backbones: the generated dense shapes set, the configs
(build, forward + backward on a non-square input), missing-data and missing-checkpoint errors,
ImageNet initialisation from a release-layout checkpoint, and a few iterations of each embedded
config through tools/train.py and tools/test.py."""
import json
import logging
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import require_openmmlab

require_openmmlab()  # before the OpenMMLab imports

from mmengine.config import Config
from mmengine.registry import DefaultScope
from pycocotools import mask as mask_utils

import posattn
import posattn_openmmlab  # noqa: F401
import posattn_openmmlab.backbones as backbones
import posattn_openmmlab.detection  # noqa: F401
import posattn_openmmlab.segmentation  # noqa: F401
from posattn_openmmlab.dense_shapes_dataset import ensure_dense_shapes
from conftest import REPO, run_tool
from release_pervit import ReleasePerViT


DETECTION = ['mask-rcnn_pervit-t_fpn_1x_coco.py', 'mask-rcnn_pervit-s_fpn_1x_coco.py']
SEGMENTATION = ['upernet_pervit-t_512x512_160k_ade20k.py', 'upernet_pervit-s_512x512_160k_ade20k.py']
SMALL_SET = dict(img_size=(64, 96), sizes=dict(train=6, val=3), seed=5)


def config(name):
    return Config.fromfile(REPO / 'configs' / name)


def build_model(cfg):
    """The config's model, built in its toolbox's scope (restored afterwards: other test files
    build in mmpretrain's)."""
    if cfg.default_scope == 'mmdet':
        from mmdet.registry import MODELS
    else:
        from mmseg.registry import MODELS
    with DefaultScope.overwrite_default_scope(cfg.default_scope):
        return MODELS.build(cfg.model)


# ---------------------------------------------------------------- the generated set


def test_dense_shapes_are_deterministic_and_both_label_formats_agree(tmp_path):
    first = ensure_dense_shapes(tmp_path / 'a', **SMALL_SET)
    second = ensure_dense_shapes(tmp_path / 'b', **SMALL_SET)
    files = sorted(p.relative_to(first) for p in first.rglob('*') if p.is_file())
    assert len(files) == 2 * (6 + 3) + 2 + 1  # images and masks, two COCO files, meta.json
    assert all((first / f).read_bytes() == (second / f).read_bytes() for f in files)

    coco = json.loads((first / 'annotations' / 'instances_val.json').read_text())
    assert [c['name'] for c in coco['categories']] == ['circle', 'square', 'triangle']
    for image in coco['images']:
        labels = np.array(Image.open(first / 'masks' / 'val' / image['file_name']))
        assert labels.shape == (64, 96)
        rebuilt = np.zeros_like(labels)
        objects = [a for a in coco['annotations'] if a['image_id'] == image['id']]
        assert 2 <= len(objects) <= 5
        for annotation in objects:
            rle = dict(annotation['segmentation'], counts=annotation['segmentation']['counts'].encode())
            mask = mask_utils.decode(rle).astype(bool)
            assert not rebuilt[mask].any()  # shapes do not overlap
            rebuilt[mask] = annotation['category_id']
            ys, xs = np.nonzero(mask)
            x, y, w, h = annotation['bbox']
            assert (x, y, x + w, y + h) == (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1)
            assert annotation['area'] == mask.sum()
        np.testing.assert_array_equal(rebuilt, labels)


def test_dense_shapes_never_overwrite_a_different_folder(tmp_path):
    root = ensure_dense_shapes(tmp_path / 'set', **SMALL_SET)
    before = {p: p.read_bytes() for p in root.rglob('*') if p.is_file()}
    with pytest.raises(FileExistsError, match='does not hold the shapes set this config asks for'):
        ensure_dense_shapes(root, **dict(SMALL_SET, seed=6))
    (tmp_path / 'mine').mkdir()
    (tmp_path / 'mine' / 'notes.txt').write_text('keep me')
    with pytest.raises(FileExistsError, match='no meta.json: not a generated set'):
        ensure_dense_shapes(tmp_path / 'mine', **SMALL_SET)
    assert {p: p.read_bytes() for p in root.rglob('*') if p.is_file()} == before
    assert (tmp_path / 'mine' / 'notes.txt').read_text() == 'keep me'
    with pytest.raises(ValueError, match='sizes needs a positive image count'):
        ensure_dense_shapes(tmp_path / 'other', sizes=dict(train=4))


# ---------------------------------------------------------------- configs


def test_dense_configs_use_the_toolboxes_models_with_the_pervit_backbone():
    for name in DETECTION + ['mask-rcnn_pervit-t_shapes.py']:
        cfg = config(name)
        assert cfg.default_scope == 'mmdet' and cfg.model.type == 'MaskRCNN'
        assert cfg.model.backbone.type == 'PosattnPerViT' and cfg.model.neck.type == 'PosattnSimpleFPN'
        assert (cfg.model.backbone.window_size, cfg.model.backbone.global_blocks) == (14, (3, 7, 11))
        assert cfg.model.neck.num_outs == 5
    for name in SEGMENTATION + ['upernet_pervit-t_shapes.py']:
        cfg = config(name)
        assert cfg.default_scope == 'mmseg' and cfg.model.type == 'EncoderDecoder'
        assert cfg.model.decode_head.type == 'UPerHead' and cfg.model.neck.num_outs == 4
    for name in DETECTION + SEGMENTATION:
        cfg = config(name)
        assert cfg.optim_wrapper.optimizer.type == 'AdamW'
        assert cfg.model.backbone.init_cfg.type == 'Pretrained'
    assert config(DETECTION[0]).train_cfg.max_epochs == 12
    assert config(SEGMENTATION[0]).train_cfg.max_iters == 160000
    assert config(SEGMENTATION[0]).model.data_preprocessor.size == (512, 512)
    small = config(DETECTION[1]).model
    assert (small.backbone.arch, small.backbone.init_cfg.checkpoint, small.neck.in_channels) == (
        'small', 'checkpoints/pervit_small.pth', 464)


@pytest.mark.slow
@pytest.mark.parametrize('name', DETECTION)
def test_detector_forward_backward_at_320x480(name):
    from mmdet.testing import demo_mm_inputs
    cfg = config(name)
    cfg.model.backbone.init_cfg = None
    torch.manual_seed(0)
    model = build_model(cfg).train()
    batch = demo_mm_inputs(batch_size=2, image_shapes=[(3, 320, 480)] * 2, num_items=[3, 2],
                           num_classes=80, with_mask=True)
    data = model.data_preprocessor(batch, True)
    assert data['inputs'].shape == (2, 3, 320, 480)  # already a multiple of 32
    losses = model.loss(data['inputs'], data['data_samples'])
    assert {'loss_rpn_cls', 'loss_cls', 'loss_bbox', 'loss_mask'} <= set(losses)
    total = sum(v for key, value in losses.items() if 'loss' in key
                for v in (value if isinstance(value, list) else [value]))
    total.backward()
    assert torch.isfinite(total)
    backbone_grads = [p.grad for p in model.backbone.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in backbone_grads)
    model.eval()
    with torch.no_grad():
        results = model.predict(data['inputs'], data['data_samples'])
    assert len(results) == 2 and results[0].pred_instances.masks.shape[-2:] == (320, 480)


@pytest.mark.slow
@pytest.mark.parametrize('name', SEGMENTATION)
def test_segmenter_forward_backward_at_320x480(name):
    from mmengine.structures import PixelData
    from mmseg.structures import SegDataSample
    cfg = config(name)
    cfg.model.backbone.init_cfg = None
    cfg.model.data_preprocessor.size = None  # the 512 x 512 crop pads; test the input size as given
    torch.manual_seed(0)
    model = build_model(cfg).train()
    samples = []
    for _ in range(2):
        sample = SegDataSample(metainfo=dict(img_shape=(320, 480), ori_shape=(320, 480), pad_shape=(320, 480)))
        sample.gt_sem_seg = PixelData(data=torch.randint(0, 150, (1, 320, 480)))
        samples.append(sample)
    inputs = torch.randn(2, 3, 320, 480)
    losses = model.loss(inputs, samples)
    assert {'decode.loss_ce', 'aux.loss_ce'} <= set(losses)
    total = sum(v for key, v in losses.items() if 'loss' in key)
    total.backward()
    assert torch.isfinite(total)
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for p in model.backbone.parameters() if p.requires_grad)
    model.eval()
    with torch.no_grad():
        logits = model(inputs, mode='tensor')
    assert logits.shape == (2, 150, 80, 120)  # UPerNet predicts at stride 4


# ---------------------------------------------------------------- errors and initialisation


def test_missing_coco_and_ade_say_where_and_name_the_embedded_config(tmp_path):
    for name, embedded, where in [(DETECTION[0], 'configs/mask-rcnn_pervit-t_shapes.py', 'annotations/instances_train2017.json'),
                                  (SEGMENTATION[0], 'configs/upernet_pervit-t_shapes.py', 'images/training')]:
        cfg = config(name)
        from mmengine.registry import DATASETS
        dataset = dict(cfg.train_dataloader.dataset, data_root=str(tmp_path / 'nowhere'))
        with pytest.raises(FileNotFoundError) as error, DefaultScope.overwrite_default_scope(cfg.default_scope):
            DATASETS.build(dataset)
        message = str(error.value)
        assert str(tmp_path / 'nowhere') in message and where in message
        assert f'python tools/train.py {embedded}' in message and '--cfg-options' in message


def test_missing_pretrained_checkpoint_says_what_to_do():
    cfg = config(DETECTION[0])
    model = build_model(cfg)
    with pytest.raises(FileNotFoundError, match=r"no pretrained checkpoint at 'checkpoints/pervit_tiny.pth'.*"
                                                r"model.backbone.init_cfg=None"):
        model.init_weights()


def test_release_checkpoint_initialises_every_backbone_weight_and_warns_only_about_the_head(tmp_path, monkeypatch):
    torch.manual_seed(1)
    release = ReleasePerViT('tiny')
    with torch.no_grad():  # no value left equal to an initialisation (norms start at 1 and 0, BN stats too)
        for key, value in release.state_dict().items():
            if value.is_floating_point():
                value.copy_(torch.rand_like(value) + 0.5 if 'running_var' in key else torch.randn_like(value))
    path = tmp_path / 'pervit_tiny.pth'
    torch.save({'model': release.state_dict(), 'epoch': 299}, path)
    expected = posattn.create_model('pervit_tiny', checkpoint=path).state_dict()

    logged = []
    monkeypatch.setattr(backbones, 'print_log', lambda message, logger=None, level=None: logged.append((message, level)))
    cfg = config(DETECTION[0])
    cfg.model.backbone.init_cfg.checkpoint = str(path)
    detector = build_model(cfg)
    detector.init_weights()
    loaded = detector.backbone.model.state_dict()
    assert set(loaded) == set(expected) - {'head.weight', 'head.bias'}
    for key, value in loaded.items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=key)
    warnings = [message for message, level in logged if level == logging.WARNING]
    assert len(warnings) == 1, logged
    assert warnings[0].endswith('not loaded, the classifier: head.bias, head.weight')


# ---------------------------------------------------------------- tools/train.py and tools/test.py


def short_options(data_root, detection):
    """--cfg-options for a tiny set in data_root, four iterations, one validation and checkpoint."""
    options = ['train_cfg.max_iters=4', 'train_cfg.val_interval=4', 'default_hooks.checkpoint.interval=4',
               'default_hooks.logger.interval=1', 'param_scheduler.0.end=2', 'param_scheduler.1.begin=2',
               'param_scheduler.1.end=4', 'train_dataloader.batch_size=2', 'val_dataloader.batch_size=2',
               'test_dataloader.batch_size=2']
    for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        dataset = f'{loader}.dataset'
        options += [f'{dataset}.data_root={data_root}/', f'{dataset}.img_size=[64,96]',
                    f'{dataset}.sizes.train=6', f'{dataset}.sizes.val=3']
        if detection:
            options.append(f'{loader}.dataset.pipeline.2.scale=(96,64)' if loader == 'train_dataloader'
                           else f'{loader}.dataset.pipeline.1.scale=(96,64)')
    if detection:
        for evaluator in ('val_evaluator', 'test_evaluator'):
            options.append(f'{evaluator}.ann_file={data_root}/annotations/instances_val.json')
    return options


@pytest.mark.slow
@pytest.mark.parametrize('name,metrics', [
    ('mask-rcnn_pervit-t_shapes.py', ['coco/bbox_mAP', 'coco/segm_mAP']),
    ('upernet_pervit-t_shapes.py', ['mIoU']),
])
def test_embedded_config_trains_and_tools_test_prints_the_toolbox_metrics(name, metrics, tmp_path):
    options = short_options(tmp_path / 'shapes', detection=name.startswith('mask-rcnn'))
    work_dir = tmp_path / 'work'
    output = run_tool(sys.executable, 'tools/train.py', f'configs/{name}', '--work-dir', str(work_dir),
                      '--cfg-options', *options, timeout=900)
    assert 'Iter(train) [4/4]' in output
    assert (tmp_path / 'shapes' / 'meta.json').is_file()
    checkpoint = work_dir / 'iter_4.pth'
    assert checkpoint.is_file() and f'Last checkpoint: {checkpoint}' in output
    assert all(f'{metric}: ' in output for metric in metrics)  # the closing summary of the validation
    assert 'tools/analyze.py' not in output  # the attention analysis is for classifiers

    out = tmp_path / 'metrics.json'
    output = run_tool(sys.executable, 'tools/test.py', f'configs/{name}', str(checkpoint), '--work-dir',
                      str(tmp_path / 'test'), '--out', str(out), '--cfg-options', *options, timeout=900)
    results = json.loads(out.read_text())
    for metric in metrics:
        assert metric in results and f'{metric}: ' in output
        assert 0 <= results[metric] <= 100
