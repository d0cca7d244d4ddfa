"""Your own images: the configs of configs/your_data/ on a folder of class folders.

The configs' settings set in one place (``--cfg-options num_classes=... data_root=... img_size=...
phi=...`` reach every key that uses them; a key set against its setting is refused); one folder of
class folders split per class; a number of classes that differs from the data's stops the run
before its first step, naming both and the fix; and (slow) a study of two Φp through the real tools
on a generated three-class folder (train, test and analyse: test_recipes.py)."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import require_openmmlab

require_openmmlab()  # before the OpenMMLab imports

from mmengine.config import Config
from mmengine.registry import init_default_scope
from mmpretrain.registry import DATASETS, MODELS
from PIL import Image

import posattn
import train as train_tool
from _common import logged_scalars, merge_options
from conftest import REPO, run_tool
from posattn.phi.registry import phi_class
from posattn_openmmlab.class_checks import class_count_problems
from posattn_openmmlab.image_folder import ImageFolderSplit

CONFIGS = REPO / 'configs' / 'your_data'
CLASSES = ('bottom', 'middle', 'top')  # where the bright square is: a horizontal flip keeps the class
ROWS = {'top': 4, 'middle': 20, 'bottom': 36}  # the square's top row in a 48 x 64 image
TRAIN_SIZE = 64
# Few images, no worker processes: these check the mechanics in seconds, not the accuracy.
LOADERS = [f'{loader}.{key}' for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader')
           for key in ('num_workers=0', 'persistent_workers=False')]


def draw_images(folder: Path, per_class: int, classes=CLASSES, seed=0):
    """``folder/<class>/<i>.png``: 48 x 64 RGB images, dark noise with a bright 8 x 8 square whose
    row band is the class and whose column is random."""
    generator = np.random.default_rng(seed)
    for name in classes:
        (folder / name).mkdir(parents=True, exist_ok=True)
        for index in range(per_class):
            image = generator.integers(0, 60, size=(48, 64, 3), dtype=np.uint8)
            row, col = ROWS.get(name, 4), generator.integers(0, 56)
            image[row:row + 8, col:col + 8] = 230
            Image.fromarray(image).save(folder / name / f'{index}.png')


@pytest.fixture
def image_folder(tmp_path):
    """ImageNet's layout: ``train/<class>/*.png`` (6 per class) and ``val/<class>/*.png`` (3 per class)."""
    root = tmp_path / 'mydata'
    draw_images(root / 'train', 6, seed=0)
    draw_images(root / 'val', 3, seed=1)
    return root


def config(name, **options):
    cfg = Config.fromfile(CONFIGS / name)
    merge_options(cfg, options)
    return cfg


# ---------------------------------------------------------------- the settings, each in one place


@pytest.mark.parametrize('name', ['pervit_t_image_folder.py', 'deit_t_image_folder.py', 'pervit_t_one_folder.py'])
def test_a_setting_given_on_the_command_line_reaches_every_key_that_uses_it(name):
    cfg = config(name, num_classes=7, data_root='/data/flowers', img_size=96, phi='none', warmup_epochs=1)
    assert (cfg.param_scheduler[0].end, cfg.param_scheduler[1].begin) == (1, 1)
    assert cfg.model.head.num_classes == cfg.data_preprocessor.num_classes == 7
    assert cfg.model.backbone.phi == 'none'
    for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        assert cfg[loader].dataset.data_root == '/data/flowers'
    transforms = cfg.train_dataloader.dataset.pipeline + cfg.test_dataloader.dataset.pipeline
    sizes = [(t['type'], t.get('scale', t.get('crop_size'))) for t in transforms
             if t['type'] not in ('LoadImageFromFile', 'RandomFlip', 'PackInputs')]
    assert sizes == [('RandomResizedCrop', 96), ('ResizeEdge', 96), ('CenterCrop', 96)]
    if cfg.model.backbone.type == 'PosattnViT':  # its learned embedding's grid: the training size
        assert cfg.model.backbone.img_size == 96
    default = config(name)
    assert (default.num_classes, default.img_size, default.data_root) == (2, 224, 'data/mydata')
    assert default.model.head.num_classes == 2 and default.train_dataloader.dataset.pipeline[1].scale == 224


