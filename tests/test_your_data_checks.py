"""Your own images: what a run checks before it reads them.

Test data whose classes differ from those the checkpoint was trained on (a class folder renamed, one
missing, the same classes in another order) stop tools/test.py before its first batch, naming them;
a checkpoint that records no classes tests as before. An image file of 0 bytes stops tools/train.py
and tools/test.py before their first step, naming it."""
import pytest
import torch

from conftest import require_openmmlab

require_openmmlab()  # before the OpenMMLab imports

from mmengine.registry import init_default_scope
from mmpretrain.datasets import CustomDataset
from mmpretrain.registry import MODELS

import train as train_tool
from _common import logged_scalars
from conftest import load_test_tool
from posattn_openmmlab.class_checks import checkpoint_classes, trained_class_problem
from posattn_openmmlab.data_checks import empty_image_files
from posattn_openmmlab.datasets import SubsampledDataset
from test_your_data import CLASSES, CONFIGS, LOADERS, Classes, config, image_folder  # noqa: F401 (a fixture)

tool = load_test_tool()  # tools/test.py
SIZE = 32  # two tokens a side: these check the mechanics, not the accuracy
SETTINGS = ['num_classes=3', f'img_size={SIZE}', *LOADERS]


def rename_class(folder, old, new):
    (folder / old).rename(folder / new)


# ---------------------------------------------------------------- the checkpoint's classes and the test data's


def test_the_classes_a_checkpoint_records_are_read_where_it_records_them():
    assert checkpoint_classes({'meta': {'dataset_meta': {'classes': ['a', 'b']}}, 'state_dict': {}}) == ('a', 'b')
    for unrecorded in ({'meta': {'dataset_meta': {}}}, {'meta': {'epoch': 1}}, {'state_dict': {}},
                       {'backbone.weight': torch.ones(1)}, torch.ones(1)):
        assert checkpoint_classes(unrecorded) is None


def test_each_difference_from_the_trained_classes_is_named_with_the_fix():
    trained = ('bottom', 'middle', 'top')
    assert trained_class_problem(trained, 'test_dataloader', Classes(*trained)) is None
    assert trained_class_problem(trained, 'test_dataloader', object()) is None  # states no classes
    fix = ("Its labels would stand for other classes than the model's outputs: test on data with the checkpoint's "
           "classes, in its order (labels number the class folders in sorted order: name them as in the training "
           "data)")
    assert trained_class_problem(trained, 'test_dataloader', Classes('bottom', 'centre', 'top'), 'checkpoint c.pth') \
        == ("checkpoint c.pth was trained on 3 classes (bottom, middle, top), but test_dataloader's dataset (Classes) "
            "has 3 (bottom, centre, top): only in the checkpoint: middle; only in the test data: centre. " + fix)
    assert trained_class_problem(trained, 'test_dataloader', Classes('bottom', 'top')) == (
        "the checkpoint was trained on 3 classes (bottom, middle, top), but test_dataloader's dataset (Classes) has "
        "2 (bottom, top): only in the checkpoint: middle. " + fix)
    assert trained_class_problem(trained, 'test_dataloader', Classes('top', 'middle', 'bottom')) == (
        "the checkpoint was trained on 3 classes (bottom, middle, top), but test_dataloader's dataset (Classes) has "
        "3 (top, middle, bottom): the same classes in another order. " + fix)


def checkpoint_of(path, classes=None):
    """A checkpoint of the DeiT-T config's model (3 classes, at :data:`SIZE`), as mmengine's runner
    writes one: ``meta['dataset_meta']`` with ``classes`` where given."""
    cfg = config('deit_t_image_folder.py', num_classes=3, img_size=SIZE)
    init_default_scope('mmpretrain')
    model = MODELS.build(dict(cfg.model, data_preprocessor=cfg.data_preprocessor))
    meta = {'epoch': 1} if classes is None else {'epoch': 1, 'dataset_meta': {'classes': classes}}
    torch.save({'meta': meta, 'state_dict': model.state_dict()}, path)
    return path


def metrics_of(image_folder, tmp_path, checkpoint):
    """tools/test.py's metrics for ``checkpoint`` on the DeiT-T config and ``image_folder``'s ``val/``."""
    return tool.main([str(CONFIGS / 'deit_t_image_folder.py'), str(checkpoint), '--work-dir', str(tmp_path / 'test'),
                      '--cfg-options', f'data_root={image_folder}', *SETTINGS])


def count_test_batches(monkeypatch):
    """The test batches tools/test.py runs from now on, as its image-size hook sees them."""
    batches = []
    monkeypatch.setattr(tool.TestedImageSizes, 'after_test_iter', lambda *args, **kwargs: batches.append(1))
    return batches


