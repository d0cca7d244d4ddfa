"""The study library behind tools/compare_phis.py (posattn_openmmlab.study): study files with study-wide
options, inheritance and row changes; run records and their store; the verdict on each difference
(apart, equal within N points, the seed decides, with the seeds that would tell) against an
independent oracle; the tables with every column defined and words that follow the data; the figures
telling seeds apart; and the checks that refuse a broken study, naming the row, before any run."""
import json
import os
import statistics
import sys
import time
from pathlib import Path

import pytest

from conftest import require_openmmlab

require_openmmlab()

from posattn_openmmlab.study import RunRecord, RunStore, StudyError, checked_run_configs, load_study  # noqa: E402
from posattn_openmmlab.study.figures import FigureLabels, comparison_figure  # noqa: E402
from posattn_openmmlab.study.report import (SIZE_TESTS, compare, convergence, convergence_table,  # noqa: E402
                                            main_table, ranking_table, seeds_to_resolve, size_table, summarise)
from posattn_openmmlab.study.runs import run_options  # noqa: E402
from posattn_openmmlab.study.spec import STUDIES, Row  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
APE = ROOT / 'configs' / 'study' / 'deit-t-half_ape_shapes.py'


def write_study(folder: Path, text: str, name: str = 'study.py') -> Path:
    path = folder / name
    path.write_text(text)
    return path


def record(row, seed, top1_per_epoch, **fields):
    return RunRecord(row=row, seed=seed, options=[f'randomness.seed={seed}'], config_digest='0' * 16, params=10 ** 6,
                     wall_s=60.0, top1_per_epoch=list(top1_per_epoch), **fields)


# ---------------------------------------------------------------- study files


def test_study_wide_options_sit_under_each_rows_own(tmp_path):
    study = load_study(write_study(tmp_path, f"""
options = {{'optim_wrapper.clip_grad.max_norm': 1.0, 'phi': 'rope'}}
rows = [dict(name='a', config='{APE}'), dict(name='b', config='{APE}', options=dict(phi='alibi'))]
"""))
    assert dict(study.rows['a'].options) == {'optim_wrapper.clip_grad.max_norm': 1.0, 'phi': 'rope'}
    assert dict(study.rows['b'].options) == {'optim_wrapper.clip_grad.max_norm': 1.0, 'phi': 'alibi'}
    assert run_options(study.rows['b'], 3, {'train_dataloader.batch_size': 8}, epochs=4) == {
        'train_dataloader.batch_size': 8, 'optim_wrapper.clip_grad.max_norm': 1.0, 'phi': 'alibi',
        'randomness.seed': 3, 'train_cfg.max_epochs': 4}


def test_a_study_inherits_another_and_changes_rows_by_name(tmp_path):
    write_study(tmp_path, f"rows = [dict(name='a', config='{APE}', label='A'), dict(name='b', config='{APE}')]\n"
                          "analyse = True\n", 'base.py')
    study = load_study(write_study(tmp_path, "_base_ = './base.py'\nrow_changes = dict(a=dict(label='A, changed'))\n"
                                             'equal_within = 1.5\n'))
    assert [row.label for row in study.rows.values()] == ['A, changed', 'b'] and study.analyse
    assert study.equal_within == 1.5
    with pytest.raises(ValueError, match=r'row_changes names c, which is no row of the study; its rows: a, b'):
        load_study(write_study(tmp_path, "_base_ = './base.py'\nrow_changes = dict(c=dict(label='C'))\n"))
    with pytest.raises(ValueError, match=r'equal_within is a number of points >= 0, got -1'):
        load_study(write_study(tmp_path, "_base_ = './base.py'\nequal_within = -1\n"))


