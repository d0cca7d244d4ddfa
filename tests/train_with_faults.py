"""tools/train.py with an injected death, for tests/test_openmmlab_checkpoints.py.

    python tests/train_with_faults.py --kill-at-iter 8 -- CONFIG [train.py arguments]
    python tests/train_with_faults.py --kill-writing epoch_2.pth -- CONFIG [train.py arguments]

``--kill-at-iter N`` SIGKILLs the process just before training iteration N (counted from 0 over
the whole run). ``--kill-writing NAME`` SIGKILLs it in the middle of writing the first file whose
name contains NAME (whatever file the writer opens for it, final or temporary): half the bytes
are written and flushed to disk, then the process dies. ``--improving-metric KEY`` replaces the
validation metric KEY with the epoch number, so that every validation saves a new best
checkpoint. Nothing else changes: the rest is tools/train.py's ``main``, and the hooks join the
built runner, not the config, so the checkpoints record the config tools/train.py would.
"""
import argparse
import builtins
import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'tools'))

import train  # noqa: E402  (tools/train.py; puts the repository root on sys.path)
from mmengine.hooks import Hook  # noqa: E402


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class KillAtIterationHook(Hook):
    def __init__(self, iteration):
        self.iteration = iteration

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        if runner.iter == self.iteration:
            die()


class ImprovingMetricHook(Hook):
    priority = 'HIGHEST'  # before CheckpointHook reads the metrics

    def __init__(self, key):
        self.key = key

    def after_val_epoch(self, runner, metrics=None):
        metrics[self.key] = float(runner.epoch)


class _HalfWriteThenDie:
    """A binary file whose first ``write`` writes half its bytes, syncs them and kills the process."""

    def __init__(self, file):
        self._file = file

    def write(self, data):
        self._file.write(bytes(data[:len(data) // 2]))
        self._file.flush()
        os.fsync(self._file.fileno())
        die()

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self._file.close()


def kill_while_writing(fragment: str) -> None:
    real_open = builtins.open

    def open_(file, mode='r', *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        writing = 'w' in mode or 'x' in mode
        if writing and isinstance(file, (str, os.PathLike)) and fragment in os.path.basename(os.fspath(file)):
            return _HalfWriteThenDie(handle)
        return handle

    builtins.open = open_


def main():
    if '--' not in sys.argv:
        raise SystemExit(__doc__)
    split = sys.argv.index('--')
    parser = argparse.ArgumentParser()
    parser.add_argument('--kill-at-iter', type=int)
    parser.add_argument('--kill-writing')
    parser.add_argument('--improving-metric')
    faults = parser.parse_args(sys.argv[1:split])
    hooks = []
    if faults.kill_at_iter is not None:
        hooks.append(KillAtIterationHook(faults.kill_at_iter))
    if faults.improving_metric:
        hooks.append(ImprovingMetricHook(faults.improving_metric))
    if faults.kill_writing:
        kill_while_writing(faults.kill_writing)

    build_runner = train.build_runner

    def with_faults(cfg):
        runner = build_runner(cfg)
        for hook in hooks:
            runner.register_hook(hook, priority=hook.priority)
        return runner

    train.build_runner = with_faults
    train.main(sys.argv[split + 1:])


if __name__ == '__main__':
    main()