def test_a_key_set_against_its_setting_is_refused_with_the_setting_to_give():
    with pytest.raises(ValueError) as refusal:
        config('deit_t_image_folder.py', **{'model.head.num_classes': 5, 'model.backbone.img_size': 96})
    message = str(refusal.value)
    assert message.startswith(f'{CONFIGS / "deit_t_image_folder.py"}: keys that take their value from a top-level '
                              f'setting (linked_keys) disagree with it:')
    assert ('model.head.num_classes is 5, but num_classes is 2: change num_classes, which sets '
            'model.head.num_classes too (--cfg-options num_classes=5)') in message
    assert 'model.backbone.img_size is 96, but img_size is 224' in message


def test_a_linked_key_the_config_lacks_is_refused():
    with pytest.raises(ValueError, match=r"model.backbone.img_size: the config has no 'img_size' there; "
                                         r"linked_keys\['img_size'\] lists it: remove it there"):
        config('pervit_t_image_folder.py', linked_keys=dict(img_size=['model.backbone.img_size']))


@pytest.mark.parametrize('phi', posattn.list_phis())
def test_the_deit_config_trains_with_every_registered_phi(phi):
    """phi=... builds the classifier with that Φp, at the image size and number of classes given."""
    cfg = config('deit_t_image_folder.py', phi=phi, num_classes=3, img_size=32)
    init_default_scope('mmpretrain')
    model = MODELS.build(dict(cfg.model, data_preprocessor=cfg.data_preprocessor))
    assert {type(block.attn.phi) for block in model.backbone.model.blocks} == {phi_class(phi)}
    scores = model(torch.randn(2, 3, 32, 32), mode='tensor')
    assert scores.shape == (2, 3) and torch.isfinite(scores).all()


# ---------------------------------------------------------------- one folder of class folders


def infos(dataset):
    return [dataset.get_data_info(index) for index in range(len(dataset))]


def test_one_folder_is_split_per_class_the_same_way_every_time(tmp_path):
    """20% of each class (round, at least one) held out, drawn with the seed; the splits share their
    classes, no image, and together hold every image."""
    draw_images(tmp_path, 10, classes=('a', 'b'))
    draw_images(tmp_path, 3, classes=('c',))
    draw_images(tmp_path, 1, classes=('d',))  # one image: training only
    splits = {split: ImageFolderSplit(data_root=str(tmp_path), split=split) for split in ('train', 'val')}
    paths = {split: [info['img_path'] for info in infos(dataset)] for split, dataset in splits.items()}
    assert splits['train'].metainfo['classes'] == splits['val'].metainfo['classes'] == ('a', 'b', 'c', 'd')
    assert sorted(paths['train'] + paths['val']) == sorted(str(p) for p in tmp_path.rglob('*.png'))
    assert not set(paths['train']) & set(paths['val'])
    held_out = {name: sum(Path(p).parent.name == name for p in paths['val']) for name in 'abcd'}
    assert held_out == dict(a=2, b=2, c=1, d=0)
    for info in infos(splits['val']):  # the label is the class folder's place in sorted order
        assert info['gt_label'] == 'abcd'.index(Path(info['img_path']).parent.name)
    again = ImageFolderSplit(data_root=str(tmp_path), split='val')
    assert [info['img_path'] for info in infos(again)] == paths['val']
    other_seed = ImageFolderSplit(data_root=str(tmp_path), split='val', seed=1)
    assert [info['img_path'] for info in infos(other_seed)] != paths['val']


def test_the_one_folder_config_builds_its_splits(tmp_path):
    draw_images(tmp_path, 5)
    cfg = config('pervit_t_one_folder.py', data_root=str(tmp_path), num_classes=3)
    init_default_scope('mmpretrain')
    train, val = (DATASETS.build(cfg[loader].dataset) for loader in ('train_dataloader', 'val_dataloader'))
    assert (len(train), len(val)) == (12, 3) and train.metainfo['classes'] == CLASSES
    assert val[0]['inputs'].shape == (3, 224, 224)


