"""tools/compare_phis.py, the command over posattn_openmmlab.study: the built-in studies and a user's,
the data a study is given, the figures' labels and the step timing read from the configs, --report,
and, with a reduced budget, studies that train through tools/train.py, tested and analysed, with the
table, JSON and plots that come from their logs. The library's parts alone: tests/test_study.py."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require_openmmlab

require_openmmlab()  # every test imports or runs tools/compare_phis.py

# tools/ is on the import path (conftest.py), as it is for the tool when it runs as a script
import compare_phis as tool  # noqa: E402
from posattn_openmmlab.study import (STUDIES, RunRecord, RunStore, checked_run_configs, load_data,  # noqa: E402
                                     load_study, planned_rows, run_options, time_training_steps)
from posattn_openmmlab.study.figures import comparison_figure, dataset_name, figure_labels, row_colours  # noqa: E402
from posattn_openmmlab.study.figures import save_figure, size_figure  # noqa: E402
from posattn_openmmlab.study.records import read_logged_run  # noqa: E402
from posattn_openmmlab.study.report import SIZE_TESTS, mean_std, summarise  # noqa: E402
from posattn_openmmlab.study.spec import DATA_KEYS, Row, config_digest, row_config, with_options  # noqa: E402
from posattn_openmmlab.study.timing import step_timing_note, training_step  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BUILT_IN = sorted(path.stem for path in STUDIES.glob('*.py'))


def write_image_folder(root: Path, size: int = 64, per_class: dict = None) -> Path:
    """A folder of tiny PNGs in mmpretrain's CustomDataset layout (``<split>/<class>/<image>.png``): two
    classes, a bright square in the left or in the right half of a noisy image."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(0)
    for split, count in (per_class or dict(train=12, val=6)).items():
        for side in ('left', 'right'):
            (root / split / side).mkdir(parents=True)
            for index in range(count):
                image = rng.integers(0, 60, (size, size, 3), dtype=np.uint8)
                top, left = rng.integers(0, size // 2, 2)
                left += 0 if side == 'left' else size // 2
                image[top:top + size // 4, left:left + size // 4] = 230
                Image.fromarray(image).save(root / split / side / f'{index}.png')
    return root


def write_data_config(path: Path, image_root: Path, batch_size: int = 8, extra: str = '') -> Path:
    """A data config of the kind --data takes: CustomDataset on ``image_root``, 2 classes."""
    path.write_text(f'''
num_classes = 2
data_preprocessor = dict(num_classes=num_classes, mean=[100.0] * 3, std=[50.0] * 3, to_rgb=False)
pipeline = [dict(type='LoadImageFromFile'), dict(type='PackInputs')]
train_dataloader = dict(batch_size={batch_size}, num_workers=0, sampler=dict(type='DefaultSampler', shuffle=True),
                        dataset=dict(type='CustomDataset', data_root='{image_root}', data_prefix='train',
                                     pipeline=pipeline))
val_dataloader = dict(batch_size={batch_size}, num_workers=0, sampler=dict(type='DefaultSampler', shuffle=False),
                      dataset=dict(type='CustomDataset', data_root='{image_root}', data_prefix='val',
                                   pipeline=pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(type='Accuracy', topk=(1,))
test_evaluator = val_evaluator
{extra}''')
    return path


def write_tiny_row(path: Path, base: str) -> Path:
    """A row config of two blocks on top of one of configs/study/'s half-width DeiT-T configs."""
    path.write_text(f"_base_ = '{ROOT / 'configs' / 'study' / base}'\n"
                    'model = dict(backbone=dict(arch=dict(num_layers=2)))\n')
    return path


@pytest.mark.parametrize('name', BUILT_IN)
def test_every_built_in_study_passes_its_checks(name):
    """Every row of every built-in study loads, takes its options and its tests at other sizes, and
    names registered Φp: what a run checks before it trains anything."""
    study = load_study(STUDIES / f'{name}.py')
    assert study.rows and all(row.path.is_file() for row in study.rows.values())
    data = load_data(study.data) if study.data else None
    planned = planned_rows(study)
    configs = checked_run_configs(study, planned, data, {row: run_options(study.rows[row], 0, {}, epochs=3)
                                                         for row in planned}, ROOT)
    for cfg in configs.values():  # --epochs: the run's length, and the schedules that ended with it
        assert cfg.train_cfg.max_epochs == 3 and max(s.get('end', 0) for s in cfg.param_scheduler) <= 3
    assert tool.parse_args([]).study == tool.parse_args(['--experiment', 'table2']).study  # the default


def test_swap_experiment_trains_the_starting_model_first():
    args = tool.parse_args(['--experiment', 'swap', '--rows', 'finetune_peripheral', 'finetune_peg'])
    assert planned_rows(args.study, args.rows) == ['deit_t', 'finetune_peg', 'finetune_peripheral']
    assert args.work_dir == Path('work_dirs/compare_phis/swap')
    assert tool.parse_args([]).work_dir == Path('work_dirs/compare_phis')
    with pytest.raises(SystemExit):
        tool.parse_args(['--rows', 'finetune_peg'])  # a row of the other experiment


def test_a_fine_tune_starts_from_the_last_checkpoint_of_its_run(tmp_path):
    store = RunStore(tmp_path)
    with pytest.raises(FileNotFoundError, match='no last_checkpoint file'):
        store.last_checkpoint('deit_t', 1)
    store.run_dir('deit_t', 1).mkdir(parents=True)
    (store.run_dir('deit_t', 1) / 'last_checkpoint').write_text('work_dirs/elsewhere/deit_t/seed1/epoch_10.pth\n')
    start = store.last_checkpoint('deit_t', 1)
    assert start == store.run_dir('deit_t', 1) / 'epoch_10.pth'  # in the run's folder, wherever it ran
    study = tool.parse_args(['--experiment', 'swap']).study
    options = run_options(study.rows['finetune_peg'], 1, {}, epochs=3, starting_checkpoint=start)
    assert options == {'randomness.seed': 1, 'train_cfg.max_epochs': 3,
                       'model.backbone.backbone.init_cfg.checkpoint': str(start),
                       'model.head.init_cfg.checkpoint': str(start)}
    row = study.rows['deit_t']._replace(checkpoint_keys=('load_from',))  # a row's own keys
    assert list(run_options(row, 1, {}, starting_checkpoint=start).items())[1:] == [('load_from', str(start))]


def test_a_rows_options_reach_its_runs_after_the_command_lines(tmp_path):
    """The same config twice, another Φp per row: each run trains its row's, whatever the command
    line sets for all rows; the seed and the budget stay the tool's."""
    (tmp_path / 'study.py').write_text(
        "rows = [dict(name='a', config='deit_t_none_shapes.py', options=dict(phi='rope')),\n"
        "        dict(name='b', config='deit_t_none_shapes.py')]\n")
    args = tool.parse_args(['--study', str(tmp_path / 'study.py'), '--epochs', '3', '--cfg-options', 'phi=peg',
                            'randomness.seed=7'])
    rows = args.study.rows
    assert rows['a'].options == (('phi', 'rope'),) and rows['b'].options == ()
    assert run_options(rows['a'], 1, args.cfg_options, args.epochs) == {
        'phi': 'rope', 'randomness.seed': 1, 'train_cfg.max_epochs': 3}
    assert run_options(rows['b'], 1, args.cfg_options, args.epochs)['phi'] == 'peg'


def test_a_row_listed_before_the_one_it_starts_from_trains_after_it(tmp_path):
    (tmp_path / 'study.py').write_text(
        "rows = [dict(name='ft', config='swap/deit-t_finetune-peg_shapes.py', start_from='base'),\n"
        "        dict(name='other', config='deit_t_none_shapes.py'),\n"
        "        dict(name='base', config='swap/deit-t_shapes.py')]\n")
    study = load_study(tmp_path / 'study.py')
    assert planned_rows(study) == ['base', 'ft', 'other']
    assert planned_rows(study, ['ft']) == ['base', 'ft']
    assert study.rows['ft'].label == 'ft'  # no label: the name


def test_a_study_file_names_configs_beside_it_or_under_configs(tmp_path):
    write_tiny_row(tmp_path / 'mine.py', 'deit-t-half_ape_shapes.py')
    write_data_config(tmp_path / 'data.py', tmp_path / 'images')
    (tmp_path / 'mine_study.py').write_text(
        "_half = 'study/deit-t-half_{}_shapes.py'\n"  # a helper variable
        "rows = [dict(name='mine', config='mine.py', label='my APE'),\n"
        "        dict(name='peg', config=_half.format('peg'), label='PEG')]\n"
        "data = 'data.py'\nanalyse = True\ntest_size_factors = [1, 2]\n")
    study = load_study(tmp_path / 'mine_study.py')
    assert study.rows['mine'].path == tmp_path / 'mine.py'
    assert study.rows['peg'].path == ROOT / 'configs' / 'study' / 'deit-t-half_peg_shapes.py'
    assert study.data == tmp_path / 'data.py' and study.analyse and study.test_size_factors == (1.0, 2.0)
    assert study.work_dir == 'work_dirs/compare_phis/mine_study'  # no work_dir: the file's name
    assert tool.parse_args(['--study', str(tmp_path / 'mine_study.py'), '--work-dir', 'x']).work_dir == Path('x')
    other_data = write_data_config(tmp_path / 'other_data.py', tmp_path / 'images')
    args = tool.parse_args(['--study', str(tmp_path / 'mine_study.py'), '--data', str(other_data)])
    assert args.study.data == other_data  # --data before the study's own

    args = tool.parse_args(['--configs', str(tmp_path / 'mine.py'), 'study/deit-t-half_peg_shapes.py'])
    assert [(row.name, row.label, row.path) for row in args.study.rows.values()] == [
        ('mine', 'mine', tmp_path / 'mine.py'),
        ('deit-t-half_peg_shapes', 'deit-t-half_peg_shapes', ROOT / 'configs/study/deit-t-half_peg_shapes.py')]
    assert args.work_dir == Path('work_dirs/compare_phis/configs')


@pytest.mark.parametrize('text, message', [
    ("rows = []\n", r'has no rows: a study sets rows = \[dict\(name=..., config=..., label=...\), ...\]'),
    ("rows = [dict(name='a', config='deit_t_none_shapes.py')]\nanalyze = True\n",
     'sets analyze, which a study does not know; a study sets rows, options, row_changes, data, analyse, '
     'test_size_factors, test_extent_factors, equal_within, work_dir'),
    ("rows = ['deit_t_none_shapes.py']\n", r"row 1: a row is dict\(name=..., config=..., label=...\), got"),
    ("rows = [dict(name='a', config='deit_t_none_shapes.py', lable='A')]\n",
     'row 1 sets lable, which a row does not know; a row sets name, config, label, options, start_from, '
     'checkpoint_keys'),
    ("rows = [dict(name='a', config='deit_t_none_shapes.py', options='phi=rope')]\n",
     r"row 1: the row's options are config overrides as a dict, e.g. dict\(phi='rope'\), got 'phi=rope'"),
    ("rows = [dict(name='a')]\n", 'row 1 has no config: every row needs a name and a config'),
    ("rows = [dict(name='a b', config='deit_t_none_shapes.py')]\n", "the name 'a b' is no folder name"),
    ("rows = [dict(name='a', config='nowhere.py')]\n", r'row 1 \(a\): no config file nowhere.py: looked for .*nowhere.py and '
                                                       '.*configs/nowhere.py'),
    ("rows = [dict(name='a', config='deit_t_none_shapes.py'), dict(name='a', config='deit_t_peg_shapes.py')]\n",
     "two rows are named 'a'; give each row its own name"),
    ("rows = [dict(name='a', config='swap/deit-t_finetune-peg_shapes.py', start_from='base')]\n",
     "row 'a' starts from 'base', which is no row of the study; its rows: a"),
    ("rows = [dict(name='a', config='swap/deit-t_finetune-peg_shapes.py', start_from='b'),\n"
     "        dict(name='b', config='swap/deit-t_finetune-irpe_shapes.py', start_from='a')]\n",
     r'rows start from each other in a cycle \(a -> b -> a, "->" reads "starts from"\); one of them must train '
     'from scratch'),
    ("rows = [dict(name='a', config='swap/deit-t_finetune-peg_shapes.py', start_from='a')]\n",
     r'in a cycle \(a -> a,'),
    ("rows = [dict(name='a', config='deit_t_none_shapes.py'),\n"
     "        dict(name='b', config='deit_t_peg_shapes.py', start_from='a')]\n",
     "row 'b' starts from 'a', but its config deit_t_peg_shapes.py has no model.backbone.backbone.init_cfg.checkpoint, "
     r"model.head.init_cfg.checkpoint to take the checkpoint; set the row's checkpoint_keys"),
    ("rows = [dict(name='a', config='deit_t_none_shapes.py'),\n"
     "        dict(name='b', config='deit_t_peg_shapes.py', start_from='a', checkpoint_keys='load_from')]\n",
     r"checkpoint_keys is a list of config keys, e.g. \['load_from'\], got 'load_from'"),
    ("rows = [dict(name='a', config='deit_t_none_shapes.py')]\ndata = 'no_data.py'\n", 'no config file no_data.py'),
])
def test_a_study_file_that_does_not_hold_together_is_an_error_naming_the_problem(tmp_path, text, message):
    (tmp_path / 'study.py').write_text(text)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        load_study(tmp_path / 'study.py')


def test_a_bad_command_line_is_an_error_naming_the_problem(tmp_path, capsys):
    def error(argv):
        with pytest.raises(SystemExit):
            tool.parse_args(argv)
        return capsys.readouterr().err

    assert f'no study file {tmp_path / "none.py"}' in error(['--study', str(tmp_path / 'none.py')])
    assert 'no row pervit in the swap study; its rows: deit_t, finetune_none' in error(
        ['--experiment', 'swap', '--rows', 'pervit'])
    assert 'not allowed with argument --experiment' in error(['--experiment', 'swap', '--configs', 'a.py'])
    assert '--configs names two files called deit_t_none_shapes.py' in error(
        ['--configs', 'deit_t_none_shapes.py', str(ROOT / 'configs' / 'deit_t_none_shapes.py')])
    (tmp_path / 'data.py').write_text("train_dataloader = dict()\nnum_classes = 3\n")
    assert (f'the data config {tmp_path / "data.py"} does not define val_dataloader, test_dataloader, val_evaluator, '
            'test_evaluator; a data config defines') in error(['--data', str(tmp_path / 'data.py')])
    assert '--timing-repeats must be >= 1' in error(['--timing-repeats', '0'])


def test_data_replaces_each_rows_datasets_whole_and_sets_the_classes(tmp_path):
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmpretrain.registry import DATASETS
    images = write_image_folder(tmp_path / 'two_squares', per_class=dict(train=2, val=1))
    data = load_data(write_data_config(tmp_path / 'data.py', images, batch_size=4))
    for config in ('deit_t_none_shapes.py', 'swap/deit-t_finetune-peg_shapes.py', 'pervit_t_shapes.py'):
        row = Row(config, config, ROOT / 'configs' / config, config)
        own, cfg = Config.fromfile(row.path), row_config(row, data)
        for key in DATA_KEYS:  # the row's PositionalShapes (split, num_images, img_size) is gone
            assert cfg[key].to_dict() == data[key].to_dict(), (config, key)
        assert cfg.model.head.num_classes == 2 and cfg.data_preprocessor.num_classes == 2, config
        assert cfg.data_preprocessor.mean == [100.0] * 3  # the data's other keys are merged in
        assert cfg.optim_wrapper.to_dict() == own.optim_wrapper.to_dict() and cfg.model.backbone == own.model.backbone
        init_default_scope('mmpretrain')
        assert len(DATASETS.build(cfg.train_dataloader.dataset)) == 4  # the dataset builds as the data says
        cfg.dump(tmp_path / 'dumped.py')  # what tools/train.py then reads: the same config
        assert Config.fromfile(tmp_path / 'dumped.py').to_dict() == cfg.to_dict(), config
    (tmp_path / 'headless.py').write_text("model = dict(type='ImageClassifier', backbone=dict(type='PosattnViT'))\n")
    with pytest.raises(ValueError, match=r"headless.py: a data config sets the classes of a classifier's head "
                                         r'\(model.head.num_classes\)'):
        row_config(Row('headless', 'headless.py', tmp_path / 'headless.py', 'headless'), data)


def test_the_figures_take_the_data_name_the_chance_and_the_batch_from_the_configs(tmp_path):
    from mmengine.config import Config
    study = load_study(STUDIES / 'table2.py')
    shapes = {name: row_config(row, None) for name, row in study.rows.items()}
    axis = 'training step time (ms; batch 64, 64 x 64 px; CPU, 1 thread)'
    assert figure_labels(shapes, axis) == ('PositionalShapes', [pytest.approx(100 / 6)], axis)

    data = load_data(write_data_config(tmp_path / 'data.py', tmp_path / 'my_flowers'))
    mine = row_config(study.rows['pervit_t'], data)
    assert dataset_name(mine) == 'CustomDataset (my_flowers)'
    wrapped = Config(dict(train_dataloader=dict(dataset=dict(type='RepeatDataset', times=2, dataset=dict(
        type='CustomDataset', data_prefix=dict(img_path='/data/birds/train'))))))
    assert dataset_name(wrapped) == 'CustomDataset (train)'
    named = load_data(write_data_config(tmp_path / 'named.py', tmp_path / 'x', extra="dataset_name = 'Birds'"))
    assert dataset_name(row_config(study.rows['pervit_t'], named)) == 'Birds'

    runs = [RunRecord(row, 0, [], '', 10 ** 6 * (1 + index), 6.0, [50.0, 60.0 + index],
                      top1_at={'size': {'32': 55.0, '64': 60.0}})
            for index, row in enumerate(('deit_t_none', 'pervit_t'))]
    configs = {'deit_t_none': mine, 'pervit_t': mine}
    for timed in ({'deit_t_none': 0.2, 'pervit_t': 0.3}, None):
        labels = figure_labels(configs, 'training step time (ms; batch 8, 32 x 32 px; CPU, 1 thread)' if timed else None)
        table = summarise(runs, study.rows, timed)
        fig = comparison_figure(runs, table, labels)
        curves, scatter = fig.axes
        assert curves.get_title() == 'CustomDataset (my_flowers)'
        (chance,) = [line for line in curves.get_lines() if line.get_label().startswith('chance')]
        assert list(chance.get_ydata()) == [50.0, 50.0]  # 2 classes
        points = scatter.collections[0].get_offsets()[0], scatter.collections[1].get_offsets()[0]
        if timed:
            assert scatter.get_xlabel() == 'training step time (ms; batch 8, 32 x 32 px; CPU, 1 thread)'
            assert [tuple(point) for point in points] == [(pytest.approx(200.0), 60.0), (pytest.approx(300.0), 61.0)]
        else:  # no time axis where nothing was timed
            assert scatter.get_xlabel() == 'parameters (M)' and 'not measured' in scatter.get_title()
            assert [tuple(point) for point in points] == [(1.0, 60.0), (2.0, 61.0)]
        save_figure(fig, tmp_path / 'figure.png', 50)
        fig = size_figure(table, runs, SIZE_TESTS[0], (0.5, 1.0), labels, 'test image size')
        assert fig.axes[0].get_title().startswith('CustomDataset (my_flowers): mean over seeds')
        assert fig.axes[0].get_xlabel() == 'test image size, times the training size (no fine-tuning)'
        save_figure(fig, tmp_path / 'resolution.png', 50)


def test_a_training_step_is_timed_per_row_at_its_batch_and_input_size(tmp_path):
    import torch
    images = write_image_folder(tmp_path / 'images', size=32, per_class=dict(train=1))
    data = load_data(write_data_config(tmp_path / 'data.py', images, batch_size=3))
    rows = {name: Row(name, name, write_tiny_row(tmp_path / f'{name}.py', f'deit-t-half_{name}_shapes.py'), name)
            for name in ('ape', 'peripheral')}
    configs = {name: row_config(row, data) for name, row in rows.items()}
    threads = torch.get_num_threads()
    timing = time_training_steps(configs, repeats=3)
    assert torch.get_num_threads() == threads  # put back
    assert list(timing) == ['ape', 'peripheral']
    for row in timing.values():
        assert row['batch_size'] == 3 and row['input_size'] == [32, 32] and 0 < row['step_time_s'] < 10
    note = step_timing_note(timing, 3)
    assert '(batch 3, 32 x 32 px)' in note and 'one thread' in note and 'median of 3 steps' in note
    assert step_timing_note(None, 3) == 'Step time: not measured (--no-timing).'


def test_a_training_step_changes_the_weights_as_the_configs_optimizer_does(tmp_path):
    """The timed step is a full one: forward, backward and the optimizer's update of every weight."""
    import torch
    images = write_image_folder(tmp_path / 'images', size=32, per_class=dict(train=1))
    data = load_data(write_data_config(tmp_path / 'data.py', images, batch_size=2))
    cfg = row_config(Row('ape', 'ape', write_tiny_row(tmp_path / 'ape.py', 'deit-t-half_ape_shapes.py'),
                                   'ape'), data)
    step = training_step(cfg, (3, 32, 32))
    model, optim_wrapper = step.func.__self__, step.args[1]
    assert optim_wrapper.optimizer.defaults['lr'] == cfg.optim_wrapper.optimizer.lr
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    losses = step()
    assert set(losses) == {'loss'} and torch.isfinite(losses['loss'])
    assert all(not torch.equal(before[name], param) for name, param in model.named_parameters()), 'a weight not updated'


def record(row, seed, finals, **fields):
    return RunRecord(row, seed, [f'randomness.seed={seed}'], '0' * 16, 10 ** 6, 60.0, list(finals), **fields)


def test_every_table_gives_the_mean_the_standard_deviation_and_the_number_of_seeds():
    assert mean_std([98.0, 99.0, 100.0]) == '99.0 ± 1.0 (3 seeds)'  # sample deviation, n - 1
    assert mean_std([97.25]) == '97.2 (1 seed)'
    runs = [record('a', seed, [50.0, final]) for seed, final in enumerate((90.0, 92.0, 94.0))]
    config = 'study/deit-t-half_ape_shapes.py'
    rows = {'a': Row('a', config, ROOT / 'configs' / config, 'APE')}
    (line,) = summarise(runs, rows, {'a': 0.25})
    assert line.top1_std == pytest.approx(2.0) and line.step_time_ms == pytest.approx(250.0)


@pytest.mark.parametrize('count', [3, 11, 25])
def test_every_row_of_a_figure_has_a_colour_of_its_own(count):
    from matplotlib.colors import to_rgba
    assert len({to_rgba(colour) for colour in row_colours(count)}) == count
    runs = [record(f'r{index}', 0, [50.0], top1_at={'size': {'32': 20.0 + index, '64': 50.0 + index}})
            for index in range(count)]
    config = 'study/deit-t-half_ape_shapes.py'
    rows = {run.row: Row(run.row, config, ROOT / 'configs' / config, run.row) for run in runs}
    labels = figure_labels({}, None)._replace(dataset='PositionalShapes', chance_top1=[50.0])
    import matplotlib.pyplot as plt
    figure = size_figure(summarise(runs, rows), runs, SIZE_TESTS[0], (0.5, 1.0), labels, 'scene size')
    drawn = [to_rgba(line.get_color()) for line in figure.axes[0].lines if line.get_label().startswith('r')]
    plt.close(figure)
    assert len(drawn) == count and len(set(drawn)) == count
    figure = comparison_figure(runs, summarise(runs, rows), labels)  # a curve per run
    curves = {to_rgba(line.get_color()) for line in figure.axes[0].lines if len(line.get_xdata()) == 1}
    plt.close(figure)
    assert len(curves) == count


def test_a_run_is_reused_only_with_the_same_config_and_options(tmp_path):
    row = Row('row', 'row.py', tmp_path / 'row.py', 'a row')
    (tmp_path / 'row.py').write_text('model = dict(width=96)\n')
    digest = config_digest(row_config(row, None))
    store, run = RunStore(tmp_path), record('row', 0, [50.0])
    run.config_digest = digest
    assert store.finished('row', 0, run.options, digest) is None  # nothing recorded yet
    store.run_dir('row', 0).mkdir(parents=True)
    store.save(run)
    assert store.finished('row', 0, run.options, digest) == run
    assert store.finished('row', 0, ['randomness.seed=1'], digest) is None
    (tmp_path / 'row.py').write_text('model = dict(width=64)\n')  # the config was edited since
    assert store.finished('row', 0, run.options, config_digest(row_config(row, None))) is None


def record_finished_run(work_dir, args, name, seed, final, **tests):
    """Writes the run.json of a finished run of row ``name`` as the tool would (its options and config
    digest), with a made-up top-1 per epoch."""
    from posattn_openmmlab.study.spec import recorded_options
    row, data = args.study.rows[name], args.data
    options = run_options(row, seed, args.cfg_options, args.epochs)
    run = RunRecord(name, seed, recorded_options(options), config_digest(with_options(row_config(row, data), options)),
                    10 ** 6, 60.0, [final - 5, final], top1_at=tests)
    store = RunStore(work_dir)
    store.run_dir(name, seed).mkdir(parents=True)
    store.save(run)


def test_report_tabulates_the_finished_runs_each_row_over_its_seeds_and_trains_nothing(tmp_path, monkeypatch,
                                                                                          capsys):
    argv = ['--experiment', 'resolution', '--work-dir', str(tmp_path), '--rows', 'ape', 'peg', 'rope', '--seeds',
            '0', '1', '2', '3', '4', '--report', '--no-timing']
    args = tool.parse_args(argv)
    sizes = {'32': 20.0, '48': 40.0, '64': 0.0, '96': 50.0, '128': 30.0}
    for seed, final in enumerate((60.0, 70.0, 80.0, 90.0, 100.0)):  # ape: five seeds
        record_finished_run(tmp_path, args, 'ape', seed, final, size=dict(sizes, **{'64': final}))
    for seed, final in enumerate((40.0, 42.0, 44.0)):  # peg: three seeds
        record_finished_run(tmp_path, args, 'peg', seed, final, size=dict(sizes, **{'64': final}))
    shared = tmp_path / 'peg' / 'seed2' / RunStore.RECORD  # a run shared with another study, under its row name
    shared.write_text(shared.read_text().replace('"row": "peg"', '"row": "other_studys_peg"'))
    record_finished_run(tmp_path, args, 'peg', 3, 46.0)  # finished, but never tested at the other sizes
    record_finished_run(tmp_path, args, 'rope', 1, 50.0, size=dict(sizes, **{'96': 51.0}))
    (tmp_path / 'rope' / 'seed1' / RunStore.RECORD).write_text(  # recorded with other options: not this run
        (tmp_path / 'rope' / 'seed1' / RunStore.RECORD).read_text().replace('randomness.seed=1', 'randomness.seed=9'))
    from posattn_openmmlab.study.runs import StudyRunner
    monkeypatch.setattr(StudyRunner, 'run', lambda *args: pytest.fail('--report trained or tested a run'))
    tool.main(argv)

    record = json.loads((tmp_path / 'comparison.json').read_text())
    assert [(run['row'], run['seed']) for run in record['runs']] == [('ape', seed) for seed in range(5)] + [
        ('peg', 0), ('peg', 1), ('peg', 2)]
    assert [(line['row'], line['seeds'], line['finals']) for line in record['table']] == [
        ('ape', [0, 1, 2, 3, 4], [60.0, 70.0, 80.0, 90.0, 100.0]), ('peg', [0, 1, 2], [40.0, 42.0, 44.0])]
    table = (tmp_path / 'comparison.md').read_text()
    assert '| 80.0 ± 15.8 (5 seeds) |' in table and '| 42.0 ± 2.0 (3 seeds) |' in table
    assert '| +38.0 | [' in table and '| apart |' in table
    printed = capsys.readouterr().out
    assert printed.count('no run with this config finished there: left out of the tables') == 1 + 5  # rope's
    assert 'not tested with --img-size at 32, 48, 64, 96, 128 px: left out of the tables' in printed
    assert not (tmp_path / 'rope' / 'seed0').exists()  # nothing set aside or started


def test_report_with_no_finished_run_is_an_error_naming_the_work_dir(tmp_path):
    with pytest.raises(SystemExit, match=f'no run of the rows ape with seeds \\[0\\] finished in {tmp_path}'):
        tool.main(['--experiment', 'resolution', '--work-dir', str(tmp_path), '--rows', 'ape', '--report'])


def test_an_unfinished_or_other_run_is_set_aside_not_mixed_into_the_new_one(tmp_path):
    store = RunStore(tmp_path)
    run_dir = store.run_dir('ape', 0)
    assert store.set_aside('ape', 0) is None  # nothing there yet
    run_dir.mkdir(parents=True)
    assert store.set_aside('ape', 0) is None  # an empty folder stays
    (run_dir / '20260101_000000' / 'vis_data').mkdir(parents=True)
    (run_dir / '20260101_000000' / 'vis_data' / 'scalars.json').write_text('{"accuracy/top1": 50.0}\n')
    from posattn_openmmlab.work_dir_lock import WorkDirInUseError, WorkDirLock
    with WorkDirLock(str(run_dir)), pytest.raises(WorkDirInUseError, match='in use by another training'):
        store.set_aside('ape', 0)  # a training still running there keeps its folder
    assert run_dir.is_dir()
    aside = store.set_aside('ape', 0)
    assert not run_dir.exists() and aside.name.startswith('seed0.before-')
    assert (aside / '20260101_000000' / 'vis_data' / 'scalars.json').is_file()  # kept, not deleted


def test_a_run_is_read_from_every_log_folder_in_order(tmp_path):
    """A resumed run has a log folder per start: top-1 per epoch and step times over both, in order."""
    with pytest.raises(FileNotFoundError, match='no mmengine scalars under'):
        read_logged_run(tmp_path)
    logs = {'20260101_100000': [dict(lr=1e-3, loss=1.0, time=9.0, iter=1, step=1), {'accuracy/top1': 50.0, 'step': 1}],
            '20260101_120000': [dict(lr=1e-3, loss=0.5, time=0.3, iter=2, step=2),
                                dict(lr=1e-3, loss=0.4, time=0.5, iter=3, step=3), {'accuracy/top1': 90.0, 'step': 2}]}
    for folder, rows in logs.items():
        (tmp_path / folder / 'vis_data').mkdir(parents=True)
        (tmp_path / folder / 'vis_data' / 'scalars.json').write_text(''.join(json.dumps(row) + '\n' for row in rows))
    run = read_logged_run(tmp_path)
    assert run == dict(top1_per_epoch=[50.0, 90.0], logged_step_time_s=pytest.approx(0.4))  # the first window skipped
    (tmp_path / '20260101_120000' / 'vis_data' / 'scalars.json').unlink()
    assert read_logged_run(tmp_path) == dict(top1_per_epoch=[50.0], logged_step_time_s=None)  # one window: warm-up
    (tmp_path / '20260101_100000' / 'vis_data' / 'scalars.json').write_text(json.dumps(logs['20260101_100000'][0]))
    with pytest.raises(ValueError, match='hold no validation top-1'):
        read_logged_run(tmp_path)


def build(row, options=None):
    from mmengine.registry import init_default_scope
    from mmpretrain.registry import MODELS
    cfg = with_options(row_config(row, None), options or {})
    init_default_scope(cfg.default_scope)
    model = MODELS.build(cfg.model)
    model.init_weights()
    return model


def test_each_fine_tune_builds_from_the_starting_checkpoint_and_refuses_to_start_without_one(tmp_path,
                                                                                           monkeypatch):
    import torch
    monkeypatch.chdir(tmp_path)  # the configs' own checkpoint path is relative: here nothing was trained
    args = tool.parse_args(['--experiment', 'swap'])
    rows = args.study.rows
    torch.manual_seed(1)
    trained = build(rows['deit_t'])
    with torch.no_grad():  # no tensor left at an initialisation that a fresh build would repeat (zeros, ones)
        for param in trained.parameters():
            param.normal_()
    start = tmp_path / 'epoch_10.pth'
    torch.save({'state_dict': trained.state_dict()}, start)
    for name, row in rows.items():
        if not row.start_from:
            continue
        with pytest.raises(FileNotFoundError, match='model.backbone.backbone.init_cfg.checkpoint=PATH'):
            build(row)
        model = build(row, run_options(row, 0, {}, starting_checkpoint=start)).state_dict()
        for key, value in trained.state_dict().items():  # the classifier's backbone.* sits under backbone.backbone.*
            assert torch.equal(model[key.replace('backbone.', 'backbone.backbone.', 1)], value), (name, key)
        assert any('.attn.phi.' in key for key in model) == (name != 'finetune_none'), name


def small_run(work_dir, *args, train_images=64, timing=False):
    """The command of a tools/compare_phis.py run with a reduced budget (2 epochs, a few images, no step
    timing unless asked), and its result, checked to have succeeded."""
    command = [sys.executable, 'tools/compare_phis.py', *args, *([] if timing else ['--no-timing']), '--epochs', '2',
               '--work-dir', str(work_dir),
               '--cfg-options', f'train_dataloader.dataset.num_images={train_images}', 'train_dataloader.batch_size=32',
               'val_dataloader.dataset.num_images=32', 'test_dataloader.dataset.num_images=32',
               'default_hooks.logger.interval=1']
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return command, result


@pytest.mark.slow
def test_compare_phis_trains_each_row_and_seed_and_tabulates(tmp_path):
    """Two built-in rows at full width, one seed each (several seeds: test_your_data.py), timed; the
    finished runs reused by the same command."""
    command, result = small_run(tmp_path, '--rows', 'deit_t_peg', 'pervit_t', '--seeds', '0', '--timing-repeats',
                                '2', train_images=96, timing=True)

    record = json.loads((tmp_path / 'comparison.json').read_text())
    assert [(run['row'], run['seed']) for run in record['runs']] == [('deit_t_peg', 0), ('pervit_t', 0)]
    for run in record['runs']:
        assert len(run['top1_per_epoch']) == 2 and all(0 <= top1 <= 100 for top1 in run['top1_per_epoch'])
        assert run['logged_step_time_s'] > 0
        assert (tmp_path / run['row'] / f'seed{run["seed"]}' / 'epoch_2.pth').is_file()
    params = {line['row']: line['params_m'] for line in record['table']}
    assert params['pervit_t'] == pytest.approx(7.3, abs=0.1)   # PerViT-T with a 6-class head
    assert params['deit_t_peg'] == pytest.approx(5.5, abs=0.1)  # ViT-Tiny, no abs. embedding, 5 PEGs
    assert record['table'][1]['top1'] == pytest.approx(record['runs'][1]['top1_per_epoch'][-1])
    for line in record['table']:  # timed by the tool at the batch the runs trained with
        timing = record['step_timing']['rows'][line['row']]
        assert timing['batch_size'] == 32 and timing['input_size'] == [64, 64]
        assert line['step_time_ms'] == pytest.approx(1e3 * timing['step_time_s']) and line['step_time_ms'] > 0
    assert record['figure'] == dict(dataset='PositionalShapes', chance_top1=[pytest.approx(100 / 6)],
                                    step_time_axis='training step time (ms; batch 32, 64 x 64 px; CPU, 1 thread)')

    table = (tmp_path / 'comparison.md').read_text()
    assert '| PerViT-T | `pervit_t_shapes.py` |' in table and '1 seed' in table
    assert 'median of 2 steps' in table
    assert (tmp_path / 'comparison.png').read_bytes()[:4] == b'\x89PNG'
    assert '| PerViT-T | `pervit_t_shapes.py` | 7.31 | 2 |' in result.stdout  # 2 epochs

    # the same settings again: the finished run is reused, not trained again
    again = subprocess.run(command[:3] + ['pervit_t'] + command[5:] + ['--no-timing'], cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count('reusing') == 1 and 'Epoch(val)' not in again.stdout
    record_again = json.loads((tmp_path / 'comparison.json').read_text())
    assert record_again['runs'] == record['runs'][1:]
    assert record_again['table'][0]['step_time_ms'] is None and record_again['figure']['step_time_axis'] is None
    assert 'Step time: not measured (--no-timing).' in (tmp_path / 'comparison.md').read_text()


@pytest.mark.slow
def test_a_user_study_compares_two_phis_on_an_image_folder(tmp_path):
    """Two Φp, one seed (several: test_your_data.py), a study file and a data config of the user's: the
    tables, and figures that name the data, its chance and the batch."""
    write_image_folder(tmp_path / 'two_squares')
    write_data_config(tmp_path / 'two_squares.py', tmp_path / 'two_squares')
    write_tiny_row(tmp_path / 'tiny_ape.py', 'deit-t-half_ape_shapes.py')
    write_tiny_row(tmp_path / 'tiny_peripheral.py', 'deit-t-half_peripheral_shapes.py')
    (tmp_path / 'study.py').write_text(
        "rows = [dict(name='ape', config='tiny_ape.py', label='APE, 2 blocks'),\n"
        "        dict(name='peripheral', config='tiny_peripheral.py', label='PPE (peripheral), 2 blocks')]\n"
        f"data = 'two_squares.py'\nwork_dir = '{tmp_path / 'runs'}'\n")
    command = [sys.executable, 'tools/compare_phis.py', '--study', str(tmp_path / 'study.py'), '--seeds', '0',
               '--epochs', '2', '--timing-repeats', '2', '--cfg-options', 'default_hooks.logger.interval=1']
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    runs_dir = tmp_path / 'runs'
    record = json.loads((runs_dir / 'comparison.json').read_text())
    assert [(run['row'], run['seed']) for run in record['runs']] == [('ape', 0), ('peripheral', 0)]
    for run in record['runs']:
        assert len(run['top1_per_epoch']) == 2 and all(0 <= top1 <= 100 for top1 in run['top1_per_epoch'])
    assert record['figure'] == dict(dataset='CustomDataset (two_squares)', chance_top1=[50.0],
                                    step_time_axis='training step time (ms; batch 8, 64 x 64 px; CPU, 1 thread)')
    assert [line['label'] for line in record['table']] == ['APE, 2 blocks', 'PPE (peripheral), 2 blocks']
    assert all(line['step_time_ms'] > 0 for line in record['table'])
    from mmengine.config import Config
    trained = Config.fromfile(runs_dir / 'ape' / 'seed0' / 'config.py')  # what tools/train.py trained: the user's data
    assert trained.train_dataloader.dataset.type == 'CustomDataset' and trained.model.head.num_classes == 2
    assert trained.model.backbone.arch.num_layers == 2
    (mmengine_log,) = (runs_dir / 'ape' / 'seed0').glob('*/*.log')
    assert "type='CustomDataset'" in mmengine_log.read_text()

    table = (runs_dir / 'comparison.md').read_text()
    assert '| APE, 2 blocks | `tiny_ape.py` |' in table and '(1 seed)' in table
    assert '(batch 8, 64 x 64 px)' in table
    assert (runs_dir / 'comparison.png').read_bytes()[:4] == b'\x89PNG'


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
def test_ablations_experiment_measures_the_attention_of_each_run(tmp_path):
    assert tool.parse_args(['--experiment', 'ablations']).work_dir == Path('work_dirs/compare_phis/ablations')
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
    omega = table.split('| model | Ω of Φa, layer 1 to last |')[1].split('\n\n')[0]  # the Ω table, not the others
    (line,) = [line for line in omega.splitlines() if line.startswith('| (b) without Φp |')]
    mixed, position = line.split('|')[2:4]
    assert len([float(value) for value in mixed.split()]) == 12 and position.split() == ['-'] * 12
    assert (tmp_path / 'comparison.png').read_bytes()[:4] == b'\x89PNG'


@pytest.mark.slow
def test_resolution_experiment_tests_each_run_at_every_size_once(tmp_path):
    command, result = small_run(tmp_path, '--experiment', 'resolution', '--rows', 'ape', 'rope')
    record = json.loads((tmp_path / 'comparison.json').read_text())
    for run in record['runs']:
        assert list(run['top1_at']['size']) == ['32', '48', '64', '96', '128']
        assert all(0 <= top1 <= 100 for top1 in run['top1_at']['size'].values())
        # at the training size the test split is the validation split: the same images, the same top-1
        assert run['top1_at']['size']['64'] == pytest.approx(run['top1_per_epoch'][-1])
        measured = tmp_path / run['row'] / 'seed0' / 'resolution' / 'top1_at_128.json'
        assert json.loads(measured.read_text())['img_size'] == [128, 128]
    assert '| APE (learned absolute embedding) | ' in (tmp_path / 'comparison.md').read_text().split('without fine-tuning')[1]
    assert (tmp_path / 'resolution.png').read_bytes()[:4] == b'\x89PNG'

    # again: neither trained nor tested again
    measured = {path: path.stat().st_mtime_ns for path in tmp_path.glob('*/seed0/resolution/*.json')}
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count('reusing') == 2 and 'top-1 (--img-size)' not in again.stdout
    assert {path: path.stat().st_mtime_ns for path in tmp_path.glob('*/seed0/resolution/*.json')} == measured
    assert json.loads((tmp_path / 'comparison.json').read_text())['runs'] == record['runs']
