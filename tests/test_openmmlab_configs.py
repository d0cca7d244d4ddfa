"""Every classification config in configs/ parses and builds; the embedded set; the ImageNet configs' missing-data error."""
import numpy as np
import pytest
import torch

from conftest import require_openmmlab

require_openmmlab()  # before the OpenMMLab imports

from mmengine.config import Config
from mmpretrain.registry import DATASETS, MODELS

import posattn_openmmlab  # noqa: F401
from posattn_openmmlab.shapes_dataset import CLASSES, PAIRS, SHAPES, render_shapes, shape_mask
from conftest import REPO


DENSE_PREFIXES = ('mask-rcnn_', 'upernet_')  # mmdet and mmseg configs: tests/test_openmmlab_detseg.py
ALL_CONFIGS = sorted(p.name for p in (REPO / 'configs').glob('*.py'))
CONFIGS = [name for name in ALL_CONFIGS if not name.startswith(DENSE_PREFIXES)]  # classification


def test_each_imagenet_row_has_an_embedded_counterpart_with_the_same_model():
    """Every Table 2 config for ImageNet has a *_shapes.py twin that builds the same backbone (up
    to the image size and the recipe's stochastic depth), so each row can be tried on the
    embedded set first."""
    rows = [name for name in CONFIGS if name.endswith('_imagenet.py') and name.startswith(('deit_t_', 'convit_t'))]
    assert rows
    for name in rows:
        twin = name.replace('_imagenet.py', '_shapes.py')
        assert twin in CONFIGS, f'{name} has no embedded counterpart {twin}'
        backbones = [dict(Config.fromfile(REPO / 'configs' / n).model.backbone) for n in (name, twin)]
        for backbone in backbones:
            for recipe_key in ('img_size', 'init_cfg', 'drop_path_rate'):
                backbone.pop(recipe_key, None)
        assert backbones[0] == backbones[1], name


def test_shapes_configs_share_one_budget_and_differ_only_in_the_model():
    shapes = [Config.fromfile(REPO / 'configs' / name) for name in CONFIGS if name.endswith('_shapes.py')]
    assert len(shapes) >= 10
    def budget(cfg):
        return {key: cfg[key] for key in cfg.keys() if key != 'model'}
    assert all(budget(cfg) == budget(shapes[0]) for cfg in shapes)
    assert len({str(cfg.model.backbone) for cfg in shapes}) == len(shapes)


@pytest.mark.parametrize('name', CONFIGS)
def test_config_parses_builds_and_runs_at_a_non_224_size(name):
    """The classifier (backbone outputs, neck, head) gives the logits of posattn's own model with its
    weights: the head's linear layer on the features the posattn model pools itself."""
    cfg = Config.fromfile(REPO / 'configs' / name)
    model = MODELS.build(cfg.model).eval()
    num_classes = cfg.model.head.num_classes
    images = torch.randn(2, 3, 96, 128)
    with torch.no_grad():
        logits = model(images, mode='tensor')
        expected = model.head.fc(model.backbone.model(images))  # (2, num_classes)
    assert logits.shape == (2, num_classes) and torch.isfinite(logits).all()
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)
    assert cfg.default_scope == 'mmpretrain' and 'posattn_openmmlab' in cfg.custom_imports.imports


@pytest.mark.parametrize('name', ['deit_t_rope_shapes.py', 'deit_t_rpb_shapes.py', 'deit_t_alibi_shapes.py',
                                  'deit_t_gpsa_shapes.py', 'convit_t_shapes.py'])
def test_later_scheme_configs_train_a_step(name):
    """One optimiser step of the config's own recipe on a batch of the embedded set: the loss is finite
    and every trainable parameter of the Φp moves (ALiBi has none)."""
    from mmengine.optim import build_optim_wrapper
    from mmpretrain.structures import DataSample
    cfg = Config.fromfile(REPO / 'configs' / name)
    model = MODELS.build(cfg.model).train()
    optim_wrapper = build_optim_wrapper(model, cfg.optim_wrapper)
    images = torch.randn(4, 3, cfg.img_size, cfg.img_size)
    samples = [DataSample().set_gt_label(label) for label in (0, 1, 2, 3)]
    phi_params = {n: p for n, p in model.named_parameters() if '.phi.' in n}
    before = {n: p.detach().clone() for n, p in phi_params.items()}
    losses = model(images, samples, mode='loss')
    optim_wrapper.update_params(sum(losses.values()))
    assert all(torch.isfinite(v) for v in losses.values())
    assert bool(phi_params) == (name != 'deit_t_alibi_shapes.py')
    moved = [n for n, p in phi_params.items() if not torch.equal(p, before[n])]
    assert bool(moved) == bool(phi_params), name
    if name == 'convit_t_shapes.py':
        assert {int(n.split('.')[3]) for n in phi_params} == set(range(10))  # gpsa in blocks 0-9


