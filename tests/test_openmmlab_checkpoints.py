"""Checkpoints in OpenMMLab training: strict loading (tools/test.py, load_from, the backbones'
Pretrained init, tools/analyze.py) with the partial-load opt-in, atomic saves, old checkpoints
kept until the new one is complete, resume from the newest complete checkpoint, one training per
work_dir (locked before the runner writes anything), what tools/train.py does with a work_dir
that holds a training already (resume it, report it, or refuse other settings), bit-identical
weights after a SIGKILL anywhere, and the dense set's stale staging folders.

The fault injection runs tools/train.py through tests/train_with_faults.py, which kills the
process at a chosen iteration or halfway through writing a chosen file."""
import itertools
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from conftest import require_openmmlab

require_openmmlab()  # before the OpenMMLab imports

from mmengine.evaluator import BaseMetric
from mmengine.model import BaseModel

import posattn
import posattn_openmmlab  # noqa: F401
import posattn_openmmlab.backbones as backbones
import posattn_openmmlab.runner as runner_module
from posattn_openmmlab import PosattnPerViT
from posattn_openmmlab.atomic import atomic_write, remove_partial_writes
from posattn_openmmlab.checkpoint import load_local_checkpoint
from posattn_openmmlab.dense_shapes_dataset import STALE_STAGING_SECONDS, ensure_dense_shapes
from posattn_openmmlab.random_state import capture_random_state, restore_random_state
from posattn_openmmlab.runner import load_model_weights
from posattn_openmmlab.work_dir_lock import WorkDirInUseError, WorkDirLock
from conftest import REPO, run_tool


CONFIG = 'configs/pervit_t_shapes.py'
# The embedded config shrunk to seconds: a PerViT of 3 blocks in 2 stages (the arch dict
# PosattnPerViT takes), batches of 12 of 24 training images, seeded and deterministic. The
# pipeline's vertical flips draw from numpy's global generator, so a resume that does not restore
# it trains on other flips.
TINY = ['model.backbone.arch._delete_=True', 'model.backbone.arch.embed_dims=[16,24]',
        'model.backbone.arch.depths=[1,2]', 'model.backbone.arch.num_heads=2',
        'model.backbone.arch.stem_dims=[4,4,4,8]', 'model.head.in_channels=24',
        'train_dataloader.dataset.num_images=24', 'train_dataloader.batch_size=12',
        'val_dataloader.dataset.num_images=12', 'val_dataloader.batch_size=12',
        'test_dataloader.dataset.num_images=12', 'test_dataloader.batch_size=12',
        'default_hooks.logger.interval=1', 'randomness.seed=1', 'randomness.deterministic=True']
EPOCHS = ['train_cfg.max_epochs=3']  # 2 iterations each, a checkpoint after each epoch
# 6 iterations of mmengine's IterBasedTrainLoop (the loop of the detection and segmentation
# configs), a checkpoint and a validation every 2
ITERATIONS = ['train_cfg._delete_=True', 'train_cfg.type=IterBasedTrainLoop', 'train_cfg.max_iters=6',
              'train_cfg.val_interval=2', 'train_dataloader.sampler.type=InfiniteSampler',
              'default_hooks.checkpoint.by_epoch=False', 'default_hooks.checkpoint.interval=2', 'param_scheduler=[]',
              'log_processor.by_epoch=False']
# One thread per process: the models are tiny, and the tests share 2 cores with other jobs.
ONE_THREAD = {'OMP_NUM_THREADS': '1'}


def failing(*command):
    """Run ``command`` from the repository root, expecting it to fail: (return code, stdout + stderr)."""
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, **ONE_THREAD))
    assert result.returncode != 0, f'{" ".join(map(str, command))} succeeded:\n{result.stdout[-3000:]}'
    return result.returncode, result.stdout + result.stderr


def train(work_dir, *arguments, schedule=EPOCHS, options=()):
    return run_tool(sys.executable, 'tools/train.py', CONFIG, '--work-dir', str(work_dir), *arguments,
                    '--cfg-options', *TINY, *schedule, *options, timeout=600, env=ONE_THREAD)


def killed(work_dir, *faults, schedule=EPOCHS, options=()):
    """tools/train.py with a fault of tests/train_with_faults.py: the output of the killed run."""
    code, output = failing(sys.executable, 'tests/train_with_faults.py', *faults, '--', CONFIG,
                           '--work-dir', str(work_dir), '--cfg-options', *TINY, *schedule, *options)
    assert code == -signal.SIGKILL, output[-3000:]
    return output


def assert_same_weights(expected, got):
    expected, got = (load_local_checkpoint(str(path))['state_dict'] for path in (expected, got))
    assert expected.keys() == got.keys()
    different = [key for key in expected if not torch.equal(expected[key], got[key])]
    assert not different, f'{len(different)} of {len(expected)} tensors differ, e.g. {different[:3]}'


