"""tools/dist_train.sh, dist_test.sh, slurm_train.sh and slurm_test.sh: the Python each runs (the
checkout's .venv, else $PYTHON, else python on PATH), the clear error where that Python lacks torch,
the commands they build (DRY_RUN=1 for torchrun; a recording srun on PATH for Slurm), and a real
two-process training and evaluation on the CPU."""
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, load_test_tool, needs_openmmlab

SCRIPTS = ('_launch.sh', 'dist_train.sh', 'dist_test.sh', 'slurm_train.sh', 'slurm_test.sh')
# The environment variables the scripts read, cleared so that the caller's own do not leak in.
LAUNCH_VARIABLES = ('VENV', 'PYTHON', 'DRY_RUN', 'NNODES', 'NODE_RANK', 'MASTER_ADDR', 'MASTER_PORT', 'PORT', 'GPUS',
                    'GPUS_PER_NODE', 'CPUS_PER_TASK', 'SRUN_ARGS', 'PYTHONPATH')
NEEDS = 'torch, posattn, mmengine'


def interpreter(path: Path, *flags: str) -> Path:
    """An executable at ``path`` that runs this test's Python with ``flags``: with ``-S`` it finds no
    site-packages, so neither torch nor posattn."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {" ".join(flags)} "$@"\n')
    path.chmod(0o755)
    return path


@pytest.fixture
def checkout(tmp_path):
    """A checkout holding the launch scripts alone (tools/), without a .venv."""
    (tmp_path / 'tools').mkdir()
    for name in SCRIPTS:
        shutil.copy2(REPO / 'tools' / name, tmp_path / 'tools' / name)
    return tmp_path


def launch(checkout, script, *args, **env):
    """Runs tools/``script`` of ``checkout`` with ``env`` added to a clean environment."""
    base = {key: value for key, value in os.environ.items() if key not in LAUNCH_VARIABLES}
    return subprocess.run([str(checkout / 'tools' / script), *args], capture_output=True, text=True, timeout=120,
                          env=dict(base, **env))


def dry_run(checkout, script, *args, **env):
    """The command ``script`` would run (DRY_RUN=1), as a list, and its stderr."""
    result = launch(checkout, script, *args, DRY_RUN='1', **env)
    assert result.returncode == 0, result.stderr
    return shlex.split(result.stdout), result.stderr


def torchrun(python, tool, nproc, nnodes='1', node_rank='0', master_addr='127.0.0.1', port='29500'):
    return [str(python), '-m', 'torch.distributed.run', f'--nnodes={nnodes}', f'--node_rank={node_rank}',
            f'--master_addr={master_addr}', f'--master_port={port}', f'--nproc_per_node={nproc}', str(tool)]


@needs_openmmlab
def test_dist_train_runs_the_checkouts_venv_first(checkout, tmp_path_factory):
    other = tmp_path_factory.mktemp('elsewhere')
    venv = interpreter(checkout / '.venv' / 'bin' / 'python')
    command, stderr = dry_run(checkout, 'dist_train.sh', 'configs/pervit_t_shapes.py', '2', '--amp',
                              PYTHON=str(interpreter(other / 'python3')),
                              PATH=f'{interpreter(other / "bin" / "python").parent}:{os.environ["PATH"]}')
    assert command == torchrun(venv, checkout / 'tools' / 'train.py', 2) + [
        'configs/pervit_t_shapes.py', '--amp', '--launcher', 'pytorch']
    assert stderr.startswith(f"dist_train.sh: running {venv} (the checkout's .venv; Python 3.")
    assert stderr.count('\n') == 1


@needs_openmmlab
def test_VENV_names_another_environment_of_the_checkout(checkout, tmp_path):
    interpreter(checkout / '.venv' / 'bin' / 'python')
    other = interpreter(checkout / '.venv312' / 'bin' / 'python')
    command, stderr = dry_run(checkout, 'dist_train.sh', 'c.py', '1', VENV='.venv312')
    assert command[0] == str(other) and stderr.startswith(f'dist_train.sh: running {other} (VENV=.venv312; Python 3.')
    elsewhere = interpreter(tmp_path / 'env' / 'bin' / 'python')
    command, _ = dry_run(checkout, 'slurm_train.sh', 'p', 'j', 'c.py', 'w', VENV=str(tmp_path / 'env'))
    assert command[command.index('--kill-on-bad-exit=1') + 1] == str(elsewhere)
    # without that environment: PYTHON, and the fix names the VENV
    result = launch(checkout, 'dist_train.sh', 'c.py', '1', VENV='.venv311', PYTHON=str(tmp_path / 'no-python'))
    assert result.returncode == 1 and 'Run `make setup VENV=.venv311` in ' in result.stderr


@needs_openmmlab
def test_without_a_venv_python_comes_from_PYTHON_else_from_PATH(checkout, tmp_path_factory):
    other = tmp_path_factory.mktemp('elsewhere')
    chosen = interpreter(other / 'chosen' / 'python3.11')
    on_path = interpreter(other / 'bin' / 'python')
    path = f'{on_path.parent}:{os.environ["PATH"]}'
    command, stderr = dry_run(checkout, 'dist_test.sh', 'c.py', 'ck.pth', '1', PYTHON=str(chosen), PATH=path)
    assert command[0] == str(chosen) and f'running {chosen} (the PYTHON variable; Python 3.' in stderr
    command, stderr = dry_run(checkout, 'dist_test.sh', 'c.py', 'ck.pth', '1', PATH=path)
    assert command[0] == 'python' and f'running {on_path} (python on PATH; Python 3.' in stderr
    # a name on PATH in PYTHON
    command, stderr = dry_run(checkout, 'dist_test.sh', 'c.py', 'ck.pth', '1', PYTHON='python3.11',
                              PATH=f'{chosen.parent}:{os.environ["PATH"]}')
    assert command[0] == 'python3.11' and f'running {chosen} (the PYTHON variable;' in stderr


def test_a_python_without_torch_is_an_error_that_names_the_fix(checkout, tmp_path):
    bare = interpreter(tmp_path / 'bare' / 'python', '-S')
    for script, args in (('dist_train.sh', ['c.py', '2']), ('slurm_test.sh', ['p', 'j', 'c.py', 'ck.pth'])):
        result = launch(checkout, script, *args, PYTHON=str(bare), DRY_RUN='1')
        assert result.returncode == 1 and result.stdout == ''
        assert result.stderr == (
            f'{script}: {bare} (the PYTHON variable) cannot import {NEEDS}; the tools need {NEEDS}. '
            f'Run `make setup` in {checkout} (it creates .venv, which this script then runs), or set PYTHON to '
            f"an interpreter that has them (pip install -e '{checkout}[mm]' installs posattn with the OpenMMLab "
            'tools).\n')
    interpreter(checkout / '.venv' / 'bin' / 'python', '-S')  # a .venv that `make setup` has not finished
    result = launch(checkout, 'dist_train.sh', 'c.py', '2', DRY_RUN='1')
    assert result.returncode == 1
    assert f"(the checkout's .venv) cannot import {NEEDS}; the tools need {NEEDS}. Run `make setup` in " \
           f'{checkout}: it installs them into .venv, which this script runs first.' in result.stderr


def test_a_missing_python_and_missing_arguments_are_errors(checkout, tmp_path):
    result = launch(checkout, 'dist_train.sh', 'c.py', '2', PYTHON=str(tmp_path / 'no-python'))
    assert result.returncode == 1
    assert result.stderr.startswith(f"dist_train.sh: no Python at '{tmp_path / 'no-python'}' (the PYTHON variable). "
                                    'Run `make setup` in ')
    for script, usage in (('dist_train.sh', 'CONFIG NUM_PROCS_PER_NODE'),
                          ('dist_test.sh', 'CONFIG CHECKPOINT NUM_PROCS_PER_NODE'),
                          ('slurm_train.sh', 'PARTITION JOB_NAME CONFIG WORK_DIR'),
                          ('slurm_test.sh', 'PARTITION JOB_NAME CONFIG CHECKPOINT')):
        result = launch(checkout, script, 'c.py')
        assert result.returncode == 2 and f'usage: {checkout / "tools" / script} {usage} ' in result.stderr


@needs_openmmlab
def test_multi_node_torchrun_takes_NNODES_NODE_RANK_MASTER_ADDR_and_PORT(checkout):
    venv = interpreter(checkout / '.venv' / 'bin' / 'python')
    nodes = dict(NNODES='2', NODE_RANK='1', MASTER_ADDR='10.0.0.1', PORT='29617')
    command, _ = dry_run(checkout, 'dist_train.sh', 'configs/pervit_t_imagenet.py', '8', **nodes)
    assert command == torchrun(venv, checkout / 'tools' / 'train.py', 8, '2', '1', '10.0.0.1', '29617') + [
        'configs/pervit_t_imagenet.py', '--launcher', 'pytorch']
    command, _ = dry_run(checkout, 'dist_test.sh', 'c.py', 'a checkpoint.pth', '8', '--out', 'm.json', **nodes)
    assert command == torchrun(venv, checkout / 'tools' / 'test.py', 8, '2', '1', '10.0.0.1', '29617') + [
        'c.py', 'a checkpoint.pth', '--out', 'm.json', '--launcher', 'pytorch']


def recording_srun(folder: Path) -> Path:
    """An ``srun`` that writes its arguments (one a line) and MASTER_PORT to ``folder/srun.txt``."""
    srun = folder / 'srun'
    srun.write_text(f'#!/bin/sh\nprintf "%s\\n" "MASTER_PORT=$MASTER_PORT" "$@" > {shlex.quote(str(folder))}/srun.txt\n')
    srun.chmod(0o755)
    return srun


@needs_openmmlab
def test_slurm_scripts_run_srun_with_the_openmmlab_options(checkout, tmp_path_factory):
    venv = interpreter(checkout / '.venv' / 'bin' / 'python')
    fake = tmp_path_factory.mktemp('bin')
    path = f'{recording_srun(fake).parent}:{os.environ["PATH"]}'

    def srun(script, *args, **env):
        result = launch(checkout, script, *args, PATH=path, **env)
        assert result.returncode == 0, result.stderr
        assert result.stderr.startswith(f"{script}: running {venv} (the checkout's .venv;")
        return (fake / 'srun.txt').read_text().splitlines()

    tools = checkout / 'tools'
    assert srun('slurm_train.sh', 'gpu', 'pervit', 'configs/pervit_t_imagenet.py', 'work_dirs/p', '--amp') == [
        'MASTER_PORT=29500', '-p', 'gpu', '--job-name=pervit', '--gres=gpu:8', '--ntasks=8', '--ntasks-per-node=8',
        '--cpus-per-task=5', '--kill-on-bad-exit=1', str(venv), '-u', str(tools / 'train.py'),
        'configs/pervit_t_imagenet.py', '--work-dir', 'work_dirs/p', '--amp', '--launcher', 'slurm']
    # two nodes of 8 GPUs, more srun options, another port
    assert srun('slurm_train.sh', 'gpu', 'pervit', 'c.py', 'w', GPUS='16', CPUS_PER_TASK='10', PORT='29618',
                SRUN_ARGS='--time=2:00:00 --qos high') == [
        'MASTER_PORT=29618', '-p', 'gpu', '--job-name=pervit', '--gres=gpu:8', '--ntasks=16', '--ntasks-per-node=8',
        '--cpus-per-task=10', '--kill-on-bad-exit=1', '--time=2:00:00', '--qos', 'high', str(venv), '-u',
        str(tools / 'train.py'), 'c.py', '--work-dir', 'w', '--launcher', 'slurm']
    # fewer GPUs than a node: as many tasks a node; GPUS_PER_NODE set by hand
    assert srun('slurm_test.sh', 'dev', 'eval', 'c.py', 'ck.pth', '--out', 'm.json', GPUS='2')[3:7] == [
        '--job-name=eval', '--gres=gpu:2', '--ntasks=2', '--ntasks-per-node=2']
    recorded = srun('slurm_test.sh', 'dev', 'eval', 'c.py', 'ck.pth', GPUS='8', GPUS_PER_NODE='4')
    assert recorded[4:7] == ['--gres=gpu:4', '--ntasks=8', '--ntasks-per-node=4']
    assert recorded[-6:] == ['-u', str(tools / 'test.py'), 'c.py', 'ck.pth', '--launcher', 'slurm']


@needs_openmmlab
def test_the_tools_take_the_launchers_the_scripts_pass():
    import train  # tools/train.py, on the path from conftest
    test_tool = load_test_tool()
    for launcher in ('pytorch', 'slurm'):
        assert train.parse_args(['c.py', '--work-dir', 'w', '--amp', '--launcher', launcher]).launcher == launcher
        assert test_tool.parse_args(['c.py', 'ck.pth', '--out', 'm.json', '--launcher', launcher]).launcher == launcher


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(('127.0.0.1', 0))
        return probe.getsockname()[1]


@pytest.mark.slow
@needs_openmmlab
def test_two_processes_train_and_evaluate_on_the_cpu(tmp_path):
    """dist_train.sh with 2 CPU processes, 1 epoch of 32 images in batches of 8 a process (2 iterations);
    then dist_test.sh on its checkpoint gives the validation the training logged (the same 16 images)."""
    env = {key: value for key, value in os.environ.items() if key not in LAUNCH_VARIABLES}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS='1')  # where the checkout has no .venv

    def run(script, *args):
        # run from tmp_path: mmengine collects the ranks' results through a .dist_test folder in the current one
        result = subprocess.run([str(REPO / 'tools' / script), *args], cwd=tmp_path, capture_output=True, text=True,
                                timeout=300, env=dict(env, PORT=str(free_port())))
        assert result.returncode == 0, f'{script} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}'
        assert result.stderr.startswith(f'{script}: running ')
        return result.stdout + result.stderr

    work_dir = tmp_path / 'work'
    config = str(REPO / 'configs' / 'pervit_t_shapes.py')
    output = run('dist_train.sh', config, '2', '--work-dir', str(work_dir), '--cfg-options',
                 'train_cfg.max_epochs=1', 'train_dataloader.dataset.num_images=32', 'train_dataloader.batch_size=8',
                 'val_dataloader.dataset.num_images=16', 'default_hooks.logger.interval=1')
    assert 'Finished 1 epochs (2 iterations). Last validation: accuracy/top1:' in output  # 32 / (2 x 8)
    checkpoint = work_dir / 'epoch_1.pth'
    assert checkpoint.is_file()
    logged = [json.loads(line) for path in work_dir.glob('*/vis_data/scalars.json')
              for line in path.read_text().splitlines()]
    validation = [row['accuracy/top1'] for row in logged if 'accuracy/top1' in row]
    assert len(validation) == 1

    metrics = tmp_path / 'metrics.json'
    run('dist_test.sh', config, str(checkpoint), '2', '--work-dir', str(tmp_path / 'test'),
        '--out', str(metrics), '--cfg-options', 'test_dataloader.dataset.num_images=16')
    assert json.loads(metrics.read_text())['accuracy/top1'] == pytest.approx(validation[0])