@pytest.mark.parametrize('trained, tested, difference', [
    (CLASSES, ('bottom', 'centre', 'top'), 'only in the checkpoint: middle; only in the test data: centre'),
    (('top', 'middle', 'bottom'), CLASSES, 'the same classes in another order')], ids=['renamed', 'reordered'])
def test_test_data_with_other_classes_than_the_checkpoints_stop_before_the_first_batch(image_folder, tmp_path,
                                                                                        monkeypatch, trained, tested,
                                                                                        difference):
    if tested != CLASSES:
        rename_class(image_folder / 'val', 'middle', 'centre')
    checkpoint = checkpoint_of(tmp_path / 'trained.pth', trained)
    batches = count_test_batches(monkeypatch)
    with pytest.raises(SystemExit) as stop:
        metrics_of(image_folder, tmp_path, checkpoint)
    assert str(stop.value) == (
        f"tools/test.py {CONFIGS / 'deit_t_image_folder.py'}: the checkpoint and the test data disagree on the "
        f"classes:\n  checkpoint {checkpoint} was trained on 3 classes ({', '.join(trained)}), but "
        f"test_dataloader's dataset (CustomDataset at {image_folder / 'val'}) has 3 ({', '.join(tested)}): "
        f"{difference}. Its labels would stand for other classes than the model's outputs: test on data with the "
        f"checkpoint's classes, in its order (labels number the class folders in sorted order: name them as in the "
        f"training data)")
    assert not batches


@pytest.mark.parametrize('recorded', [CLASSES, None], ids=['same classes', 'none recorded'])
def test_a_checkpoint_with_the_test_datas_classes_or_none_recorded_is_tested(image_folder, tmp_path, monkeypatch,
                                                                             recorded):
    batches = count_test_batches(monkeypatch)
    metrics = metrics_of(image_folder, tmp_path, checkpoint_of(tmp_path / 'trained.pth', recorded))
    assert 0 <= metrics['accuracy/top1'] <= 100 and batches


# ---------------------------------------------------------------- empty image files


def test_empty_image_files_are_found_through_dataset_wrappers(image_folder):
    (image_folder / 'train' / 'top' / 'empty.jpg').touch()
    dataset = CustomDataset(data_root=str(image_folder), data_prefix='train')
    assert empty_image_files(dataset) == [str(image_folder / 'train' / 'top' / 'empty.jpg')]
    assert empty_image_files(SubsampledDataset(dataset, fraction=1.0)) == empty_image_files(dataset)
    assert empty_image_files(CustomDataset(data_root=str(image_folder), data_prefix='val')) == []


def test_an_empty_image_file_stops_the_training_before_its_first_step_naming_it(image_folder, tmp_path):
    empty = [image_folder / 'train' / 'middle' / '9.jpg', image_folder / 'val' / 'top' / 'copied.png']
    for path in empty:
        path.touch()
    work_dir = tmp_path / 'work'
    with pytest.raises(SystemExit) as stop:
        train_tool.main(['configs/your_data/pervit_t_image_folder.py', '--work-dir', str(work_dir),
                         '--cfg-options', f'data_root={image_folder}', *SETTINGS])
    assert str(stop.value) == (
        "tools/train.py configs/your_data/pervit_t_image_folder.py: empty image files, which no decoder can read:\n"
        f"  train_dataloader's dataset (CustomDataset at {image_folder / 'train'}) lists 1 file of 0 bytes:\n"
        f"    {empty[0]}\n"
        f"  val_dataloader's dataset (CustomDataset at {image_folder / 'val'}) lists 1 file of 0 bytes:\n"
        f"    {empty[1]}\n"
        "  delete them, or copy those images again")
    assert not [row for row in logged_scalars(work_dir) if 'loss' in row]  # no step taken


def test_empty_image_files_stop_the_test_naming_them(image_folder, tmp_path, monkeypatch):
    for index in range(10):
        (image_folder / 'val' / 'bottom' / f'empty{index}.jpg').touch()
    batches = count_test_batches(monkeypatch)
    with pytest.raises(SystemExit) as stop:
        metrics_of(image_folder, tmp_path, checkpoint_of(tmp_path / 'trained.pth', CLASSES))
    listed = ''.join(f"    {image_folder / 'val' / 'bottom' / f'empty{index}.jpg'}\n" for index in range(8))
    assert str(stop.value) == (
        f"tools/test.py {CONFIGS / 'deit_t_image_folder.py'}: empty image files, which no decoder can read:\n"
        f"  test_dataloader's dataset (CustomDataset at {image_folder / 'val'}) lists 10 files of 0 bytes:\n"
        f"{listed}    ... (10 in all)\n"
        "  delete them, or copy those images again")
    assert not batches
