"""Your own images: what a run checks before it reads them, and runs of any length.

Test data whose classes differ from those the checkpoint was trained on (a class folder renamed, one
missing, the same classes in another order) stop tools/test.py before its first batch, naming them;
a checkpoint that records no classes tests as before. An image file of 0 bytes stops tools/train.py
and tools/test.py before their first step, naming it. A run no longer than the warm-up trains: the
cosine decay is left out. And (slow) the real tools: a one-epoch training on the configs, its
checkpoint's classes, and tools/test.py with them."""
import sys

import pytest
import torch

from conftest import require_openmmlab

require_openmmlab()  # before the OpenMMLab imports

from mmengine.optim import OptimWrapper
from mmengine.optim.scheduler import CosineAnnealingLR
from mmengine.registry import PARAM_SCHEDULERS, init_default_scope
from mmpretrain.datasets import CustomDataset
from mmpretrain.registry import MODELS

import train as train_tool
from _common import logged_scalars
from conftest import load_test_tool, run_tool
from posattn_openmmlab.checkpoint import load_checkpoint_file
from posattn_openmmlab.class_checks import checkpoint_classes, trained_class_problem
from posattn_openmmlab.data_checks import empty_image_files
from posattn_openmmlab.datasets import SubsampledDataset
from posattn_openmmlab.evaluation import TestedImageSizes
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
    monkeypatch.setattr(TestedImageSizes, 'after_test_iter', lambda *args, **kwargs: batches.append(1))
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


# ---------------------------------------------------------------- runs no longer than the warm-up


def learning_rates(cfg, max_epochs, epoch_length=3):
    """The lr of every training iteration under ``cfg.param_scheduler``, built as mmengine's runner
    builds it (a scheduler without ``end`` ends with the run) and stepped as its ParamSchedulerHook
    steps it: iteration-based schedulers after every iteration, epoch-based ones after every epoch."""
    parameter = torch.nn.Parameter(torch.zeros(1))
    wrapper = OptimWrapper(torch.optim.SGD([parameter], lr=cfg.optim_wrapper.optimizer.lr))
    init_default_scope('mmpretrain')
    schedulers = [PARAM_SCHEDULERS.build(dict(scheduler, end=scheduler.get('end', max_epochs)),
                                         default_args=dict(optimizer=wrapper, epoch_length=epoch_length))
                  for scheduler in cfg.param_scheduler]
    rates = []
    for _ in range(max_epochs):
        for _ in range(epoch_length):
            rates.append(wrapper.param_groups[0]['lr'])
            wrapper.step()
            for scheduler in schedulers:
                if not scheduler.by_epoch:
                    scheduler.step()
        for scheduler in schedulers:
            if scheduler.by_epoch:
                scheduler.step()
    return rates


@pytest.mark.parametrize('name', ['pervit_t_image_folder.py', 'deit_t_image_folder.py'])
def test_a_run_no_longer_than_the_warm_up_is_all_warm_up(name):
    peak = config(name).optim_wrapper.optimizer.lr
    one_epoch_warmup = learning_rates(config(name, warmup_epochs=1), max_epochs=1)
    assert one_epoch_warmup == pytest.approx([peak * 1e-3, peak * (1e-3 + (1 - 1e-3) / 2), peak])
    five_epoch_warmup = learning_rates(config(name), max_epochs=1)  # the configs' 5: the run ends within it
    assert five_epoch_warmup == pytest.approx([peak * (1e-3 + (1 - 1e-3) * step / 14) for step in range(3)])


def test_a_longer_run_decays_as_mmengines_cosine_after_the_warm_up():
    cfg = config('pervit_t_image_folder.py', warmup_epochs=1)
    decayed = learning_rates(cfg, max_epochs=4)
    cfg.param_scheduler[1].type = CosineAnnealingLR.__name__
    assert decayed == learning_rates(cfg, max_epochs=4)
    assert max(decayed) == decayed[3] and decayed[-1] < decayed[6] < decayed[3]  # peak after the warm-up, then down


# ---------------------------------------------------------------- the real tools


@pytest.mark.slow
def test_a_one_epoch_training_records_its_classes_and_the_test_refuses_a_renamed_class(image_folder, tmp_path):
    """tools/train.py for one epoch with the short run docs/your-data.md gives; its checkpoint's
    ``meta['dataset_meta']`` holds the training folder's classes; tools/test.py tests it on the
    validation folder, and refuses the folder with a class renamed."""
    work_dir = tmp_path / 'work'
    output = run_tool(sys.executable, 'tools/train.py', 'configs/your_data/deit_t_image_folder.py', '--work-dir',
                      str(work_dir), '--cfg-options', f'data_root={image_folder}', 'train_cfg.max_epochs=1',
                      'warmup_epochs=1', 'train_dataloader.batch_size=6', *SETTINGS, timeout=600)
    assert 'Finished 1 epochs (3 iterations).' in output
    assert 'CosineAfterWarmupLR: the run ends at epoch 1, by the end of the warm-up (epoch 1)' in output
    checkpoint = work_dir / 'epoch_1.pth'
    assert load_checkpoint_file(str(checkpoint), map_location='cpu')['meta']['dataset_meta'] == {'classes': CLASSES}
    saved_config = str(work_dir / 'deit_t_image_folder.py')  # with the command line's settings
    metrics = tool.main([saved_config, str(checkpoint), '--work-dir', str(tmp_path / 'test')])
    assert 0 <= metrics['accuracy/top1'] <= 100
    rename_class(image_folder / 'val', 'middle', 'centre')
    with pytest.raises(SystemExit) as stop:
        tool.main([saved_config, str(checkpoint), '--work-dir', str(tmp_path / 'test')])
    assert (f"checkpoint {checkpoint} was trained on 3 classes (bottom, middle, top), but test_dataloader's dataset "
            f"(CustomDataset at {image_folder / 'val'}) has 3 (bottom, centre, top): only in the checkpoint: middle; "
            f"only in the test data: centre.") in str(stop.value)
