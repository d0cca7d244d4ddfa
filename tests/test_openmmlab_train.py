"""tools/train.py and tools/test.py on the embedded config, shortened with --cfg-options:
training, resuming, evaluating, two torchrun ranks on CPU, and the ImageNet recipe on
generated images in the ImageNet layout."""
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import require_openmmlab

require_openmmlab()  # before the OpenMMLab imports

from mmengine.hooks import Hook
from mmengine.registry import HOOKS

from conftest import REPO, run_tool

CONFIG = 'configs/pervit_t_shapes.py'
# 16 images in one batch per epoch, without random flips: each iteration sees the same batch.
SHORT = ['train_dataloader.dataset.num_images=16', 'train_dataloader.batch_size=16',
         'train_dataloader.dataset.pipeline.0.prob=0.0', 'val_dataloader.dataset.num_images=24',
         'default_hooks.logger.interval=1', 'default_hooks.checkpoint.max_keep_ckpts=-1']
# The config's epoch schedule at a constant lr of 1e-5 (its warm-up's start factor set to 1; its
# cosine decays to 1e-5 anyway), small enough that every AdamW step lowers the loss of that batch,
# and each iteration's own loss logged (a window of one, not the mean of the last ten).
ONE_BATCH_DESCENT = ['optim_wrapper.optimizer.lr=1e-5', 'param_scheduler.0.start_factor=1.0',
                     'log_processor.window_size=1']
EPOCHS = 5

pytestmark = pytest.mark.slow


@HOOKS.register_module(force=True)
class GradientDigestHook(Hook):
    """Saves, per rank, each iteration's per-parameter gradient norms (taken just before the
    optimiser step, i.e. after DDP's all-reduce) and a checksum of the rank's input batch."""

    def __init__(self, out_dir):
        self.out_dir = out_dir
        self.gradients, self.inputs = [], []

    def before_train(self, runner):
        def record(optimizer, args, kwargs):
            self.gradients.append(torch.stack([p.grad.double().norm() for group in optimizer.param_groups
                                               for p in group['params'] if p.grad is not None]))
        runner.optim_wrapper.optimizer.register_step_pre_hook(record)

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        self.inputs.append(sum(float(image.double().sum()) for image in data_batch['inputs']))

    def after_train(self, runner):
        torch.save(dict(gradients=self.gradients, inputs=self.inputs),
                   os.path.join(self.out_dir, f'rank{runner.rank}.pt'))


def run(*command, env=None):
    return run_tool(*command, timeout=600, env=env)


def train(work_dir, *extra, epochs=EPOCHS):
    return run(sys.executable, 'tools/train.py', CONFIG, '--work-dir', str(work_dir), *extra,
               '--cfg-options', f'train_cfg.max_epochs={epochs}', *SHORT, *ONE_BATCH_DESCENT)


def logged(work_dir):
    """The scalars mmengine logged (vis_data/scalars.json), in order, across every run in work_dir."""
    rows = []
    for path in sorted(Path(work_dir).glob('*/vis_data/scalars.json')):
        rows += [json.loads(line) for line in path.read_text().splitlines()]
    return rows


def load(path):
    from posattn_openmmlab.checkpoint import load_local_checkpoint
    return load_local_checkpoint(str(path), map_location='cpu')


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    work_dir = tmp_path_factory.mktemp('shapes_train')
    output = train(work_dir)
    return work_dir, output