@pytest.mark.parametrize('name,weight_decay,warmup,drop_path', [
    ('pervit_t_imagenet.py', 0.03, 5, 0.0),
    ('pervit_s_imagenet.py', 0.05, 5, 0.1),
    ('pervit_m_imagenet.py', 0.05, 20, 0.2),
])
def test_imagenet_configs_follow_the_papers_recipe(name, weight_decay, warmup, drop_path):
    cfg = Config.fromfile(REPO / 'configs' / name)
    assert cfg.optim_wrapper.optimizer.weight_decay == weight_decay
    assert cfg.optim_wrapper.optimizer.lr == pytest.approx(1e-3)  # 5e-4 * 1024 / 512
    assert cfg.param_scheduler[0].end == warmup and cfg.param_scheduler[1].begin == warmup
    assert cfg.model.backbone.drop_path_rate == drop_path
    assert cfg.train_cfg.max_epochs == 300 and cfg.auto_scale_lr.base_batch_size == 1024
    assert [a.type for a in cfg.model.train_cfg.augments] == ['Mixup', 'CutMix']
    assert cfg.train_dataloader.sampler.type == 'RepeatAugSampler'


def test_imagenet_missing_data_error_says_where_and_what_to_try(tmp_path):
    cfg = Config.fromfile(REPO / 'configs' / 'pervit_t_imagenet.py')
    dataset = dict(cfg.train_dataloader.dataset, data_root=str(tmp_path / 'imagenet'))
    with pytest.raises(FileNotFoundError) as error:
        DATASETS.build(dataset)
    message = str(error.value)
    assert f'ImageNet train not found at {tmp_path / "imagenet" / "train"}' in message
    assert f'{tmp_path / "imagenet"}/train/<wnid>/*.JPEG' in message and '{data_root}' not in message
    assert 'python tools/train.py configs/pervit_t_shapes.py' in message


def test_mmpretrain_config_inheritance_works():
    """``mmpretrain::`` bases need pkg_resources (setuptools < 81)."""
    cfg = Config.fromstring("_base_ = 'mmpretrain::_base_/default_runtime.py'\n", '.py')
    assert cfg.default_scope == 'mmpretrain'


def test_shapes_are_deterministic_and_balanced():
    images, labels = render_shapes(60, img_size=56, seed=3)
    again, same_labels = render_shapes(60, img_size=56, seed=3)
    assert images.shape == (60, 56, 56, 3) and images.dtype == np.uint8
    assert np.array_equal(images, again) and np.array_equal(labels, same_labels)
    assert np.bincount(labels, minlength=len(CLASSES)).tolist() == [10] * len(CLASSES)
    assert not np.array_equal(render_shapes(60, img_size=56, seed=4)[0], images)
    assert CLASSES[PAIRS.index((0, 1))] == 'circle left of square'


def test_a_left_right_flip_keeps_every_pixel_and_makes_the_mirror_class():
    """Why the set needs position: every shape is mirror-symmetric, so an image flipped left-right
    holds the same shapes and the same pixels (only their places differ) and is an image of the
    mirror class (the same two shapes in the other order). A model that ignores where features
    are gives both the same answer, so it is right on at most half of the images."""
    side = 64
    ys, xs = np.mgrid[0:side, 0:side].astype(np.float32)
    rng = np.random.default_rng(0)
    for shape in range(len(SHAPES)):
        for _ in range(20):  # centres and radii on a half-pixel lattice: exact in float32
            cy, cx, radius = rng.integers(20, 88, size=3) / 2.0
            mask = shape_mask(shape, cy, cx, radius / 2, ys, xs)
            mirrored = shape_mask(shape, cy, side - 1 - cx, radius / 2, ys, xs)
            assert mask.any() and np.array_equal(mask[:, ::-1], mirrored), SHAPES[shape]
    for label, (left, right) in enumerate(PAIRS):
        mirror = PAIRS.index((right, left))
        assert mirror != label and sorted(PAIRS[mirror]) == sorted(PAIRS[label])


def test_shapes_dataset_splits_and_pipeline():
    train = DATASETS.build(dict(type='PositionalShapes', split='train', num_images=12,
                                pipeline=[dict(type='PackInputs')]))
    val = DATASETS.build(dict(type='PositionalShapes', split='val', num_images=12))
    assert len(train) == 12 and train.metainfo['classes'] == CLASSES
    sample = train[0]
    assert tuple(sample['inputs'].shape) == (3, 64, 64)
    assert not np.array_equal(train.get_data_info(0)['img'], val.get_data_info(0)['img'])
    with pytest.raises(ValueError, match="split must be one of"):
        DATASETS.build(dict(type='PositionalShapes', split='test'))
    with pytest.raises(ValueError, match='img_size 31 is too small to place two shapes side by side; use >= 32'):
        render_shapes(1, img_size=31)


STUDY_CONFIGS = sorted(p.name for p in (REPO / 'configs' / 'study').glob('*.py'))


@pytest.mark.parametrize('name', STUDY_CONFIGS)
def test_study_configs_are_half_width_twins_with_one_budget(name):
    """configs/study/: each model at half its width, trained with the embedded budget at a learning
    rate of 1e-3, and runs at the sizes the resolution study tests (32 to 128 pixels)."""
    cfg = Config.fromfile(REPO / 'configs' / 'study' / name)
    reference = Config.fromfile(REPO / 'configs' / 'deit_t_none_shapes.py')
    for key in cfg.keys():
        if key not in ('model', 'optim_wrapper'):
            assert cfg[key] == reference[key], key
    assert cfg.optim_wrapper.optimizer.lr == 1e-3
    assert cfg.model.head.in_channels == (140 if name.startswith('pervit') else 96)
    model = MODELS.build(cfg.model).eval()
    for size in (32, 128):
        with torch.no_grad():
            logits = model(torch.randn(2, 3, size, size), mode='tensor')
        assert logits.shape == (2, 6) and torch.isfinite(logits).all()
