"""tools/compare_phis.py: its experiments' plans and options, and, with a reduced budget, runs that
train through tools/train.py and the table, JSON and plot that come from their logs."""
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require_openmmlab

require_openmmlab()  # every test imports or runs tools/compare_phis.py

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope='module')
def tool():
    sys.path.insert(0, str(ROOT / 'tools'))
    try:
        yield importlib.import_module('compare_phis')
    finally:
        sys.path.remove(str(ROOT / 'tools'))


def test_swap_experiment_trains_the_starting_model_first(tool):
    args = tool.parse_args(['--experiment', 'swap', '--rows', 'finetune_peripheral', 'finetune_peg'])
    assert tool.planned_rows(args) == ['deit_t', 'finetune_peg', 'finetune_peripheral']
    assert args.work_dir == 'work_dirs/compare_phis/swap'
    assert tool.parse_args([]).work_dir == 'work_dirs/compare_phis'
    with pytest.raises(SystemExit):
        tool.parse_args(['--rows', 'finetune_peg'])  # a row of the other experiment


def test_a_fine_tune_starts_from_the_last_checkpoint_of_its_run(tool, tmp_path):
    with pytest.raises(FileNotFoundError, match='no last_checkpoint file'):
        tool.last_checkpoint(tmp_path)
    (tmp_path / 'last_checkpoint').write_text(f'{tmp_path / "epoch_10.pth"}\n')
    start = tool.last_checkpoint(tmp_path)
    assert start == tmp_path / 'epoch_10.pth'
    options = tool.overrides(tool.parse_args(['--experiment', 'swap', '--epochs', '3']), seed=1, starting_checkpoint=start)
    assert options == ['randomness.seed=1', 'train_cfg.max_epochs=3', 'param_scheduler.1.end=3',
                       f'model.backbone.backbone.init_cfg.checkpoint={start}', f'model.head.init_cfg.checkpoint={start}']


def test_every_row_config_has_what_the_tool_sets(tool):
    from mmengine.config import Config
    for experiment, rows in tool.EXPERIMENTS.items():
        for name, row in rows.items():
            cfg = Config.fromfile(tool.config_path(row.config))
            assert cfg.param_scheduler[1].end == cfg.train_cfg.max_epochs, name  # what --epochs overrides
            if row.start_from:
                assert cfg.model.backbone.type == 'PosattnSwappedBackbone', name
                assert cfg.model.backbone.backbone.init_cfg.prefix == 'backbone.'
                assert cfg.model.head.init_cfg == dict(type='Pretrained', checkpoint=cfg.pretrained, prefix='head.')


def test_the_resolution_experiment_tests_each_row_at_half_to_twice_its_training_size(tool):
    rows = tool.EXPERIMENTS['resolution']
    assert set(rows) >= {'none', 'ape', 'peg', 'irpe', 'peripheral', 'pervit_t', 'rope', 'rpb', 'alibi', 'gpsa'}
    for row in rows.values():
        assert tool.test_sizes(row, ['randomness.seed=0']) == [32, 48, 64, 96, 128], row.config
    assert tool.test_sizes(rows['ape'], ['test_dataloader.dataset.img_size=32']) == [16, 24, 32, 48, 64]
    with pytest.raises(ValueError, match='not a whole number of pixels'):
        tool.test_sizes(rows['ape'], ['test_dataloader.dataset.img_size=50'])  # 0.75 x 50 = 37.5


def test_every_table_gives_the_mean_the_standard_deviation_and_the_number_of_seeds(tool):
    assert tool.mean_std([98.0, 99.0, 100.0]) == '99.0 ± 1.0 (3 seeds)'  # sample deviation, n - 1
    assert tool.mean_std([97.25]) == '97.2 (1 seed)'
    runs = [dict(row='a', seed=seed, top1_per_epoch=[50.0, final], step_time_s=0.1, params=1e6, wall_s=60.0,
                 top1_at_size={'32': final - 10, '64': final})
            for seed, final in enumerate((90.0, 92.0, 94.0))]
    rows = {'a': tool.Row('study/deit-t-half_ape_shapes.py', 'APE')}
    table = tool.summarise(runs, rows)
    assert table[0]['top1_std'] == pytest.approx(2.0) and table[0]['top1_spread'] == pytest.approx(4.0)
    assert '| APE | `study/deit-t-half_ape_shapes.py` | 1.00 | 2 | 92.0 ± 2.0 (3 seeds) | 4.0 |' in tool.markdown(table, runs)
    assert '| APE | 82.0 ± 2.0 (3 seeds) | 92.0 ± 2.0 (3 seeds) |' in tool.resolution_markdown(table, runs)


