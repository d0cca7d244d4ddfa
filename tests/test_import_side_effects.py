"""Importing posattn (and posattn_openmmlab) changes nothing outside them: checked in a fresh process
by observing timm's models, torch's weights-only allow-list and the loading of an ordinary (not
posattn) checkpoint, and with OpenMMLab also mmengine's checkpoint loader and file backends,
mmengine.dump through a symlink and mmcv's compiled ops, before and after the imports."""
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, needs_openmmlab

OBSERVE = r'''
import json, os, sys, tempfile
import numpy as np
import timm
import torch

WITH_OPENMMLAB = sys.argv[1] == 'openmmlab'
if WITH_OPENMMLAB:
    import mmcv._ext
    import mmengine
    from mmengine.fileio.backends import registry_utils
    from mmengine.runner import CheckpointLoader

folder = tempfile.mkdtemp()
checkpoint = os.path.join(folder, 'ordinary.pth')  # as mmengine writes one: numpy in its meta
torch.save({'meta': {'x': np.arange(3)}, 'state_dict': {'w': torch.ones(2)}}, checkpoint)
target, link = os.path.join(folder, 'target.json'), os.path.join(folder, 'link.json')
if WITH_OPENMMLAB:
    mmengine.dump({'written': 'before'}, target)
    os.symlink(target, link)
kept = []  # the objects observed, alive to the end so that their ids stay theirs


def named(obj):
    kept.append(obj)
    return f'{getattr(obj, "__module__", None)}.{getattr(obj, "__qualname__", type(obj).__name__)} at {id(obj):#x}'


def outcome(load):
    """The keys ``load`` reads from the ordinary checkpoint, or the name of the error it raises."""
    try:
        return sorted(load(checkpoint, map_location='cpu'))
    except Exception as error:
        return type(error).__name__


def observe_openmmlab(when):
    mmengine.dump({'written': when}, link)
    with open(target) as f:
        through_link = json.load(f)
    return {
        "mmengine's loader for local paths": named(CheckpointLoader._get_checkpoint_loader(checkpoint)),
        "mmengine's local backend": named(registry_utils.prefix_to_backends['']),
        "mmengine's backend named local": named(registry_utils.backends['local']),
        "mmengine's backend names": sorted(registry_utils.backends),
        'an ordinary checkpoint through CheckpointLoader': outcome(CheckpointLoader.load_checkpoint),
        'mmengine.dump through a symlink': [os.path.islink(link), through_link == {'written': when}],
        "mmcv's compiled ops": {name: named(getattr(mmcv._ext, name)) for name in sorted(dir(mmcv._ext))
                                if not name.startswith('_')},
    }


def observe(when):
    observed = {
        'timm models': timm.list_models(),
        'an ordinary checkpoint through torch.load': outcome(torch.load),
        "torch's weights-only allow-list": [named(g) for g in torch.serialization.get_safe_globals()],
    }
    return dict(observed, **observe_openmmlab(when)) if WITH_OPENMMLAB else observed


before = observe('before')
import posattn  # noqa: E402
if WITH_OPENMMLAB:
    import posattn_openmmlab  # noqa: E402
    import posattn_openmmlab.detection  # noqa: E402  (the module that needs mmdet)
print(json.dumps({'before': before, 'after': observe('after')}))
'''

STACKS = [pytest.param('core', id='posattn'),
          pytest.param('openmmlab', id='posattn_openmmlab', marks=needs_openmmlab)]


@pytest.mark.parametrize('stack', STACKS)
@pytest.mark.parametrize('weights_only', ['default', 'forced off'])
def test_importing_posattn_changes_nothing_outside_posattn(weights_only, stack):
    """``forced off``: TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1, under which the ordinary checkpoint loads
    before the imports, and must after."""
    env = {key: value for key, value in os.environ.items() if key != 'TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD'}
    if weights_only == 'forced off':
        env['TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD'] = '1'
    result = subprocess.run([sys.executable, '-c', OBSERVE, stack], cwd=REPO, capture_output=True, text=True,
                            timeout=600, env=dict(env, OMP_NUM_THREADS='1'))
    assert result.returncode == 0, result.stderr[-3000:]
    observed = json.loads(result.stdout.strip().splitlines()[-1])
    before, after = observed['before'], observed['after']
    expected = ['meta', 'state_dict'] if weights_only == 'forced off' else 'UnpicklingError'
    loaders = ['torch.load'] + (['CheckpointLoader'] if stack == 'openmmlab' else [])
    assert [before[f'an ordinary checkpoint through {loader}'] for loader in loaders] == [expected] * len(loaders)
    if stack == 'openmmlab':
        assert before['mmengine.dump through a symlink'] == [True, True]
    changed = [what for what in before if before[what] != after[what]]
    assert not changed, '\n'.join(f'{what}:\n  before {before[what]}\n  after  {after[what]}' for what in changed)