def test_the_relations_ablations_share_row_a_with_the_relations_study():
    """Written by inheritance: the ablation rows, row (a) changed to the relations study's PerViT-T row."""
    ablations, relations = load_study(STUDIES / 'relations_ablations.py'), load_study(STUDIES / 'relations.py')
    assert list(ablations.rows) == list(load_study(STUDIES / 'ablations.py').rows)
    assert ablations.rows['a'][1:3] == relations.rows['pervit_t'][1:3]
    assert ablations.rows['a'].options == relations.rows['pervit_t'].options


# ---------------------------------------------------------------- records


def test_a_record_round_trips_and_reads_the_older_layout(tmp_path):
    run = record('ape', 1, [50.0, 60.0], logged_step_time_s=0.2, top1_at={'size': {'32': 40.0}})
    assert RunRecord.from_json(json.loads(json.dumps(run.to_json()))) == run
    older = dict(run.to_json(), step_time_s=0.3, top1_at_size={'32': 41.0}, top1_at_extent={'64': 9.0})
    del older['top1_at'], older['logged_step_time_s']
    read = RunRecord.from_json(older)
    assert read.logged_step_time_s == 0.3 and read.top1_at == {'size': {'32': 41.0}, 'extent': {'64': 9.0}}


def test_the_store_reuses_a_run_only_with_the_same_options_and_config(tmp_path):
    store = RunStore(tmp_path)
    run = record('ape', 0, [50.0])
    store.run_dir('ape', 0).mkdir(parents=True)
    store.save(run)
    assert store.finished('ape', 0, run.options, run.config_digest) == run
    assert store.finished('other_studys_ape', 0, run.options, run.config_digest) is None  # another folder
    assert store.finished('ape', 0, ['randomness.seed=9'], run.config_digest) is None
    assert store.finished('ape', 0, run.options, '1' * 16) is None
    aside = store.set_aside('ape', 0)
    assert aside.name.startswith('seed0.before-') and (aside / RunStore.RECORD).is_file()


# ---------------------------------------------------------------- verdicts


def welch_oracle(above, below):
    """Welch's 95% interval written from the textbook formula (Satterthwaite's degrees of freedom)."""
    from scipy.stats import t
    va, vb = statistics.variance(above) / len(above), statistics.variance(below) / len(below)
    dof = (va + vb) ** 2 / (va ** 2 / (len(above) - 1) + vb ** 2 / (len(below) - 1))
    half = t.ppf(0.975, dof) * (va + vb) ** 0.5
    difference = statistics.fmean(above) - statistics.fmean(below)
    return difference - half, difference + half


@pytest.mark.parametrize('above,below,words', [
    ([90.0, 91.0, 92.0], [80.0, 81.0, 82.0], 'apart'),
    ([90.0, 90.5, 91.0], [90.2, 90.7, 90.4], 'equal within 3 points'),
    ([90.0, 60.0, 75.0], [70.0, 85.0, 55.0], 'the seed decides (about'),
    ([90.0, 91.0], [80.0, 81.0, 82.0], 'needs 3 seeds per row (has 2)'),
])
def test_each_difference_is_apart_equal_within_n_points_or_decided_by_the_seed(above, below, words):
    verdict = compare(above, below, equal_within=3.0)
    assert verdict.words.startswith(words)
    assert verdict.difference == pytest.approx(statistics.fmean(above) - statistics.fmean(below))
    if len(above) >= 3:
        assert verdict.interval == pytest.approx(welch_oracle(above, below))
    else:
        assert verdict.interval is None


def test_the_seeds_that_would_tell_make_the_interval_narrow_enough():
    above, below = [90.0, 60.0, 75.0], [70.0, 85.0, 55.0]
    seeds = seeds_to_resolve(above, below, 3.0)
    from scipy.stats import t
    variance = statistics.variance(above) + statistics.variance(below)
    half_width = lambda n: t.ppf(0.975, 2 * n - 2) * (variance / n) ** 0.5  # noqa: E731
    needed = max(abs(statistics.fmean(above) - statistics.fmean(below)), 3.0 - abs(statistics.fmean(above) -
                                                                                  statistics.fmean(below)))
    assert half_width(seeds) < needed <= half_width(seeds - 1)
    assert f'about {seeds} seeds per row would tell' in compare(above, below, 3.0).words


