"""The GPU kit (docs/gpu.md; its table in docs/performance.md): the Makefile's gpu-wheels and gpu-check, the stages
of benchmarks/gpu_check.py, and benchmarks/report.py on the results of a CPU run.

The kit's test stage is ``pytest --device`` on files that this suite runs anyway: the run of the
whole kit here (``slow``) leaves it out (``--no-tests``); its JUnit XML reading is checked on a
small pytest run of its own.
"""
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO

BENCHMARKS = REPO / 'benchmarks'


def load_benchmark(name):
    """benchmarks/<name>.py as a module, with benchmarks/ on the import path while it loads (for ``common``)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(f'benchmarks_{name}', BENCHMARKS / f'{name}.py')
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


gpu_check = load_benchmark('gpu_check')
report = load_benchmark('report')


# The Makefile's variables of the kit: taken from the environment too, so left out of it here.
KIT_VARIABLES = ('GPU_WHEELS', 'GPU_SITE', 'DEVICE', 'OUT', 'QUICK', 'BUDGET')


def make_dry_run(target, **variables):
    """The commands ``make -n target VAR=value ...`` would run, as one string."""
    if shutil.which('make') is None:
        pytest.skip('make is not installed')
    command = ['make', '-n', target, f'PYTHON={sys.executable}', *(f'{k}={v}' for k, v in variables.items())]
    env = {k: v for k, v in os.environ.items() if k not in KIT_VARIABLES}
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout.replace('\\\n', ' ')


def test_gpu_wheels_builds_posattn_and_einops_wheels_only():
    commands = make_dry_run('gpu-wheels', GPU_WHEELS='/wheels')
    (wheel,) = [line for line in commands.splitlines() if 'pip wheel' in line]
    assert '--no-deps' in wheel and '--wheel-dir /wheels' in wheel and "'einops>=0.7'" in wheel
    assert 'torch' not in wheel


def test_gpu_check_installs_offline_and_runs_the_kit():
    commands = make_dry_run('gpu-check', GPU_WHEELS='/wheels', GPU_SITE='/site', OUT='/results', DEVICE='cpu',
                            QUICK=1, BUDGET=600)
    (install,) = [line for line in commands.splitlines() if 'pip install' in line]
    assert re.search(r'--no-index --no-deps --find-links /wheels --target /site posattn\b', install)
    (run,) = [line for line in commands.splitlines() if 'gpu_check.py' in line]
    assert run.startswith(f'PYTHONPATH=/site {sys.executable} benchmarks/gpu_check.py')
    assert re.search(r'--device cpu --out /results\s+--budget 600 --quick', run)
    default = make_dry_run('gpu-check', OUT='/results')
    assert '--device cuda --out /results' in default and '--quick' not in default and '--budget' not in default


def test_options():
    args = gpu_check.parse_args(['--out', 'results', '--device', 'cpu', '--quick', '--budget', '120', '--no-tests'])
    assert (args.device, str(args.out), args.quick, args.budget, args.tests) == (torch.device('cpu'), 'results',
                                                                                 True, 120.0, False)
    assert gpu_check.parse_args(['--out', 'results', '--device', 'cpu']).budget == 1800
    if torch.cuda.is_available():
        defaults = gpu_check.parse_args(['--out', 'results'])
        assert (defaults.device.type, defaults.quick, defaults.budget, defaults.tests) == ('cuda', False, 450, True)
    with pytest.raises(SystemExit):
        gpu_check.parse_args(['--device', 'cpu'])  # --out is required
    with pytest.raises(SystemExit):
        gpu_check.parse_args(['--out', 'results', '--device', 'meta'])


def stage(stages, name):
    (found,) = [s for s in stages if s.name == name]
    return ' '.join(found.command)


def test_the_gpu_plan_measures_what_the_docs_report(tmp_path):
    """On CUDA: the tests, each benchmark in fp32 and bf16 at the sizes of the docs' table, then the
    compiled training steps; ``--quick`` leaves out the slow tests and the compile."""
    cuda = torch.device('cuda')
    stages = gpu_check.plan(cuda, quick=False, out=tmp_path)
    assert [s.name for s in stages] == ['tests', 'attention fp32', 'attention bf16', 'models fp32', 'models bf16',
                                        'dense fp32', 'dense bf16', 'native resolution bf16', 'naflex swap bf16',
                                        'compiled bf16']
    tests = stage(stages, 'tests')
    assert '--device cuda' in tests and f'--junitxml={tmp_path / "tests-cuda.xml"}' in tests
    assert stages[0].command.count('-m') == 1  # python -m pytest, every test: the slow ones too
    assert all(f in tests for f in gpu_check.TEST_FILES)
    assert '--batch 128 256' in stage(stages, 'models bf16') and '--sizes 800x1344' in stage(stages, 'dense fp32')
    assert '--compile' in stage(stages, 'compiled bf16') and '--dtype bf16' in stage(stages, 'compiled bf16')
    assert all(f'--out {tmp_path}' in ' '.join(s.command) for s in stages[1:])
    assert '--dtype bf16' in stage(stages, 'native resolution bf16')
    assert '--images 64' in stage(stages, 'naflex swap bf16')
    quick = gpu_check.plan(cuda, quick=True, out=tmp_path)
    assert [s.name for s in quick] == [s.name for s in stages[:-1]]
    assert "not environment and not slow" in stage(quick, 'tests')
    benchmarks_only = gpu_check.plan(torch.device('cpu'), quick=True, out=tmp_path, tests=False)
    assert benchmarks_only[0].name == 'attention fp32' and '--grids 4' in stage(benchmarks_only, 'attention fp32')


def test_every_test_file_of_the_kit_has_device_aware_tests():
    for name in gpu_check.TEST_FILES:
        text = (REPO / name).read_text()
        assert re.search(r'^def test_\w+\([^)]*\bdevice\b', text, flags=re.M), f'{name} has no test that takes `device`'


def test_junit_counts_read_pytests_junit_xml(tmp_path):
    (tmp_path / 'test_sample.py').write_text(
        'import pytest\n\n'
        'def test_passes():\n    pass\n\n'
        'def test_fails():\n    assert 1 == 2\n\n'
        '@pytest.mark.skip(reason="never")\ndef test_skipped():\n    pass\n')
    xml = tmp_path / 'tests.xml'
    subprocess.run([sys.executable, '-m', 'pytest', str(tmp_path / 'test_sample.py'), '-q', '-p', 'no:cacheprovider',
                    f'--junitxml={xml}', '--rootdir', str(tmp_path)], cwd=tmp_path, capture_output=True, timeout=120)
    counts = gpu_check.junit_counts(xml)
    assert {k: counts[k] for k in ('tests', 'passed', 'failed', 'errors', 'skipped')} == dict(
        tests=3, passed=1, failed=1, errors=0, skipped=1)
    assert counts['failing'] == ['test_sample::test_fails']
    assert gpu_check.junit_counts(tmp_path / 'absent.xml') is None
    (tmp_path / 'cut.xml').write_text(xml.read_text()[:100])  # pytest stopped while writing it
    assert gpu_check.junit_counts(tmp_path / 'cut.xml') is None


def test_an_installed_package_that_is_not_the_checkouts_is_named(tmp_path):
    for root in ('installed', 'checkout'):
        (tmp_path / root / 'phi').mkdir(parents=True)
        (tmp_path / root / '__init__.py').write_text('')
        (tmp_path / root / 'phi' / 'rpb.py').write_text(f'# {root}\n')
    (tmp_path / 'checkout' / 'phi' / 'rope.py').write_text('')
    (tmp_path / 'installed' / 'notes.txt').write_text('not a source')
    assert gpu_check.differing_sources(tmp_path / 'installed', tmp_path / 'checkout') == ['phi/rope.py', 'phi/rpb.py']
    assert gpu_check.differing_sources(REPO / 'posattn', REPO / 'posattn') == []


def test_a_stage_past_its_limit_is_killed_with_its_children(tmp_path):
    """A stage and what it started (compile workers, say) are killed at the limit."""
    pid_file = tmp_path / 'child.pid'
    sleeper = gpu_check.Stage('sleeper', [sys.executable, '-c', (
        'import pathlib, subprocess, sys, time\n'
        'child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])\n'
        f'pathlib.Path({str(pid_file)!r}).write_text(str(child.pid))\n'
        'time.sleep(60)')], limit_s=60)
    result = gpu_check.run_stage(sleeper, tmp_path, limit_s=5)
    assert result.status == 'timed out' and result.seconds < 30
    assert result.files == ['child.pid', 'sleeper.log']
    status = f'/proc/{pid_file.read_text()}/status'
    deadline = time.monotonic() + 10
    while os.path.exists(status) and 'State:\tZ' not in open(status).read() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(status) or 'State:\tZ' in open(status).read()  # gone, or a zombie left to reap


def test_stages_that_the_budget_cannot_fit_are_skipped(tmp_path, capsys):
    assert gpu_check.main(['--device', 'cpu', '--out', str(tmp_path), '--budget', '30']) == 1
    summary = json.loads((tmp_path / 'summary.json').read_text())
    planned = gpu_check.plan(torch.device('cpu'), quick=False, out=tmp_path)
    assert [s['name'] for s in summary['stages']] == [s.name for s in planned]
    assert all(s['status'].startswith('skipped: ') and s['returncode'] is None for s in summary['stages'])
    assert summary['machine']['torch'] == torch.__version__ and summary['options']['device'] == 'cpu'
    assert 'not passed: tests, attention fp32' in capsys.readouterr().out


def test_report_refuses_a_page_without_its_markers_and_a_cpu_run(tmp_path, capsys):
    (tmp_path / 'summary.json').write_text(json.dumps(
        {'machine': {}, 'options': {'device': 'cpu', 'quick': True}, 'stages': [], 'tests': None}))
    with pytest.raises(SystemExit):
        report.main([str(tmp_path), '--doc', str(tmp_path / 'page.md')])
    assert "holds the results of a cpu run, not a GPU's; pass --allow-cpu" in capsys.readouterr().err
    page = tmp_path / 'page.md'
    page.write_text('# Performance\n\nno table here\n')
    with pytest.raises(SystemExit, match=f'needs one line {re.escape(report.BEGIN)}'):
        report.rewrite(page, ['| a |'])
    with pytest.raises(SystemExit, match='summary.json is absent'):
        report.main([str(tmp_path / 'elsewhere'), '--allow-cpu'])


@pytest.fixture(scope='module')
def cpu_run(tmp_path_factory):
    """The benchmarks of the kit on the CPU, tiny sizes (``--quick --no-tests``): their results folder."""
    out = tmp_path_factory.mktemp('gpu-check-cpu')
    result = subprocess.run([sys.executable, str(BENCHMARKS / 'gpu_check.py'), '--device', 'cpu', '--quick',
                             '--no-tests', '--out', str(out), '--budget', '900'],
                            cwd=REPO, capture_output=True, text=True, timeout=960)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def cell_numbers(cell):
    """'2.21x (18.3 / 8.26 ms)' -> [2.21, 18.3, 8.26]."""
    return [float(x) for x in re.findall(r'\d+(?:\.\d+)?(?:e[-+]?\d+)?', cell)]


def table_cells(text):
    """{(measurement, setting): [fp32 cell, bf16 cell]} of the page's GPU table."""
    table = text.split(report.BEGIN, 1)[1].split(report.END, 1)[0]
    rows = [line.strip('|').split(' | ') for line in table.splitlines() if line.startswith('| ') and '---' not in line]
    return {(r[0].strip(), r[1].strip()): [c.strip() for c in r[2:]] for r in rows[1:]}