def test_a_run_is_reused_only_with_the_same_config_and_options(tool, tmp_path, monkeypatch):
    monkeypatch.setattr(tool, 'config_path', lambda config: tmp_path / config)
    row = tool.Row('row.py', 'a row')
    (tmp_path / 'row.py').write_text('model = dict(width=96)\n')
    options = ['randomness.seed=0']
    digest = tool.config_digest(row, options)
    assert tool.config_digest(row, ['randomness.seed=1']) != digest
    run_dir = tmp_path / 'run'
    run_dir.mkdir()
    assert tool.finished_run(run_dir, options, digest) is None  # nothing recorded yet
    (run_dir / tool.RUN_RECORD).write_text(json.dumps(dict(options=options, config_digest=digest)))
    assert tool.finished_run(run_dir, options, digest) == dict(options=options, config_digest=digest)
    assert tool.finished_run(run_dir, ['randomness.seed=1'], digest) is None
    (tmp_path / 'row.py').write_text('model = dict(width=64)\n')  # the config was edited since
    assert tool.finished_run(run_dir, options, tool.config_digest(row, options)) is None


def test_an_unfinished_or_other_run_is_set_aside_not_mixed_into_the_new_one(tool, tmp_path):
    run_dir = tmp_path / 'seed0'
    assert tool.set_aside(run_dir) is None  # nothing there yet
    run_dir.mkdir()
    assert tool.set_aside(run_dir) is None  # an empty folder stays
    (run_dir / '20260101_000000' / 'vis_data').mkdir(parents=True)
    (run_dir / '20260101_000000' / 'vis_data' / 'scalars.json').write_text('{"accuracy/top1": 50.0}\n')
    from posattn_openmmlab.work_dir_lock import WorkDirInUseError, WorkDirLock
    with WorkDirLock(str(run_dir)), pytest.raises(WorkDirInUseError, match='in use by another training'):
        tool.set_aside(run_dir)  # a training still running there keeps its folder
    assert run_dir.is_dir()
    aside = tool.set_aside(run_dir)
    assert not run_dir.exists() and aside.name.startswith('seed0.before-')
    assert (aside / '20260101_000000' / 'vis_data' / 'scalars.json').is_file()  # kept, not deleted


def test_a_run_is_read_from_every_log_folder_in_order(tool, tmp_path):
    """A resumed run has a log folder per start: top-1 per epoch and step times over both, in order."""
    with pytest.raises(FileNotFoundError, match='no mmengine scalars under'):
        tool.read_run(tmp_path)
    logs = {'20260101_100000': [dict(lr=1e-3, loss=1.0, time=9.0, iter=1, step=1), {'accuracy/top1': 50.0, 'step': 1}],
            '20260101_120000': [dict(lr=1e-3, loss=0.5, time=0.3, iter=2, step=2),
                                dict(lr=1e-3, loss=0.4, time=0.5, iter=3, step=3), {'accuracy/top1': 90.0, 'step': 2}]}
    for folder, rows in logs.items():
        (tmp_path / folder / 'vis_data').mkdir(parents=True)
        (tmp_path / folder / 'vis_data' / 'scalars.json').write_text(''.join(json.dumps(row) + '\n' for row in rows))
    run = tool.read_run(tmp_path)
    assert run == dict(top1_per_epoch=[50.0, 90.0], step_time_s=pytest.approx(0.4))  # the first window skipped