# ---------------------------------------------------------------- tables and figures


def rows_of(*names):
    return {name: Row(name, 'study/deit-t-half_ape_shapes.py', APE, name.upper()) for name in names}


def test_every_column_of_every_table_is_defined_under_it():
    runs = [record('a', seed, [50.0, final], top1_at={'size': {'32': final - 10, '64': final}})
            for seed, final in enumerate((90.0, 92.0, 94.0))]
    runs += [record('b', seed, [40.0, final], top1_at={'size': {'32': final - 5, '64': final}})
             for seed, final in enumerate((60.0, 61.0, 59.0))]
    table = summarise(runs, rows_of('a', 'b'))
    main = main_table(table, 'not measured (--no-timing).')
    for column in ('final top-1', 'range', 'best-epoch top-1', 'epochs to 95%', 'step time', 'run time'):
        assert f'\n- {column}: ' in main
    assert '| A | `study/deit-t-half_ape_shapes.py` | 1.00 | 2 | 92.0 ± 2.0 (3 seeds) | 4.0 | 92.0 | -, -, - ' in main
    ranking = ranking_table(table, {line.row: line.finals for line in table}, 3.0, 'top-1')
    assert '| 1 | A | 92.0 ± 2.0 (3 seeds) | +32.0 | [' in ranking and '| apart |' in ranking
    for defined in ('minus the next: ', '95% interval: ', 'apart: the interval excludes 0; equal within 3 points: '):
        assert defined in ranking
    scenes = size_table(table, runs, SIZE_TESTS[0], (0.5, 1.0), generated=True)
    images = size_table(table, runs, SIZE_TESTS[0], (0.5, 1.0), generated=False)
    assert 'the same test scenes drawn smaller or larger' in scenes and 'scenes' not in images
    assert 'the test images resized to each size' in images and '| 0.5x: 32 px | 1x: 64 px |' in images


CONVERGED = [50.0, 52.0, 70.0, 80.0, 85.0, 88.0, 89.0, 89.5, 89.7, 89.9]  # 2 classes: left chance at epoch 3
RISING = [50.0, 50.0, 50.0, 50.0, 50.0, 51.0, 62.0, 75.0, 85.0, 95.0]  # left chance at epoch 7 and still rising


def test_convergence_finds_where_a_run_left_chance_and_how_far_its_last_epochs_moved():
    assert convergence(CONVERGED, 50.0) == (3, pytest.approx(89.9 - 89.5))  # epochs 8, 9, 10: the last 20% and one
    assert convergence(CONVERGED, 50.0).converged()
    rising = convergence(RISING, 50.0)
    assert rising == (7, 95.0 - 75.0) and not rising.converged()
    assert convergence([10.0] * 10, 10.0) == (None, 0.0)


def test_the_convergence_table_names_the_runs_that_have_not_converged():
    runs = [record('a', 0, CONVERGED), record('a', 1, RISING), record('b', 0, [50.0] * 10)]
    text = convergence_table(summarise(runs, rows_of('a', 'b')), runs, {'a': 50.0, 'b': 50.0})
    assert '| A | 50.0 | yes | 3, 7 | 0.4, 20.0 |' in text and '| B | 50.0 | no | - | 0.0 |' in text
    assert 'Check: every seed of a learning row left chance by half the epochs: no, not A seed 1.' in text
    assert ("Check: the last 20% of the epochs moved every run's top-1 by less than 1 point: no, A seed 1 (20.0)."
            in text)
    settled = [record('a', 0, CONVERGED), record('a', 1, CONVERGED)]
    text = convergence_table(summarise(settled, rows_of('a')), settled, {'a': 50.0})
    assert text.count(': yes.') == 2
    for defined in ('learns: ', 'left chance: ', 'moved: '):
        assert f'\n- {defined}' in text