@pytest.mark.parametrize('split, fraction, message', [
    ('test', 0.2, "split must be one of ('train', 'val'), got 'test'"),
    ('train', 1.0, 'val_fraction must be in (0, 1), the part of each class held out for validation; got 1.0')])
def test_one_folder_refuses_bad_settings(tmp_path, split, fraction, message):
    with pytest.raises(ValueError) as refusal:
        ImageFolderSplit(data_root=str(tmp_path), split=split, val_fraction=fraction)
    assert str(refusal.value) == message


# ---------------------------------------------------------------- the number of classes, checked


@pytest.mark.parametrize('num_classes', [2, 4])  # the config's default, one too many
def test_a_head_of_another_size_than_the_class_folders_stops_before_the_first_step(image_folder, tmp_path,
                                                                                     num_classes):
    work_dir = tmp_path / 'work'
    with pytest.raises(SystemExit) as stop:
        train_tool.main(['configs/your_data/deit_t_image_folder.py', '--work-dir', str(work_dir), '--cfg-options',
                         f'data_root={image_folder}', f'img_size={TRAIN_SIZE}', f'num_classes={num_classes}', *LOADERS])
    stated = f'model.head.num_classes={num_classes} and data_preprocessor.num_classes={num_classes}'
    assert str(stop.value) == (
        "tools/train.py configs/your_data/deit_t_image_folder.py: the classifier and its data disagree on the "
        "classes:\n"
        f"  train_dataloader's dataset (CustomDataset at {image_folder / 'train'}) has 3 classes (bottom, middle, "
        f"top), but the model has {stated}: set the number of classes to 3, e.g. --cfg-options num_classes=3\n"
        f"  val_dataloader's dataset (CustomDataset at {image_folder / 'val'}) has 3 classes (bottom, middle, "
        f"top), but the model has {stated}: set the number of classes to 3, e.g. --cfg-options num_classes=3")
    assert not list(work_dir.glob('*.pth'))
    assert not [row for row in logged_scalars(work_dir) if 'loss' in row]  # no step taken


def test_a_validation_folder_without_a_class_of_the_training_folder_stops_the_training(image_folder, tmp_path):
    for image in (image_folder / 'val' / 'middle').iterdir():
        image.unlink()
    (image_folder / 'val' / 'middle').rmdir()
    with pytest.raises(SystemExit) as stop:
        train_tool.main(['configs/your_data/deit_t_image_folder.py', '--work-dir', str(tmp_path / 'work'),
                         '--cfg-options', f'data_root={image_folder}', f'img_size={TRAIN_SIZE}', 'num_classes=3',
                         *LOADERS])
    message = str(stop.value)
    assert (f"val_dataloader's dataset (CustomDataset at {image_folder / 'val'}) has 2 classes (bottom, top), but "
            f"the model has model.head.num_classes=3 and data_preprocessor.num_classes=3") in message
    assert (f"val_dataloader's dataset (CustomDataset at {image_folder / 'val'}) has other classes than "
            f"train_dataloader's (CustomDataset at {image_folder / 'train'}), so their labels number different "
            f"classes (only in train_dataloader's: middle): give both the same class folders") in message


class Classes:
    """A dataset as the check sees it: its metainfo's classes."""

    def __init__(self, *classes):
        self.metainfo = dict(classes=classes)


