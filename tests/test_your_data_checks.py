"""Your own images: what a run checks before it reads them.

An image file of 0 bytes stops tools/train.py and tools/test.py before their first step, naming it."""
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
from posattn_openmmlab.data_checks import empty_image_files
from posattn_openmmlab.datasets import SubsampledDataset
from test_your_data import CLASSES, CONFIGS, LOADERS, config, image_folder  # noqa: F401 (a fixture)

tool = load_test_tool()  # tools/test.py
SIZE = 32  # two tokens a side: these check the mechanics, not the accuracy
SETTINGS = ['num_classes=3', f'img_size={SIZE}', *LOADERS]


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