def test_the_curves_tell_the_seeds_of_a_row_apart():
    runs = [record('a', seed, [40.0 + seed, 50.0 + seed]) for seed in range(3)]
    table = summarise(runs, rows_of('a'))
    figure = comparison_figure(runs, table, FigureLabels('PositionalShapes', [50.0], None))
    curves = [line for line in figure.axes[0].lines if len(line.get_xdata()) == 2]
    assert len({str(line.get_linestyle()) for line in curves}) == 3  # a line style per seed
    assert {'seed 0', 'seed 1', 'seed 2', 'A'} <= {text.get_text() for text in figure.axes[0].get_legend().get_texts()}


# ---------------------------------------------------------------- checks before any run


def broken_study(tmp_path, rows, extra=''):
    return load_study(write_study(tmp_path, f'rows = [{rows}]\n{extra}'))


def check(study, tmp_path):
    return checked_run_configs(study, list(study.rows), None,
                               {name: run_options(row, 0, {}) for name, row in study.rows.items()}, tmp_path)


def test_a_missing_config_is_refused_when_the_study_is_read_naming_the_row(tmp_path):
    with pytest.raises(FileNotFoundError, match=r'row 2 \(b\): no config file nowhere.py'):
        broken_study(tmp_path, f"dict(name='a', config='{APE}'), dict(name='b', config='nowhere.py')")


def test_every_broken_row_is_named_at_once_before_anything_trains(tmp_path):
    """An unknown Φp, a misspelt option, a test size that is not square and a data folder that is not
    there (read from the folder the command runs in): each row named, every problem at once."""
    data_config = tmp_path / 'folder_data.py'
    data_config.write_text(f"_base_ = '{ROOT / 'configs' / 'your_data' / 'deit_t_image_folder.py'}'\n")
    study = broken_study(tmp_path, f"""
    dict(name='fine', config='{APE}'),
    dict(name='phi', config='{ROOT / 'configs' / 'your_data' / 'deit_t_image_folder.py'}', options=dict(phi='ropee')),
    dict(name='typo', config='{APE}', options=dict(phii='rope')),
    dict(name='folder', config='{data_config}', options=dict(data_root='data/not_here', phi='rope')),
    """)
    start = time.perf_counter()
    with pytest.raises(StudyError) as error:
        check(study, tmp_path)
    message = str(error.value)
    assert message.startswith('the study cannot run as it is; nothing was trained:')
    assert "row phi (" in message and "model.backbone.phi, phi = 'ropee' names no registered Φp ('ropee')" in message
    assert 'row typo (' in message and 'phii' in message and 'did you mean' in message
    assert (f"row folder ({data_config}): train_dataloader.dataset.data_root='data/not_here', "
            "val_dataloader.dataset.data_root='data/not_here', test_dataloader.dataset.data_root='data/not_here': "
            f"{tmp_path / 'data' / 'not_here'} does not exist (a relative data_root is read from the folder the "
            'command runs in') in message
    assert 'row fine' not in message
    print(f'checked in {time.perf_counter() - start:.1f} s')


def test_a_relative_data_root_is_read_from_the_folder_the_command_runs_in(tmp_path):
    (tmp_path / 'data' / 'mine').mkdir(parents=True)
    study = broken_study(tmp_path, f"dict(name='rope', config='{ROOT / 'configs' / 'your_data' / 'deit_t_image_folder.py'}',"
                                   " options=dict(data_root='data/mine', phi='rope'))")
    cfg = check(study, tmp_path)['rope']
    assert cfg.data_root == str(tmp_path / 'data' / 'mine')
    assert {cfg[loader].dataset.data_root for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader')} == {
        str(tmp_path / 'data' / 'mine')}