def test_the_check_passes_agreeing_classes_and_ignores_data_without_class_names():
    """Exact for the configs of your own data; elsewhere only fewer outputs than classes is an error."""
    counts = {'model.head.num_classes': 2, 'data_preprocessor.num_classes': 2}
    datasets = dict(train_dataloader=Classes('a', 'b'), val_dataloader=Classes('a', 'b'), test_dataloader=object())
    assert class_count_problems(counts, datasets, '--cfg-options num_classes={n}') == []
    assert class_count_problems({'model.head.num_classes': 3, 'data_preprocessor.num_classes': 2},
                                dict(test_dataloader=Classes('a', 'b')), 'num_classes={n}') == [
        "test_dataloader's dataset (Classes) has 2 classes (a, b), but the model has model.head.num_classes=3: "
        "set the number of classes to 2, e.g. num_classes=2"]
    wider = {'model.head.num_classes': 1000, 'data_preprocessor.num_classes': 1000}  # a subset of ImageNet's
    subset = dict(train_dataloader=Classes('n01440764', 'n01443537'))
    assert class_count_problems(wider, subset, 'num_classes={n}', exact=False) == []
    assert class_count_problems(wider, subset, 'num_classes={n}', exact=True) == [
        "train_dataloader's dataset (Classes) has 2 classes (n01440764, n01443537), but the model has "
        "model.head.num_classes=1000 and data_preprocessor.num_classes=1000: set the number of classes to 2, e.g. "
        "num_classes=2"]
    narrower = {'model.head.num_classes': 1}
    assert class_count_problems(narrower, subset, 'num_classes={n}', exact=False) == [
        "train_dataloader's dataset (Classes) has 2 classes (n01440764, n01443537), but the model has "
        "model.head.num_classes=1: set the number of classes to 2, e.g. num_classes=2"]
    reordered = class_count_problems(counts, dict(train_dataloader=Classes('a', 'b'),
                                                  val_dataloader=Classes('b', 'a')), 'num_classes={n}')
    assert reordered == ["val_dataloader's dataset (Classes) has other classes than train_dataloader's (Classes), "
                         "so their labels number different classes (in another order): give both the same class "
                         "folders"]


# ---------------------------------------------------------------- the documented path, through the tools


@pytest.mark.slow
def test_a_study_file_compares_two_phis_on_the_folder_with_three_seeds(image_folder, tmp_path):
    """tools/compare_phis.py on a user's study file whose two rows are the documented DeiT-T config
    with another Φp each (a row's ``options``) and the study's ``options`` (recipe=position) for
    both, the folder given by the configs' settings: each row trains the Φp it names with the recipe,
    and the tables and figures name the folder's data, chance and batch and give every column."""
    (tmp_path / 'my_study.py').write_text(
        "options = dict(recipe='position')\n"
        "rows = [\n"
        "    dict(name='ape', config='your_data/deit_t_image_folder.py', label='DeiT-T, APE', options=dict(phi='none')),\n"
        "    dict(name='rope', config='your_data/deit_t_image_folder.py', label='DeiT-T + RoPE', options=dict(phi='rope')),\n"
        "]\n")
    work_dir = tmp_path / 'study'
    output = run_tool(sys.executable, 'tools/compare_phis.py', '--study', str(tmp_path / 'my_study.py'),
                      '--seeds', '0', '1', '2', '--epochs', '2', '--timing-repeats', '1', '--work-dir', str(work_dir),
                      '--cfg-options', f'data_root={image_folder}', 'num_classes=3', f'img_size={TRAIN_SIZE}',
                      'warmup_epochs=1', 'train_dataloader.batch_size=6', *LOADERS, timeout=900)
    record = json.loads((work_dir / 'comparison.json').read_text())
    assert [(run['row'], run['seed']) for run in record['runs']] == [(row, seed) for row in ('ape', 'rope')
                                                                     for seed in (0, 1, 2)]
    for run in record['runs']:  # what tools/train.py trained: the row's Φp, with recipe=position
        trained = Config.fromfile(work_dir / run['row'] / f'seed{run["seed"]}' / 'config.py')
        assert trained.model.backbone.phi == {'ape': 'none', 'rope': 'rope'}[run['row']]
        assert trained.model.head.num_classes == 3 and len(run['top1_per_epoch']) == 2
        assert trained.model.train_cfg is None and trained.optim_wrapper.optimizer.lr == 1e-3  # no Mixup / CutMix
    assert record['figure'] == dict(dataset='CustomDataset (mydata)', chance_top1=[pytest.approx(100 / 3)],
                                    step_time_axis=f'training step time (ms; batch 6, {TRAIN_SIZE} x {TRAIN_SIZE} px; '
                                                   'CPU, 1 thread)')
    table = (work_dir / 'comparison.md').read_text()
    assert '| DeiT-T + RoPE |' in table and '(3 seeds)' in table
    for column in ('final top-1', 'range', 'best-epoch top-1', 'epochs to 95%', 'step time', 'run time',
                   'minus the next', '95% interval'):
        assert f'\n- {column}: ' in table, column
    assert 'top-1' in output