def build(tool, row, options=()):
    from mmpretrain.registry import MODELS
    cfg = tool.Config.fromfile(tool.config_path(row.config))
    cfg.merge_from_dict(dict(option.split('=', 1) for option in options))
    tool.init_default_scope(cfg.default_scope)
    model = MODELS.build(cfg.model)
    model.init_weights()
    return model


def test_each_fine_tune_builds_from_the_starting_checkpoint_and_refuses_to_start_without_one(tool, tmp_path,
                                                                                           monkeypatch):
    import torch
    monkeypatch.chdir(tmp_path)  # the configs' own checkpoint path is relative: here nothing was trained
    rows = tool.EXPERIMENTS['swap']
    torch.manual_seed(1)
    trained = build(tool, rows['deit_t'])
    with torch.no_grad():  # no tensor left at an initialisation that a fresh build would repeat (zeros, ones)
        for param in trained.parameters():
            param.normal_()
    start = tmp_path / 'epoch_10.pth'
    torch.save({'state_dict': trained.state_dict()}, start)
    options = tool.overrides(tool.parse_args(['--experiment', 'swap']), seed=0, starting_checkpoint=start)
    for name, row in rows.items():
        if not row.start_from:
            continue
        with pytest.raises(FileNotFoundError, match='model.backbone.backbone.init_cfg.checkpoint=PATH'):
            build(tool, row)
        model = build(tool, row, options).state_dict()
        for key, value in trained.state_dict().items():  # the classifier's backbone.* sits under backbone.backbone.*
            assert torch.equal(model[key.replace('backbone.', 'backbone.backbone.', 1)], value), (name, key)
        assert any('.attn.phi.' in key for key in model) == (name != 'finetune_none'), name


def small_run(work_dir, *args, train_images=64):
    """The command of a tools/compare_phis.py run with a reduced budget (2 epochs, a few images), and its
    result, checked to have succeeded."""
    command = [sys.executable, 'tools/compare_phis.py', *args, '--epochs', '2', '--work-dir', str(work_dir),
               '--cfg-options', f'train_dataloader.dataset.num_images={train_images}', 'train_dataloader.batch_size=32',
               'val_dataloader.dataset.num_images=32', 'test_dataloader.dataset.num_images=32',
               'default_hooks.logger.interval=1']
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return command, result