def truncate(path):
    with open(path, 'r+b') as f:
        f.truncate(os.path.getsize(path) // 2)


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory):
    work_dir = tmp_path_factory.mktemp('uninterrupted')
    train(work_dir)
    return work_dir


# ---------------------------------------------------------------- killed runs and resume


def files_in(folder):
    """{relative path: bytes} of every file under ``folder``."""
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob('*')) if path.is_file()}


@pytest.mark.slow
def test_run_killed_mid_epoch_is_resumed_by_the_same_command_to_bit_identical_weights(uninterrupted, tmp_path):
    killed(tmp_path, '--kill-at-iter', '3')  # the second iteration of epoch 2
    holder = json.loads((tmp_path / 'train.lock').read_text())
    assert 'train_with_faults.py' in holder['command']  # the killed run's lock file stays ...
    output = train(tmp_path)  # ... and holds nothing: the same command again takes it, and resumes
    assert (f'{tmp_path} holds an unfinished training of this config (newest complete checkpoint '
            f'{tmp_path / "epoch_1.pth"}, at 1 of 3 epochs): resuming it.') in output
    assert f'Resuming from {tmp_path / "epoch_1.pth"}' in output
    assert_same_weights(uninterrupted / 'epoch_3.pth', tmp_path / 'epoch_3.pth')


@pytest.mark.slow
def test_a_finished_training_run_again_is_reported_not_trained_again(uninterrupted, tmp_path):
    work_dir = tmp_path / 'finished'
    shutil.copytree(uninterrupted, work_dir)
    (work_dir / 'last_checkpoint').write_text(str(work_dir / 'epoch_3.pth'))  # the copy's own
    before = files_in(work_dir)
    output = train(work_dir)
    assert f'{work_dir} holds a finished training of this config (3 of 3 epochs): nothing to train.' in output
    assert 'Last validation: accuracy/top1: ' in output and f'Last checkpoint: {work_dir / "epoch_3.pth"}' in output
    assert 'Best checkpoint: ' in output and f'give another --work-dir or delete {work_dir}' in output
    assert 'Epoch(train)' not in output and files_in(work_dir) == before  # no training, no log folder


@pytest.mark.slow
def test_run_killed_while_writing_a_checkpoint_keeps_the_previous_one(uninterrupted, tmp_path):
    keep_one = ['default_hooks.checkpoint.max_keep_ckpts=1']
    killed(tmp_path, '--kill-writing', 'epoch_2.pth', options=keep_one)
    assert not (tmp_path / 'epoch_2.pth').exists()  # only its partial temporary file
    assert len(list(tmp_path.glob('.epoch_2.pth.*.tmp'))) == 1
    assert (tmp_path / 'last_checkpoint').read_text() == str(tmp_path / 'epoch_1.pth')
    assert load_local_checkpoint(str(tmp_path / 'epoch_1.pth'))['meta']['epoch'] == 1  # not yet dropped
    output = train(tmp_path, '--resume', options=keep_one)
    assert 'the partial write of a killed run' in output and not list(tmp_path.glob('.*.tmp'))
    assert sorted(p.name for p in tmp_path.glob('epoch_*.pth')) == ['epoch_3.pth']
    assert_same_weights(uninterrupted / 'epoch_3.pth', tmp_path / 'epoch_3.pth')


@pytest.mark.slow
def test_best_checkpoint_survives_a_kill_and_resume_skips_a_damaged_latest_one(uninterrupted, tmp_path):
    # every validation improves the metric, so epoch 2 replaces the best checkpoint of epoch 1
    killed(tmp_path, '--improving-metric', 'accuracy/top1', '--kill-writing', 'best_accuracy_top1_epoch_2')
    best = load_local_checkpoint(str(tmp_path / 'best_accuracy_top1_epoch_1.pth'))
    assert best['meta']['epoch'] == 1 and not (tmp_path / 'best_accuracy_top1_epoch_2.pth').exists()

    latest = tmp_path / 'epoch_2.pth'
    assert (tmp_path / 'last_checkpoint').read_text() == str(latest)
    truncate(latest)
    _, output = failing(sys.executable, 'tools/train.py', CONFIG, '--work-dir', str(tmp_path), '--resume',
                        str(latest), '--cfg-options', *TINY, *EPOCHS)
    assert f'{latest} is a damaged or truncated PyTorch checkpoint' in output  # a path given is used as is
    output = train(tmp_path, '--resume')  # the latest is skipped, with a message
    assert f'Cannot resume from the latest checkpoint: {latest} (ValueError: {latest} is a damaged' in output
    assert f'Resuming from {tmp_path / "epoch_1.pth"}, the newest complete checkpoint in {tmp_path}' in output
    assert_same_weights(uninterrupted / 'epoch_3.pth', tmp_path / 'epoch_3.pth')