def test_training_lowers_the_loss_and_writes_checkpoints(trained):
    work_dir, output = trained
    losses = [row['loss'] for row in logged(work_dir) if 'loss' in row]
    assert len(losses) == EPOCHS and all(np.isfinite(losses)), losses
    # One batch, seen 5 times: each step lowers its loss by 0.011-0.032 (1.783 -> 1.697 in all);
    # asked for here: 0.005 a step and 3% in all.
    assert all(later < earlier - 5e-3 for earlier, later in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.97 * losses[0], losses
    assert all((work_dir / f'epoch_{e}.pth').is_file() for e in range(1, EPOCHS + 1))
    assert f'Finished {EPOCHS} epochs ({EPOCHS} iterations). Last validation: accuracy/top1:' in output
    assert f'Last checkpoint: {work_dir / f"epoch_{EPOCHS}.pth"}' in output
    # the main job points to the analysis, with the config the training saved (its --cfg-options applied)
    assert f'python tools/analyze.py {work_dir / Path(CONFIG).name} ' in output
    assert f'Training curve: {work_dir / "training_curve.png"}' in output
    assert (work_dir / 'training_curve.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_an_iteration_loop_reports_iterations_and_draws_its_curve(tmp_path):
    """The embedded config on mmengine's IterBasedTrainLoop: 4 iterations, validated after 2 and 4."""
    config = tmp_path / 'shapes_by_iteration.py'
    config.write_text(
        f"_base_ = '{REPO / CONFIG}'\n"
        "train_cfg = dict(_delete_=True, type='IterBasedTrainLoop', max_iters=4, val_interval=2)\n"
        "param_scheduler = [dict(type='ConstantLR', factor=1.0, by_epoch=False)]\n"
        "default_hooks = dict(checkpoint=dict(by_epoch=False, interval=2))\n")
    work_dir = tmp_path / 'work'
    output = run(sys.executable, 'tools/train.py', str(config), '--work-dir', str(work_dir), '--cfg-options', *SHORT)
    assert '\nFinished 4 iterations. Last validation: accuracy/top1:' in output
    assert f'Last checkpoint: {work_dir / "iter_4.pth"}' in output
    assert f'Training curve: {work_dir / "training_curve.png"}' in output
    assert (work_dir / 'training_curve.png').is_file()
    from train import training_history
    from _common import logged_scalars
    history = training_history(logged_scalars(work_dir), ['accuracy/top1'], counts_epochs=False,
                               metrics_by_epoch=True)
    assert sorted(history.losses) == [1, 2, 3, 4] and sorted(history.validations['accuracy/top1']) == [2, 4]


def train_row(iteration, loss, epoch=None):
    row = dict(lr=1e-3, loss=loss, time=0.5, data_time=0.01, iter=iteration, step=iteration)
    return row if epoch is None else dict(row, epoch=epoch)


def validation_row(step, **metrics):
    return dict(metrics, data_time=0.01, time=0.2, step=step)


def test_training_history_places_each_validation_where_the_loop_ran_it():
    from train import training_history
    # an epoch loop of 3 iterations an epoch, killed in epoch 2 and resumed from epoch_1.pth: 4 and 5 twice
    epochs = [train_row(2, 1.8, 1), train_row(3, 1.6, 1), validation_row(1, **{'accuracy/top1': 40.0}),
              train_row(4, 1.5, 2), train_row(5, 1.45, 2),
              train_row(4, 1.4, 2), train_row(5, 1.3, 2), train_row(6, 1.1, 2),
              validation_row(2, **{'accuracy/top1': 70.0, 'accuracy/top5': 100.0})]
    history = training_history(epochs, ['accuracy/top1', 'accuracy/top5'], counts_epochs=True, metrics_by_epoch=True)
    assert history.losses == {2: 1.8, 3: 1.6, 4: 1.4, 5: 1.3, 6: 1.1}
    assert history.validations == {'accuracy/top1': {1: 40.0, 2: 70.0}, 'accuracy/top5': {2: 100.0}}
    assert history.validation_unit == 'epoch'
    # an iteration loop logging every 2 iterations, validating after 3 and 6
    by_iteration = [train_row(2, 2.0), validation_row(3, mIoU=10.0), train_row(4, 1.5), train_row(6, 1.0),
                    validation_row(6, mIoU=30.0)]
    history = training_history(by_iteration, ['mIoU'], counts_epochs=False, metrics_by_epoch=False)
    assert history.validations == {'mIoU': {3: 10.0, 6: 30.0}} and history.validation_unit == 'iteration'
    # ... whose LoggerHook logs metrics by epoch: step 0, drawn at the last iteration logged before them
    by_epoch_steps = [dict(row, step=0) if 'mIoU' in row else row for row in by_iteration]
    history = training_history(by_epoch_steps, ['mIoU'], counts_epochs=False, metrics_by_epoch=True)
    assert history.validations == {'mIoU': {2: 10.0, 6: 30.0}} and history.validation_unit == 'iteration'
    assert training_history(epochs[:2], ['accuracy/top1'], True, True).validations == {'accuracy/top1': {}}


def test_curve_metrics_follow_save_best_or_take_the_first_logged():
    from mmengine.config import Config
    from train import curve_metrics
    rows = [train_row(1, 2.0), validation_row(1, **{'accuracy/top1': 40.0, 'accuracy/top5': 90.0})]

    def config(save_best):
        return Config(dict(default_hooks=dict(checkpoint=dict(type='CheckpointHook', save_best=save_best))))
    assert curve_metrics(config('accuracy/top5'), rows) == ['accuracy/top5']
    assert curve_metrics(config(['coco/bbox_mAP', 'coco/segm_mAP']), rows) == ['coco/bbox_mAP', 'coco/segm_mAP']
    assert curve_metrics(config('auto'), rows) == curve_metrics(config(None), rows) == ['accuracy/top1']
    assert curve_metrics(config('auto'), rows[:1]) == []


def test_finished_line_counts_what_the_loop_counts():
    from mmengine.config import Config
    from train import finished_line
    assert finished_line(Config(dict(train_cfg=dict(by_epoch=True, max_epochs=10))), 10, 940) == \
        'Finished 10 epochs (940 iterations).'
    assert finished_line(Config(dict(train_cfg=dict(type='IterBasedTrainLoop', max_iters=600))), 0, 600) == \
        'Finished 600 iterations.'
    assert finished_line(Config(dict(train_cfg=dict(type='MyLoop'))), 2, 50) == \
        'Finished training at epoch 2, iteration 50.'


def test_resume_continues_at_the_next_iteration_with_the_same_state(trained, tmp_path):
    work_dir, _ = trained
    output = train(tmp_path, '--resume', str(work_dir / f'epoch_{EPOCHS - 1}.pth'))
    assert f'resumed epoch: {EPOCHS - 1}, iter: {EPOCHS - 1}' in output
    assert [row['iter'] for row in logged(tmp_path) if 'loss' in row] == [EPOCHS]
    straight, resumed = load(work_dir / f'epoch_{EPOCHS}.pth'), load(tmp_path / f'epoch_{EPOCHS}.pth')
    assert (resumed['meta']['epoch'], resumed['meta']['iter']) == (EPOCHS, EPOCHS)
    assert resumed['param_schedulers'] == straight['param_schedulers']
    assert resumed['optimizer']['param_groups'] == straight['optimizer']['param_groups']
    torch.testing.assert_close(resumed['optimizer']['state'], straight['optimizer']['state'], rtol=0, atol=0)
    torch.testing.assert_close(resumed['state_dict'], straight['state_dict'], rtol=0, atol=0)  # bit for bit


def test_resuming_a_finished_training_reports_its_last_validation(trained, tmp_path):
    """--resume of a training that had finished trains and validates nothing more: the summary gives
    the validation its log holds."""
    import re
    import shutil
    work_dir, output = trained
    shutil.copytree(work_dir, tmp_path / 'work')
    again = train(tmp_path / 'work', '--resume')
    (last,) = re.findall(r'Last validation: (.+)', output)
    assert 'accuracy/top1' in last and f'Finished {EPOCHS} epochs ({EPOCHS} iterations). Last validation: {last}' in again
    assert [row['iter'] for row in logged(tmp_path / 'work') if 'loss' in row] == list(range(1, EPOCHS + 1))


def test_tools_test_evaluates_the_checkpoint(trained, tmp_path):
    work_dir, _ = trained
    out = tmp_path / 'metrics.json'
    run(sys.executable, 'tools/test.py', CONFIG, str(work_dir / f'epoch_{EPOCHS}.pth'),
        '--work-dir', str(tmp_path), '--out', str(out), '--cfg-options', *SHORT)
    last_val = [row for row in logged(work_dir) if 'accuracy/top1' in row][-1]
    assert json.loads(out.read_text())['accuracy/top1'] == pytest.approx(last_val['accuracy/top1'])


def test_create_model_loads_the_checkpoint_and_gives_the_classifiers_logits(trained):
    import posattn
    import posattn_openmmlab  # noqa: F401  (lets posattn's reader accept mmengine's types)
    from mmengine.config import Config
    from mmengine.registry import DefaultScope
    from mmpretrain.registry import MODELS
    work_dir, _ = trained
    checkpoint = work_dir / f'epoch_{EPOCHS}.pth'
    model = posattn.create_model('pervit_tiny', num_classes=6, checkpoint=checkpoint).eval()
    with DefaultScope.overwrite_default_scope('mmpretrain'):
        classifier = MODELS.build(Config.fromfile(REPO / CONFIG).model).eval()
    classifier.load_state_dict(load(checkpoint)['state_dict'])
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(images), classifier(images, mode='tensor'), rtol=0, atol=1e-5)


def test_two_torchrun_ranks_on_cpu_agree_on_gradients(tmp_path):
    config = tmp_path / 'shapes_with_probe.py'
    config.write_text(
        f"_base_ = '{REPO / CONFIG}'\n"
        "custom_imports = dict(imports=['posattn_openmmlab', 'test_openmmlab_train'], "
        "allow_failed_imports=False)\n"
        f"custom_hooks = [dict(type='GradientDigestHook', out_dir='{tmp_path}')]\n")
    run(sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
        'tools/train.py', str(config), '--launcher', 'pytorch', '--work-dir', str(tmp_path / 'work'),
        '--cfg-options', 'train_cfg.max_epochs=1', 'train_dataloader.dataset.num_images=32',
        'train_dataloader.batch_size=8', 'val_dataloader.dataset.num_images=16', 'default_hooks.logger.interval=1',
        env={'PYTHONPATH': str(REPO / 'tests'), 'OMP_NUM_THREADS': '1'})
    rank0, rank1 = (torch.load(tmp_path / f'rank{r}.pt') for r in (0, 1))
    assert len(rank0['gradients']) == len(rank1['gradients']) == 2  # 32 images / (2 ranks x 8)
    assert all(a != b for a, b in zip(rank0['inputs'], rank1['inputs']))  # each rank its own images
    for grads0, grads1 in zip(rank0['gradients'], rank1['gradients']):
        assert grads0.abs().sum() > 0
        torch.testing.assert_close(grads0, grads1, rtol=1e-6, atol=0)
    assert (tmp_path / 'work' / 'epoch_1.pth').is_file()


def write_imagenet_layout(root, classes=('n01440764', 'n01443537'), per_class=4, size=(72, 96)):
    """A few random JPEGs in mmpretrain's ImageNet layout: {root}/{train,val}/<wnid>/*.JPEG."""
    from PIL import Image
    generator = np.random.default_rng(0)
    for split in ('train', 'val'):
        for wnid in classes:
            folder = root / split / wnid
            folder.mkdir(parents=True)
            for i in range(per_class):
                pixels = generator.integers(0, 256, size=(*size, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f'{wnid}_{i}.JPEG')


def test_imagenet_recipe_runs_on_data_in_the_imagenet_layout(tmp_path):
    """The paper's full data pipeline (RandAugment, random erasing, repeated augmentation, Mixup /
    CutMix, resize + centre crop) through tools/train.py, on 8 generated images per split."""
    root = tmp_path / 'imagenet'
    write_imagenet_layout(root)
    loaders = ('train_dataloader', 'val_dataloader')
    classes = '[n01440764,n01443537]'  # 2 of ImageNet's folders; the head keeps its 1000 outputs
    options = [f'{loader}.{key}' for loader in loaders for key in
               (f'dataset.data_root={root}', f'dataset.classes={classes}', 'batch_size=4', 'num_workers=0',
                'persistent_workers=False')]
    output = run(sys.executable, 'tools/train.py', 'configs/pervit_t_imagenet.py', '--work-dir', str(tmp_path / 'work'),
                 '--cfg-options', 'train_cfg.max_epochs=1', 'param_scheduler.0.end=1', 'param_scheduler.1.begin=1',
                 'param_scheduler.1.end=2', 'default_hooks.logger.interval=1', *options)
    losses = [row['loss'] for row in logged(tmp_path / 'work') if 'loss' in row]
    assert len(losses) == 2 and all(np.isfinite(losses))  # 8 images, batch 4
    assert 'Last validation: accuracy/top1:' in output and 'accuracy/top5' in output
    assert (tmp_path / 'work' / 'epoch_1.pth').is_file()