@pytest.mark.slow
def test_the_kit_runs_on_the_cpu_and_report_writes_its_figures(cpu_run, tmp_path):
    summary = json.loads((cpu_run / 'summary.json').read_text())
    assert [s['status'] for s in summary['stages']] == ['passed'] * 8
    for dtype in ('fp32', 'bf16'):
        for script in ('attention', 'models', 'dense'):
            assert (cpu_run / f'{script}-cpu-{dtype}.json').exists()
    assert (cpu_run / 'native-resolution-cpu-bf16.json').exists() and (cpu_run / 'naflex-swap-cpu-bf16.json').exists()
    doc = REPO / 'docs' / 'performance.md'
    page = tmp_path / 'performance.md'
    shutil.copy(doc, page)
    report.main([str(cpu_run), '--doc', str(page), '--allow-cpu'])
    written = page.read_text()
    original = doc.read_text()
    before, after = original.split(report.BEGIN)[0], original.split(report.END)[1]
    assert written.startswith(before + report.BEGIN) and written.endswith(report.END + after)
    report.main([str(cpu_run), '--doc', str(page), '--allow-cpu'])
    assert page.read_text() == written  # the same results, the same page
    assert f'on the CPU ({summary["machine"]["cpu"]}' in written and f'torch {torch.__version__}' in written
    cells = table_cells(written)
    for column, dtype in enumerate(('fp32', 'bf16')):
        attention = json.loads((cpu_run / f'attention-cpu-{dtype}.json').read_text())
        (layer,) = [r for r in attention['rows'] if r['comparison'] == 'layer fwd+bwd']
        shown = cell_numbers(cells[('attention layer fwd+bwd, peripheral / none (SDPA without a bias)', '4x4')][column])
        assert shown == pytest.approx([layer['A ms'] / layer['B ms'], layer['A ms'], layer['B ms']], rel=6e-3)
        dense = json.loads((cpu_run / f'dense-cpu-{dtype}.json').read_text())
        peaks = cell_numbers(cells[('dense backbone peak memory, peripheral / none / peripheral with checkpointing',
                                    '64x96')][column])
        assert peaks == pytest.approx([r['peak MiB'] for r in dense['backbone']], rel=6e-3)
        models = json.loads((cpu_run / f'models-cpu-{dtype}.json').read_text())
        step = {r['model']: r['ms'] for r in models['rows'] if r['task'] == 'train step'}
        shown = cell_numbers(cells[('PerViT-T / DeiT-T, training step time', 'batch 2')][column])
        assert shown == pytest.approx([step['PerViT-T'] / step['DeiT-T'], step['PerViT-T'], step['DeiT-T']], rel=6e-3)
    assert cells[('PerViT-T training step, `torch.compile` / eager', 'batch 128')] == ['not run', 'not run']