@pytest.mark.slow
def test_iteration_based_run_killed_and_resumed_to_bit_identical_weights(tmp_path):
    """IterBasedTrainLoop draws the batches it already trained on again when it resumes (running
    their random flips); the random state is restored after those draws."""
    train(tmp_path / 'uninterrupted', schedule=ITERATIONS)
    killed(tmp_path / 'killed', '--kill-at-iter', '3', schedule=ITERATIONS)
    output = train(tmp_path / 'killed', '--resume', schedule=ITERATIONS)
    assert f'Resuming from {tmp_path / "killed" / "iter_2.pth"}' in output and 'Advance dataloader 2 steps' in output
    assert_same_weights(tmp_path / 'uninterrupted' / 'iter_6.pth', tmp_path / 'killed' / 'iter_6.pth')


@pytest.mark.slow
def test_second_training_in_a_work_dir_stops_before_writing_anything(tmp_path):
    # the files of the training that holds the work_dir, played by this test
    (tmp_path / 'pervit_t_shapes.py').write_text("# the running training's config dump\n")
    (tmp_path / '20260101_000000' / 'vis_data').mkdir(parents=True)
    (tmp_path / '20260101_000000' / '20260101_000000.log').write_text('its log\n')
    with WorkDirLock(str(tmp_path)):
        before = files_in(tmp_path)
        _, output = failing(sys.executable, 'tools/train.py', CONFIG, '--work-dir', str(tmp_path),
                            '--cfg-options', *TINY, *EPOCHS)
    assert f'WorkDirInUseError: {tmp_path} is in use by another training: pid {os.getpid()} on ' \
           f'{socket.gethostname()}, started ' in output
    assert 'give this run another --work-dir' in output
    assert files_in(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == [
        '20260101_000000', 'pervit_t_shapes.py', 'train.lock']  # no log folder, config dump or checkpoint


def test_work_dir_lock_is_exclusive_and_released(tmp_path):
    first, second = WorkDirLock(str(tmp_path)), WorkDirLock(str(tmp_path))
    with first:
        with pytest.raises(WorkDirInUseError, match=rf'pid {os.getpid()} on {socket.gethostname()}, started .*: '):
            second.acquire()
    with second:  # free once released, the file still describing its last holder
        assert json.loads((tmp_path / 'train.lock').read_text())['pid'] == os.getpid()


# ---------------------------------------------------------------- strict loading and the opt-in


@pytest.fixture(scope='module')
def pervit_small_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp('weights') / 'pervit_small.pth'
    torch.save(posattn.create_model('pervit_small').state_dict(), path)
    return path


@pytest.mark.slow
def test_tools_test_refuses_a_checkpoint_of_another_model(pervit_small_checkpoint, tmp_path):
    _, output = failing(sys.executable, 'tools/test.py', CONFIG, str(pervit_small_checkpoint), '--work-dir',
                        str(tmp_path), '--cfg-options', *TINY)
    assert f'checkpoint {pervit_small_checkpoint} does not fit ImageClassifier of pervit_t_shapes.py' in output
    assert "it holds posattn's pervit_small in the posattn layout" in output
    assert 'missing keys (' in output and 'unexpected keys (269): stem.layers.0.conv.weight' in output
    assert '--partial-load' in output and 'accuracy/top1: ' not in output


@pytest.mark.slow
def test_load_from_a_checkpoint_of_another_model_stops_training(pervit_small_checkpoint, tmp_path):
    _, output = failing(sys.executable, 'tools/train.py', CONFIG, '--work-dir', str(tmp_path),
                        '--cfg-options', *TINY, *EPOCHS, f'load_from={pervit_small_checkpoint}')
    assert "does not fit ImageClassifier of pervit_t_shapes.py" in output and 'pervit_small' in output
    assert not list(tmp_path.glob('*.pth'))


@pytest.mark.slow
def test_a_training_checkpoint_records_each_phi_and_tools_test_refuses_other_settings(uninterrupted, tmp_path):
    """The checkpoints tools/train.py writes record each Φp (under the classifier's module paths);
    tools/test.py with a config whose Φp computes otherwise (PerViT's Φp with one projection layer)
    refuses the checkpoint naming both."""
    from posattn.convert import saved_phi_records
    records = saved_phi_records(load_local_checkpoint(str(uninterrupted / 'epoch_3.pth')))
    assert records['backbone.model.blocks.0.attn.phi']['name'] == 'peripheral'
    assert records['backbone.model.blocks.0.cpe'] == {'name': 'peg', 'settings': {'dim': 16, 'residual': False}}
    _, failed = failing(sys.executable, 'tools/test.py', CONFIG, str(uninterrupted / 'epoch_3.pth'), '--work-dir',
                        str(tmp_path), '--cfg-options', *TINY, 'model.backbone.phi_multi_layer=False')
    assert ("backbone.model.blocks.0.attn.phi: the weights are those of a peripheral Φp with multi_layer=True, this "
            "one has multi_layer=False") in failed


@pytest.mark.slow
def test_tools_test_partial_load_evaluates_and_lists_the_skipped_keys(uninterrupted, tmp_path):
    """... in the work_dir of a running training (played by this test), whose files stay as they are."""
    (tmp_path / 'pervit_t_shapes.py').write_text("# the running training's config dump\n")
    with WorkDirLock(str(tmp_path)):
        before = files_in(tmp_path)
        output = run_tool(sys.executable, 'tools/test.py', CONFIG, str(uninterrupted / 'epoch_3.pth'),
                          '--partial-load', '--work-dir', str(tmp_path), '--cfg-options', *TINY,
                          'model.head.num_classes=7', timeout=600, env=ONE_THREAD)
    after = files_in(tmp_path)
    assert {name: after[name] for name in before} == before
    (log_folder,) = [path for path in tmp_path.iterdir() if path.is_dir()]
    assert (log_folder / 'pervit_t_shapes.py').is_file()  # the evaluation's own config dump
    assert 'Partial load of checkpoint' in output and '2 keys skipped' in output
    assert 'wrong shape: head.fc.weight: checkpoint (6, 24), model (7, 24)' in output
    assert 'wrong shape: head.fc.bias: checkpoint (6,), model (7,)' in output
    assert 'accuracy/top1: ' in output


def classifier(num_classes=6):
    from mmpretrain.registry import MODELS
    return MODELS.build(dict(type='ImageClassifier', backbone=dict(type='PosattnPerViT', arch='tiny'),
                             neck=dict(type='GlobalAveragePooling'),
                             head=dict(type='LinearClsHead', num_classes=num_classes, in_channels=280)))


def test_load_model_weights_is_strict_names_the_backbone_and_loads_partially_on_request(monkeypatch):
    checkpoint = {'meta': {}, 'state_dict': classifier(6).state_dict()}
    model = classifier(7)
    with pytest.raises(ValueError) as error:
        load_model_weights(model, checkpoint, source='x.pth', target='the classifier')
    message = str(error.value)
    assert message.startswith('checkpoint x.pth does not fit the classifier:')
    assert 'wrong shapes (2): head.fc.weight: checkpoint (6, 280), model (7, 280)' in message
    assert "its backbone is posattn's pervit_tiny, as is this model's: the difference is outside" in message
    assert '--partial-load' in message

    logged = []
    monkeypatch.setattr(runner_module, 'print_log', lambda message, logger=None, level=None: logged.append(message))
    skipped = load_model_weights(model, checkpoint, source='x.pth', target='the classifier', partial=True)
    assert skipped == ['wrong shape: head.fc.weight: checkpoint (6, 280), model (7, 280)',
                       'wrong shape: head.fc.bias: checkpoint (6,), model (7,)']
    assert all(entry in logged[0] for entry in skipped)
    assert torch.equal(model.backbone.model.blocks[3].mlp.fc1.weight,
                       checkpoint['state_dict']['backbone.model.blocks.3.mlp.fc1.weight'])
    with pytest.raises(ValueError, match='none of its weights fits the classifier, so even a partial load'):
        load_model_weights(model, {'state_dict': {'other.weight': torch.ones(1)}}, source='y.pth',
                           target='the classifier', partial=True)
    with pytest.raises(ValueError, match='checkpoint z.pth holds a Tensor, not a state_dict'):
        load_model_weights(model, torch.ones(1), source='z.pth', target='the classifier')


def test_analyze_loads_a_training_checkpoint_strictly(tmp_path):
    from analyze import build_model
    from mmengine.config import Config
    cfg = Config.fromfile(REPO / CONFIG)
    path = tmp_path / 'seven_classes.pth'
    torch.save({'meta': {}, 'state_dict': classifier(7).state_dict()}, path)
    with pytest.raises(ValueError, match=r'does not fit ImageClassifier of .*pervit_t_shapes.py:') as error:
        build_model(cfg, str(path))
    assert 'wrong shapes (2): head.fc.weight: checkpoint (7, 280), model (6, 280)' in str(error.value)


def test_backbone_pretrained_init_is_strict_and_partial_with_strict_false(pervit_small_checkpoint, tmp_path,
                                                                          monkeypatch):
    wrong = PosattnPerViT(arch='tiny', init_cfg=dict(type='Pretrained', checkpoint=str(pervit_small_checkpoint)))
    with pytest.raises(ValueError, match=r"does not fit PosattnPerViT:\n  this is a pervit_small checkpoint"):
        wrong.init_weights()

    weights = posattn.create_model('pervit_tiny').state_dict()
    del weights['blocks.11.mlp.fc2.bias']
    weights['norm.weight'] = torch.ones(7)
    path = tmp_path / 'pervit_tiny_damaged.pth'
    torch.save(weights, path)
    logged = []
    monkeypatch.setattr(backbones, 'print_log',
                        lambda message, logger=None, level=None: logged.append((message, level)))
    backbone = PosattnPerViT(arch='tiny', init_cfg=dict(type='Pretrained', checkpoint=str(path), strict=False))
    backbone.init_weights()
    assert torch.equal(backbone.model.blocks[5].attn.qkv.weight, weights['blocks.5.attn.qkv.weight'])
    partial = [message for message, level in logged if level == logging.WARNING and 'partial load' in message]
    assert len(partial) == 1 and 'missing: blocks.11.mlp.fc2.bias' in partial[0]
    assert 'wrong shape: norm.weight: checkpoint (7,), model (280,)' in partial[0]
    assert logged[-1][0].endswith('not loaded, the classifier: head.bias, head.weight')


def test_every_config_trains_with_the_posattn_runner_and_safe_checkpoints():
    from mmengine.config import Config
    for path in sorted((REPO / 'configs').glob('*.py')):
        cfg = Config.fromfile(path)
        assert (cfg.runner_type, cfg.default_hooks.checkpoint.type, cfg.partial_load) == \
            ('PosattnRunner', 'SafeCheckpointHook', False), path.name


class Toy(BaseModel):
    """A model for runners built in the test process; records mmcv's NMS as each prediction sees it."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(1, 1)
        self.nms_seen = []

    def forward(self, inputs=None, data_samples=None, mode='tensor'):
        import mmcv._ext
        self.nms_seen.append(mmcv._ext.nms)
        outputs = self.linear(torch.stack(inputs) if isinstance(inputs, list) else inputs)
        return list(outputs) if mode == 'predict' else outputs


class CountMetric(BaseMetric):
    def process(self, data_batch, data_samples):
        self.results.append(len(data_samples))

    def compute_metrics(self, results):
        return dict(count=sum(results))


_runner_names = itertools.count()
# mmengine's training parts, enough for the constructor (it builds them when training starts)
TRAINING = dict(train_dataloader=dict(dataset=[], batch_size=1), train_cfg=dict(by_epoch=True, max_epochs=1),
                optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.1)))


def toy_runner(work_dir, **options):
    from mmengine.registry import DefaultScope
    from posattn_openmmlab import PosattnRunner
    with DefaultScope.overwrite_default_scope('mmengine'):  # the runner's scope ends with the block
        return PosattnRunner(model=Toy(), work_dir=str(work_dir), experiment_name=f'toy_{next(_runner_names)}',
                             default_hooks=dict(checkpoint=dict(type='SafeCheckpointHook', interval=1)), **options)


def test_auto_resume_reads_the_candidates_newest_first(tmp_path):
    """What --resume without a path picks: the pointer's checkpoint when it reads, else the newest
    complete one (an empty pointer included), nothing without checkpoints, an error when all are damaged."""
    runner = toy_runner(tmp_path)
    assert runner._newest_complete_checkpoint() is None
    for epoch in (1, 2, 10):
        torch.save({'meta': {'epoch': epoch}, 'state_dict': runner.model.state_dict()}, tmp_path / f'epoch_{epoch}.pth')
    (tmp_path / 'last_checkpoint').write_text(str(tmp_path / 'epoch_2.pth'))
    assert runner._newest_complete_checkpoint() == str(tmp_path / 'epoch_2.pth')
    (tmp_path / 'last_checkpoint').write_text('')  # a pointer that a killed plain CheckpointHook emptied
    assert runner._newest_complete_checkpoint() == str(tmp_path / 'epoch_10.pth')
    for epoch in (1, 2, 10):
        truncate(tmp_path / f'epoch_{epoch}.pth')
    with pytest.raises(RuntimeError, match=rf'no complete checkpoint in {tmp_path}; every one is damaged: '
                                           rf'{tmp_path / "epoch_10.pth"} \(ValueError'):
        runner._newest_complete_checkpoint()


def counted_reads(monkeypatch):
    """The paths the runner module reads checkpoints from, in order, from now on."""
    reads = []
    read = runner_module.load_checkpoint_file

    def counted(filename, map_location=None):
        reads.append(str(filename))
        return read(filename, map_location=map_location)
    monkeypatch.setattr(runner_module, 'load_checkpoint_file', counted)
    return reads


def toy_weights(value):
    return {'linear.weight': torch.full((1, 1), value), 'linear.bias': torch.full((1,), value)}


def test_resume_loads_the_checkpoint_its_search_read(tmp_path, monkeypatch):
    """--resume without a path reads the newest checkpoint once: the search reads it to know it is complete,
    and loading it takes what the search read (once); a runner given a point found before it was built
    (tools/train.py's) reads nothing while that point is still the newest, unchanged."""
    for epoch in (1, 2):
        torch.save({'meta': {'epoch': epoch}, 'state_dict': toy_weights(epoch)}, tmp_path / f'epoch_{epoch}.pth')
    newest = str(tmp_path / 'epoch_2.pth')
    found = runner_module.find_resumable_checkpoint(str(tmp_path), ['epoch_{}.pth'])
    reads = counted_reads(monkeypatch)

    runner = toy_runner(tmp_path)
    assert runner._newest_complete_checkpoint() == newest and reads == [newest]
    assert runner.load_checkpoint(newest)['meta'] == {'epoch': 2} and reads == [newest]
    assert torch.equal(runner.model.linear.bias, torch.full((1,), 2.0))
    runner.load_checkpoint(newest)
    assert reads == [newest] * 2  # handed over once

    runner = toy_runner(tmp_path)
    runner.resume_from(found)
    assert runner._newest_complete_checkpoint() == newest
    assert runner.load_checkpoint(newest) is found.checkpoint and reads == [newest] * 2

    torch.save({'meta': {'epoch': 2}, 'state_dict': toy_weights(5)}, tmp_path / 'replaced.pth')
    os.replace(tmp_path / 'replaced.pth', newest)  # another file under the name found
    runner.resume_from(found)
    assert runner._newest_complete_checkpoint() == newest and reads == [newest] * 3
    assert runner.load_checkpoint(newest) is not found.checkpoint and reads == [newest] * 3
    assert torch.equal(runner.model.linear.bias, torch.full((1,), 5.0))

    torch.save({'meta': {'epoch': 3}, 'state_dict': toy_weights(3)}, tmp_path / 'epoch_3.pth')  # a newer one
    runner.resume_from(runner_module.find_resumable_checkpoint(str(tmp_path), ['epoch_{}.pth']))
    (tmp_path / 'epoch_4.pth').write_bytes((tmp_path / 'epoch_3.pth').read_bytes())
    assert runner._newest_complete_checkpoint() == str(tmp_path / 'epoch_4.pth')


def test_load_model_weights_reads_every_wrapping_of_a_state_dict():
    for checkpoint in (toy_weights(4), {'state_dict': toy_weights(4), 'meta': {}}, {'model': toy_weights(4)}):
        model = Toy()
        assert load_model_weights(model, checkpoint, source='x.pth', target='Toy') == []
        assert torch.equal(model.linear.weight, torch.full((1, 1), 4.0))


def test_tools_use_a_posattn_runner_only():
    from _common import build_runner
    from mmengine.config import Config
    with pytest.raises(ValueError, match=r"runner_type='Runner' in the config is not a PosattnRunner"):
        build_runner(Config(dict(runner_type='Runner')))


def test_a_training_runner_locks_its_work_dir_before_writing_and_an_evaluating_one_does_not(tmp_path):
    (tmp_path / 'toy.py').write_text("# the running training's config dump\n")
    with WorkDirLock(str(tmp_path)):  # this test plays the training that holds the work_dir
        before = files_in(tmp_path)
        with pytest.raises(WorkDirInUseError, match=rf'{tmp_path} is in use by another training: pid {os.getpid()}'):
            toy_runner(tmp_path, **TRAINING)
        assert files_in(tmp_path) == before and len(list(tmp_path.iterdir())) == 2  # no log folder either
        evaluating = toy_runner(tmp_path)  # no training parts: no lock, its config dump in its log folder
        assert files_in(tmp_path)['toy.py'] == before['toy.py']
        assert (tmp_path / evaluating.timestamp / f'{evaluating.timestamp}.py').is_file()
    training = toy_runner(tmp_path, **TRAINING)  # the work_dir is free: the lock is held from the constructor ...
    with pytest.raises(WorkDirInUseError):
        WorkDirLock(str(tmp_path)).acquire()
    training._release_work_dir()  # ... until the run ends (here: none runs)
    WorkDirLock(str(tmp_path)).acquire()


def test_runs_route_mmcv_ops_as_configured_and_give_them_back(tmp_path):
    import mmcv._ext
    from mmengine.dataset import pseudo_collate
    from torch.utils.data import DataLoader
    from posattn_openmmlab.torchvision_ops import devices_without_mmcv_kernels

    def evaluated(**cfg):
        runner = toy_runner(tmp_path / str(len(cfg)), cfg=cfg, test_cfg=dict(), test_evaluator=[CountMetric()],
                            test_dataloader=DataLoader([dict(inputs=torch.ones(1))], collate_fn=pseudo_collate))
        assert runner.test() == dict(count=1)
        return runner.model.nms_seen[-1]

    mmcv_nms = mmcv._ext.nms
    routed = evaluated(mmcv_ops_to_torchvision=['cpu'])
    assert routed is not mmcv_nms and routed.__qualname__.startswith('_nms') and mmcv._ext.nms is mmcv_nms
    default = evaluated()  # 'auto': CUDA tensors, where mmcv has no CUDA kernels and there is a GPU
    assert (default is mmcv_nms) == (not devices_without_mmcv_kernels()) and mmcv._ext.nms is mmcv_nms
    with pytest.raises(ValueError, match=r"mmcv_ops_to_torchvision='cuda' in the config: use 'auto' .* or a list "
                                         r"of device types, e.g. \['cuda'\]"):
        evaluated(mmcv_ops_to_torchvision='cuda')


def saved_training(work_dir, cfg, epoch, name=None):
    """A checkpoint as mmengine's runner saves one (its meta holds the config's text), pointed at by
    last_checkpoint."""
    work_dir.mkdir(exist_ok=True)
    path = work_dir / (name or f'epoch_{epoch}.pth')
    torch.save({'meta': {'cfg': cfg.pretty_text, 'epoch': epoch, 'iter': 2 * epoch}, 'state_dict': {}}, path)
    (work_dir / 'last_checkpoint').write_text(str(path))
    return path


def test_tools_train_resumes_an_unfinished_training_and_refuses_other_settings(tmp_path, capsys):
    """tools/train.py without --resume in a work_dir that holds a training already."""
    import train as train_tool

    def config(*options):
        args = train_tool.parse_args([str(REPO / CONFIG), '--work-dir', str(tmp_path / 'run'), '--cfg-options',
                                      *TINY, *EPOCHS, *options])
        return train_tool.build_config(args)

    cfg = config()
    assert train_tool.continue_previous_training(cfg) and not cfg.resume  # nothing there: from the beginning
    latest = saved_training(tmp_path / 'run', config(), epoch=2)
    assert train_tool.continue_previous_training(cfg) and (cfg.resume, cfg.load_from) == (True, None)
    assert f'holds an unfinished training of this config (newest complete checkpoint {latest}, at 2 of 3 epochs): ' \
           'resuming it' in capsys.readouterr().out

    with pytest.raises(SystemExit) as refusal:
        train_tool.continue_previous_training(config('optim_wrapper.optimizer.lr=0.001', 'train_cfg.max_epochs=4'))
    assert str(refusal.value).startswith(f'{tmp_path / "run"} holds a training with other settings than this one '
                                         f'({latest}):\n  optim_wrapper.optimizer.lr: was 0.0003, now 0.001\n'
                                         f'  param_scheduler.1.end: was 3, now 4\n'  # the schedule ends with the run
                                         f'  train_cfg.max_epochs: was 3, now 4\nTo train from the beginning, '
                                         f'give another --work-dir or delete')
    torch.save({'state_dict': {}}, latest)  # no config recorded: not a training of this tool
    with pytest.raises(SystemExit, match=r'\(the checkpoint records no config\)'):
        train_tool.continue_previous_training(config())

    truncate(latest)
    with pytest.raises(SystemExit, match=rf'holds checkpoints of an earlier training, and none reads completely: '
                                         rf'{latest} \(ValueError: .*give another --work-dir or delete them'):
        train_tool.continue_previous_training(config())

    (tmp_path / 'run' / 'last_checkpoint').write_text('s3://bucket/run/epoch_2.pth')  # remote: mmengine resumes it
    cfg = config()
    assert train_tool.continue_previous_training(cfg) and cfg.resume


# ---------------------------------------------------------------- the pieces


def test_atomic_write_leaves_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    path = tmp_path / 'epoch_1.pth'
    atomic_write(path, b'old')

    class Interrupted(BaseException):
        pass

    def broken_open(*args, **kwargs):
        raise Interrupted
    monkeypatch.setattr('builtins.open', broken_open)
    with pytest.raises(Interrupted):
        atomic_write(path, b'new')
    monkeypatch.undo()
    assert path.read_bytes() == b'old' and os.listdir(tmp_path) == ['epoch_1.pth']

    exited = subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'], capture_output=True, text=True)
    dead, alive = int(exited.stdout), os.getpid()
    for pid in (dead, alive):
        (tmp_path / f'.epoch_2.pth.{pid}.0a1b2c3d.tmp').write_bytes(b'partial')
    assert [p.name for p in remove_partial_writes(tmp_path)] == [f'.epoch_2.pth.{dead}.0a1b2c3d.tmp']
    assert (tmp_path / f'.epoch_2.pth.{alive}.0a1b2c3d.tmp').exists()


def test_random_state_survives_a_weights_only_round_trip(tmp_path):
    import random
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    torch.randn(5), np.random.randn(3), random.random()  # numpy keeps a cached Gaussian now
    path = tmp_path / 'state.pth'
    torch.save({'random_state': capture_random_state()}, path)
    expected = torch.randn(4), np.random.randn(4), random.random()
    restore_random_state(load_local_checkpoint(str(path))['random_state'])
    got = torch.randn(4), np.random.randn(4), random.random()
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1]) and got[2] == expected[2]