def test_test_sizes_that_do_not_apply_are_refused_naming_the_row(tmp_path):
    study = broken_study(tmp_path, f"dict(name='ape', config='{APE}')", 'test_size_factors = (0.5, 0.3)\n'
                                                                        'test_extent_factors = (1, 2)\n')
    with pytest.raises(StudyError) as error:
        check(study, tmp_path)
    assert 'row ape (' in str(error.value)
    assert 'a test size of 64 pixels times (0.5, 0.3) is not a whole number of pixels each time' in str(error.value)
    assert 'test_extent_factors draw PositionalRelations scenes on larger canvases; this row tests on ' \
           'PositionalShapes' in str(error.value)
    check(broken_study(tmp_path, f"dict(name='ape', config='{APE}')", 'test_size_factors = (0.5, 1.5)\n'), tmp_path)


# ---------------------------------------------------------------- running: jobs, devices, failures

FAKE_TRAINER = '''
import json, os, sys, time
config, run_dir = sys.argv[1], sys.argv[3]
name = os.path.basename(os.path.dirname(run_dir)) + '/' + os.path.basename(run_dir)
with open(os.environ['FAKE_EVENTS'], 'a') as events:
    events.write(json.dumps(dict(run=name, at='start', time=time.time(), threads=os.environ.get('OMP_NUM_THREADS'),
                                 gpus=os.environ.get('CUDA_VISIBLE_DEVICES'))) + chr(10))
time.sleep(0.5)
if name in os.environ.get('FAKE_FAILS', '').split(','):
    print('RuntimeError: this run died'); sys.exit(1)
logs = os.path.join(run_dir, '20260101_000000', 'vis_data')
os.makedirs(logs)
with open(os.path.join(logs, 'scalars.json'), 'w') as scalars:
    for epoch in (1, 2):
        scalars.write(json.dumps({'loss': 1.0, 'lr': 0.1, 'time': 0.1, 'epoch': epoch}) + chr(10))
        scalars.write(json.dumps({'accuracy/top1': 50.0 + epoch, 'step': epoch}) + chr(10))
        print(f'Epoch(val) [{epoch}][1/1] - accuracy/top1: {50.0 + epoch}')
open(os.path.join(run_dir, 'epoch_2.pth'), 'w').close()
open(os.path.join(run_dir, 'last_checkpoint'), 'w').write(os.path.join(run_dir, 'epoch_2.pth'))
with open(os.environ['FAKE_EVENTS'], 'a') as events:
    events.write(json.dumps(dict(run=name, at='end', time=time.time())) + chr(10))
'''


@pytest.fixture
def fake_training(tmp_path, monkeypatch):
    """Runs train a fake tools/train.py that logs two epochs (or dies where FAKE_FAILS names the run);
    returns the events it wrote, one dict a start or end of a run."""
    from posattn_openmmlab.study import runs as study_runs
    trainer = tmp_path / 'fake_train.py'
    trainer.write_text(FAKE_TRAINER)
    events = tmp_path / 'events.jsonl'
    monkeypatch.setenv('FAKE_EVENTS', str(events))
    monkeypatch.delenv('OMP_NUM_THREADS', raising=False)
    monkeypatch.setattr(study_runs.StudyRunner, 'train_command',
                        lambda self, config, run_dir: [sys.executable, str(trainer), str(config), '--work-dir',
                                                       str(run_dir)])
    monkeypatch.setattr(study_runs, 'count_parameters', lambda cfg: 10 ** 6)
    return lambda: [json.loads(line) for line in events.read_text().splitlines()] if events.is_file() else []


def study_runner(tmp_path, jobs, rows_text, lines=None, device='cpu'):
    from posattn_openmmlab.study import StudyRunner
    study = load_study(write_study(tmp_path, f'rows = [{rows_text}]\n'))
    runner = StudyRunner(study, RunStore(tmp_path / 'work'), None, tmp_path,
                         echo=(lines.append if lines is not None else lambda line: None), device=device, jobs=jobs)
    return study, runner