@pytest.mark.slow
def test_compare_phis_trains_each_row_and_seed_and_tabulates(tmp_path):
    command, result = small_run(tmp_path, '--rows', 'deit_t_peg', 'pervit_t', '--seeds', '0', '1', train_images=96)

    record = json.loads((tmp_path / 'comparison.json').read_text())
    assert [(run['row'], run['seed']) for run in record['runs']] == [
        ('deit_t_peg', 0), ('deit_t_peg', 1), ('pervit_t', 0), ('pervit_t', 1)]
    for run in record['runs']:
        assert len(run['top1_per_epoch']) == 2 and all(0 <= top1 <= 100 for top1 in run['top1_per_epoch'])
        assert run['step_time_s'] > 0
        assert (tmp_path / run['row'] / f'seed{run["seed"]}' / 'epoch_2.pth').is_file()
    params = {line['row']: line['params_m'] for line in record['table']}
    assert params['pervit_t'] == pytest.approx(7.3, abs=0.1)   # PerViT-T with a 6-class head
    assert params['deit_t_peg'] == pytest.approx(5.5, abs=0.1)  # ViT-Tiny, no abs. embedding, 5 PEGs
    pervit = [run['top1_per_epoch'][-1] for run in record['runs'] if run['row'] == 'pervit_t']
    assert record['table'][1]['top1'] == pytest.approx(sum(pervit) / 2)

    table = (tmp_path / 'comparison.md').read_text()
    assert '| PerViT-T | `pervit_t_shapes.py` |' in table and '2 seeds' in table
    assert (tmp_path / 'comparison.png').read_bytes()[:4] == b'\x89PNG'
    assert '| PerViT-T | `pervit_t_shapes.py` | 7.31 | 2 |' in result.stdout

    # the same settings again: the finished run is reused, not trained again
    again = subprocess.run(command[:3] + ['pervit_t'] + command[5:], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count('reusing') == 2 and 'Epoch(val)' not in again.stdout
    assert json.loads((tmp_path / 'comparison.json').read_text())['runs'] == record['runs'][2:]


@pytest.mark.slow
def test_swap_experiment_fine_tunes_from_its_own_starting_run(tmp_path):
    small_run(tmp_path, '--experiment', 'swap', '--rows', 'finetune_peripheral')
    record = json.loads((tmp_path / 'comparison.json').read_text())
    assert [run['row'] for run in record['runs']] == ['deit_t', 'finetune_peripheral']
    start = tmp_path / 'deit_t' / 'seed0' / 'epoch_2.pth'
    assert f'model.head.init_cfg.checkpoint={start}' in record['runs'][1]['options']
    (mmengine_log,) = (tmp_path / 'finetune_peripheral' / 'seed0').glob('*/*.log')
    assert f'PretrainedInit: load from {start}' in mmengine_log.read_text()


@pytest.mark.slow
def test_ablations_experiment_measures_the_attention_of_each_run(tool, tmp_path):
    assert tool.parse_args(['--experiment', 'ablations']).work_dir == 'work_dirs/compare_phis/ablations'
    small_run(tmp_path, '--experiment', 'ablations', '--rows', 'b', 'c')
    record = json.loads((tmp_path / 'comparison.json').read_text())
    without_phi, without_content = record['runs']
    for run in record['runs']:
        measured = json.loads((tmp_path / run['row'] / 'seed0' / 'analysis' / 'metrics.json').read_text())
        assert measured['num_images'] == 32 and all(layer['grid'] == [4, 4] for layer in measured['layers'])
        assert run['nonlocality']['mixed'] == pytest.approx(
            [sum(layer['nonlocality_mixed']) / 4 for layer in measured['layers']])
        assert len(run['nonlocality']['mixed']) == 12
    assert without_phi['nonlocality']['position'] == [None] * 12  # no Φp in (b)
    assert all(value > 0 for value in without_content['nonlocality']['position'])
    assert (tmp_path / 'c' / 'seed0' / 'analysis' / 'position.png').is_file()
    table = (tmp_path / 'comparison.md').read_text()
    assert '| model | Ω of Φa, layer 1 to last | Ω of Φp, layer 1 to last |' in table
    (line,) = [line for line in table.splitlines() if line.startswith('| (b) without Φp |') and '`' not in line]
    mixed, position = line.split('|')[2:4]
    assert len([float(value) for value in mixed.split()]) == 12 and position.split() == ['-'] * 12
    assert (tmp_path / 'comparison.png').read_bytes()[:4] == b'\x89PNG'


@pytest.mark.slow
def test_resolution_experiment_tests_each_run_at_every_size_once(tmp_path):
    command, result = small_run(tmp_path, '--experiment', 'resolution', '--rows', 'ape', 'rope')
    record = json.loads((tmp_path / 'comparison.json').read_text())
    for run in record['runs']:
        assert list(run['top1_at_size']) == ['32', '48', '64', '96', '128']
        assert all(0 <= top1 <= 100 for top1 in run['top1_at_size'].values())
        # at the training size the test split is the validation split: the same images, the same top-1
        assert run['top1_at_size']['64'] == pytest.approx(run['top1_per_epoch'][-1])
        measured = tmp_path / run['row'] / 'seed0' / 'resolution' / 'top1_at_128.json'
        assert json.loads(measured.read_text())['img_size'] == [128, 128]
    assert '| APE (learned absolute embedding) | ' in (tmp_path / 'comparison.md').read_text().split('without fine-tuning')[1]
    assert (tmp_path / 'resolution.png').read_bytes()[:4] == b'\x89PNG'

    # again: neither trained nor tested again
    log = (tmp_path / 'resolution.log').read_text()
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count('reusing') == 2 and (tmp_path / 'resolution.log').read_text() == log
    assert json.loads((tmp_path / 'comparison.json').read_text())['runs'] == record['runs']