# ---------------------------------------------------------------- the dense set's staging folders


def test_dense_set_removes_the_staging_folders_of_killed_generations(tmp_path):
    root = tmp_path / 'shapes_dense'
    small = dict(img_size=(64, 96), sizes=dict(train=2, val=1))
    code = ('import os, signal\n'
            'from posattn_openmmlab import dense_shapes_dataset as dense_shapes\n'
            'def killed(*args):\n'
            '    os.kill(os.getpid(), signal.SIGKILL)\n'
            'dense_shapes._write_split = killed\n'
            f'dense_shapes.ensure_dense_shapes({str(root)!r}, **{small!r})\n')
    generation = subprocess.run([sys.executable, '-c', code], env=dict(os.environ, **ONE_THREAD))
    assert generation.returncode == -signal.SIGKILL
    (left,) = tmp_path.glob('.shapes_dense-*')
    now = time.time()
    others = {}
    for name, host, pid, started in [('live', socket.gethostname(), os.getpid(), now),
                                     ('elsewhere', 'another-host', 1, now - 60),
                                     ('old', 'another-host', 1, now - STALE_STAGING_SECONDS - 60)]:
        others[name] = tmp_path / f'.shapes_dense-{name}'
        others[name].mkdir()
        (others[name] / '.writer.json').write_text(json.dumps(dict(host=host, pid=pid, started=started)))
    ensure_dense_shapes(root, **small)
    assert (root / 'meta.json').is_file()
    assert not left.exists() and not others['old'].exists()
    assert others['live'].exists() and others['elsewhere'].exists()  # their writers may still be at work