def collect(runner, study, rows, seeds):
    from posattn_openmmlab.study import collect_runs
    return collect_runs(runner, rows, seeds, lambda name, seed, start=None: run_options(study.rows[name], seed, {},
                                                                                        None, start), False)


def test_jobs_train_runs_at_once_each_with_its_share_of_the_cores_and_no_gpu(tmp_path, fake_training):
    lines = []
    study, runner = study_runner(tmp_path, 2, f"dict(name='a', config='{APE}'), dict(name='b', config='{APE}')", lines)
    runs = collect(runner, study, ['a', 'b'], [0, 1])
    assert [(run.row, run.seed, run.top1_per_epoch) for run in runs] == [
        ('a', 0, [51.0, 52.0]), ('a', 1, [51.0, 52.0]), ('b', 0, [51.0, 52.0]), ('b', 1, [51.0, 52.0])]
    events = fake_training()
    running, most = 0, 0
    for event in sorted(events, key=lambda event: event['time']):
        running += 1 if event['at'] == 'start' else -1
        most = max(most, running)
    assert most == 2  # two at once, never three
    assert {event['threads'] for event in events if event['at'] == 'start'} == {str(max(1, os.cpu_count() // 2))}
    assert {event['gpus'] for event in events if event['at'] == 'start'} == {''}
    assert any(line.startswith('    [a seed 1] accuracy/top1: 52.0') for line in lines)
    assert not any('reusing' in line for line in lines)  # just trained, not reused


def test_a_run_that_dies_is_named_the_others_finish_and_it_reruns_alone(tmp_path, fake_training, monkeypatch):
    from posattn_openmmlab.study import RunFailed
    monkeypatch.setenv('FAKE_FAILS', 'b/seed1')
    rows = (f"dict(name='a', config='{APE}'), dict(name='b', config='{APE}'), "
            f"dict(name='c', config='{APE}', start_from='b', checkpoint_keys=['load_from'])")
    study, runner = study_runner(tmp_path, 2, rows)
    with pytest.raises(RunFailed) as error:
        collect(runner, study, ['a', 'b', 'c'], [0, 1])
    message = str(error.value)
    assert message.startswith('2 of 6 runs failed:')
    assert f"row b, seed 1 failed; {tmp_path / 'work' / 'b' / 'seed1' / 'train.log'} ends with:" in message
    assert 'RuntimeError: this run died' in message
    assert 'row c, seed 1 did not train: the run it starts from failed' in message
    assert '--rows ROW --seeds SEED (b 1; c 1)' in message
    trained = sorted(event['run'] for event in fake_training() if event['at'] == 'end')
    assert trained == ['a/seed0', 'a/seed1', 'b/seed0', 'c/seed0']
    starts = {event['run']: event['time'] for event in fake_training() if event['at'] == 'start'}
    ends = {event['run']: event['time'] for event in fake_training() if event['at'] == 'end'}
    assert starts['c/seed0'] >= ends['b/seed0']  # a fine-tune after the run it starts from

    monkeypatch.delenv('FAKE_FAILS')
    study, runner = study_runner(tmp_path, 1, rows)
    runs = collect(runner, study, ['b'], [1])  # the failed run alone
    assert [(run.row, run.seed) for run in runs] == [('b', 1)]
    runs = collect(runner, study, ['a', 'b', 'c'], [0, 1])  # then the rest: only c seed 1 is left to train
    assert len(runs) == 6
    trained = [event['run'] for event in fake_training() if event['at'] == 'end']
    assert trained[4:] == ['b/seed1', 'c/seed1']


def test_a_study_refuses_a_device_it_does_not_know_and_jobs_below_one(tmp_path):
    with pytest.raises(ValueError, match=r"device is one of cpu, cuda, got 'tpu'"):
        study_runner(tmp_path, 1, f"dict(name='a', config='{APE}')", device='tpu')
    with pytest.raises(ValueError, match=r'jobs must be >= 1, got 0'):
        study_runner(tmp_path, 0, f"dict(name='a', config='{APE}')")