class PhiToy(Toy):
    """The toy with a peripheral attention layer, recording the positional cache it runs under."""

    def __init__(self):
        super().__init__()
        self.attention = posattn.Attention(4, 2, phi='peripheral')
        self.caches_seen, self.biases = [], []
        self.attention.logits_probe.register_forward_pre_hook(lambda probe, args: self.biases.append(args[2]))

    def forward(self, inputs=None, data_samples=None, mode='tensor'):
        self.caches_seen.append(self.attention.phi.position_cache)
        tokens = torch.ones(len(inputs), 4, 4)
        self.attention(tokens, (2, 2))
        self.caches_seen.append(len(self.attention.phi.position_cache or ()))
        return super().forward(inputs, data_samples, mode)


def test_evaluation_runs_inside_the_position_cache(tmp_path):
    """PosattnRunner computes each Φp once per grid while it tests (and validates), and keeps
    nothing afterwards."""
    from mmengine.dataset import pseudo_collate
    from mmengine.registry import DefaultScope
    from torch.utils.data import DataLoader
    from posattn_openmmlab import PositionCacheHook, PosattnRunner
    with DefaultScope.overwrite_default_scope('mmengine'):
        runner = PosattnRunner(model=PhiToy(), work_dir=str(tmp_path), test_cfg=dict(),
                               test_evaluator=[CountMetric()], experiment_name=f'toy_{next(_runner_names)}',
                               test_dataloader=DataLoader([dict(inputs=torch.ones(1))] * 3, batch_size=1,
                                                          collate_fn=pseudo_collate))
    assert sum(isinstance(hook, PositionCacheHook) for hook in runner.hooks) == 1
    assert runner.test() == dict(count=3)
    first_cache, *_ = runner.model.caches_seen
    assert first_cache is not None and runner.model.caches_seen == [first_cache, 1] * 3
    assert all(bias is runner.model.biases[0] for bias in runner.model.biases)  # computed once, then served
    assert runner.model.attention.phi.position_cache is None and len(first_cache) == 0


def vit_classifier(**phi):
    from mmpretrain.registry import MODELS
    backbone = dict(type='PosattnViT', arch=dict(embed_dims=32, num_layers=2, num_heads=2, feedforward_channels=64),
                    img_size=32, patch_size=8, **phi)
    return MODELS.build(dict(type='ImageClassifier', backbone=backbone,
                             head=dict(type='VisionTransformerClsHead', num_classes=3, in_channels=32)))


def test_checkpoints_of_another_phi_are_refused_by_load_from_resume_and_pretrained_init(tmp_path, monkeypatch):
    """A checkpoint written as mmengine writes one (its state_dict's records under ``backbone.model.``)
    of a ViT with RoPE's 'xy' axis order, into one with 'yx': the same keys and shapes. ``load_from``,
    ``resume`` and tools/test.py refuse it naming both; a partial load skips that Φp; a backbone's
    ``Pretrained`` init refuses it too."""
    from mmengine.runner.checkpoint import weights_to_cpu
    saved = vit_classifier(phi='rope', phi_cfg=dict(axis_order='xy'))
    checkpoint = {'meta': {}, 'state_dict': weights_to_cpu(saved.state_dict())}
    model = vit_classifier(phi='rope')
    with pytest.raises(ValueError) as error:
        load_model_weights(model, checkpoint, source='x.pth', target='the classifier')
    assert ("other Φp (2): backbone.model.blocks.0.attn.phi: the weights are those of a rope Φp with axis_order='xy', "
            "this one has axis_order='yx'") in str(error.value)
    monkeypatch.setattr(runner_module, 'print_log', lambda *args, **kwargs: None)
    skipped = load_model_weights(model, checkpoint, source='x.pth', target='the classifier', partial=True)
    assert skipped[0].startswith("other Φp: backbone.model.blocks.0.attn.phi: the weights are those of a rope Φp")
    assert torch.equal(model.backbone.model.blocks[1].attn.qkv.weight, saved.backbone.model.blocks[1].attn.qkv.weight)

    path = tmp_path / 'classifier.pth'
    torch.save(checkpoint, path)
    backbone = vit_classifier(phi='rope').backbone
    backbone.init_cfg = dict(type='Pretrained', checkpoint=str(path), prefix='backbone.')
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.phi: the weights are those of a rope Φp with "
                                         r"axis_order='xy'"):
        backbone.init_weights()
