"""The GPU kit's one command: the device-aware tests, then the benchmarks, every result in one folder.

    make gpu-check                                            # on the GPU machine (docs/performance.md)
    python benchmarks/gpu_check.py --device cuda --out OUT    # what make gpu-check runs
    python benchmarks/gpu_check.py --device cpu --quick --out OUT   # the kit itself, on the CPU
    python benchmarks/report.py OUT                           # then: the GPU table of docs/performance.md

Stages, in this order, each a subprocess with its output in ``OUT/<stage>.log``; one that fails
or runs out of time is recorded and the next one runs:

- tests: ``pytest --device DEVICE`` on the device-aware tests (:data:`TEST_FILES`): Φp against
  ``posattn.reference`` in float64, ``biased_attention``'s CUDA route against the CPU kernel,
  gradchecks, PerViT-T's parity with the release, swapped timm models, bf16 training tracking
  fp32. JUnit XML in ``OUT/tests-<device>.xml``.
- attention fp32 / bf16 (``attention.py``): the layer against plain attention (SDPA without a
  bias), posattn's Φp against the release's, ``biased_attention`` against SDPA.
- models fp32 / bf16 (``models.py``): PerViT-T against DeiT-T and against the release's MPA,
  training step at batch 128 and 256, and inference.
- dense fp32 / bf16 (``dense.py``): the windowed + global PerViT-T backbone at 800 x 1344, its time
  against Φp ``none`` and its peak memory.
- native resolution bf16 (``native_resolution.py``): images of many grids in one batch, padded,
  packed, image by image and on one shared grid, every Φp; naflex swap bf16 (``naflex_swap.py``):
  a NaFlexViT training step, timm's model against its attention swapped for posattn's.
- compiled bf16 (``models.py --compile``): the training steps of PerViT-T and DeiT-T compiled by
  ``torch.compile`` against eager, batch 128, and the time of the first compile.

``--quick`` deselects the slow tests, runs fewer rounds and skips the compiled stage. On the CPU,
quick or not, every size is tiny (batches of 1 or 2, grids of 2 x 2 to 4 x 6): a CPU run checks
the kit, not the speed. ``--no-tests`` runs the benchmarks alone. ``--budget`` (450 s on a GPU,
1800 s on the CPU) caps the whole run: each stage's time limit is cut to what is left, and a
stage that cannot get a minute is skipped. ``OUT/summary.json``, rewritten after every stage,
holds the machine (card, torch, CUDA, cuDNN, TF32, Python), where posattn was imported from and
the files in which it differs from the checkout's (wheels older than the checkout), the tests'
counts and failures, and each stage's command, status, exit code, seconds and files. Exit status
0 when every stage passed.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from common import machine

import posattn

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# The tests that take the ``device`` fixture (tests/conftest.py), and the rest of their files.
TEST_FILES = ('tests/test_on_device.py', 'tests/test_functional.py', 'tests/test_attention.py',
              'tests/test_peripheral.py', 'tests/test_irpe.py', 'tests/test_pervit.py', 'tests/test_swap.py',
              'tests/test_gpu_readiness.py')
# A stage that cannot get this many seconds of the budget is skipped.
MIN_STAGE_S = 60
# Seconds for a whole run by default. On an H200 the stages before the compile took 260-300 s, which
# leaves the compile too little (pass --budget 600 for it); the CPU's tiny run takes 1-7 minutes.
DEFAULT_BUDGET_S = {'cuda': 450, 'cpu': 1800}


@dataclass
class Stage:
    """One subprocess of the kit: its name, its command (run from the repository root), its time
    limit and what it adds to the environment."""
    name: str
    command: List[str]
    limit_s: int
    env: Dict[str, str] = field(default_factory=dict)


@dataclass
class StageResult:
    """What became of a stage; ``files`` are those of the results folder that it wrote."""
    name: str
    command: List[str]
    status: str  # 'passed', 'failed', 'timed out' or 'skipped: ...'
    returncode: Optional[int] = None
    seconds: float = 0.0
    files: List[str] = field(default_factory=list)


def benchmark_sizes(device: torch.device, quick: bool) -> Dict[str, List[str]]:
    """The options of each benchmark: the GPU sizes the docs report on CUDA, tiny ones on the CPU."""
    if device.type == 'cpu':
        return {'attention': ['--batch', '2', '--dim', '32', '--heads', '2', '--grids', '4', '--repeat', '2'],
                'models': ['--size', '32', '--batch', '2', '--repeat', '1', '--warmup', '1'],
                'dense': ['--sizes', '64x96', '--window-size', '3', '--batch', '1', '--repeat', '1',
                          '--warmup', '1'],
                'compiled': ['--size', '32', '--batch', '2', '--repeat', '1', '--warmup', '1'],
                'native_resolution': ['--dim', '32', '--heads', '2', '--repeat', '1', '--batches', '8 images',
                                      '--phis', 'none', 'rpb', 'peg'],
                'naflex_swap': ['--dim', '32', '--depth', '1', '--heads', '2', '--images', '4', '--repeat', '1']}
    rounds = ['--repeat', '3', '--warmup', '1'] if quick else ['--repeat', '10', '--warmup', '3']
    return {'attention': ['--batch', '64', '--grids', '14', '28', '--repeat', '5' if quick else '15'],
            'models': ['--batch', '128', '256', *rounds],
            'dense': ['--sizes', '800x1344', '--batch', '2', '--repeat', '2' if quick else '3', '--warmup', '1'],
            'compiled': ['--batch', '128', '--repeat', '5', '--warmup', '2'],
            'native_resolution': ['--repeat', '5' if quick else '10'],
            'naflex_swap': ['--images', '64', '--repeat', '5' if quick else '10']}


def plan(device: torch.device, quick: bool, out: Path, tests: bool = True) -> List[Stage]:
    """The stages of a run, in order (module docstring); without ``tests``, the benchmarks alone."""
    python, sizes = sys.executable, benchmark_sizes(device, quick)
    slow_cpu = 10 if device.type == 'cpu' else 1  # time limits: the CPU is an order of magnitude slower
    marks = ['-m', 'not environment and not slow'] if quick else []
    stages = []
    if tests:  # importing posattn as the benchmarks do, from the installed package, not from the checkout
        stages.append(Stage('tests', [python, '-m', 'pytest', *TEST_FILES, '--device', str(device), '-p',
                                      'no:cacheprovider', f'--junitxml={out / f"tests-{device.type}.xml"}', *marks],
                            240 * slow_cpu, env={'PYTHONSAFEPATH': '1'}))
    common = ['--device', str(device), '--no-profile', '--out', str(out)]
    for script, limit in (('attention', 90), ('models', 150), ('dense', 120)):
        for dtype in ('fp32', 'bf16'):
            extra = ['--no-gmac'] if script == 'models' else []
            stages.append(Stage(f'{script} {dtype}', [python, str(HERE / f'{script}.py'), *common, '--dtype', dtype,
                                                      *sizes[script], *extra], limit * slow_cpu))
    for script, limit in (('native_resolution', 120), ('naflex_swap', 90)):  # images of many grids in one batch
        stages.append(Stage(f'{script.replace("_", " ")} bf16', [
            python, str(HERE / f'{script}.py'), '--device', str(device), '--out', str(out), '--dtype', 'bf16',
            *sizes[script]], limit * slow_cpu))
    if not quick:
        stages.append(Stage('compiled bf16', [python, str(HERE / 'models.py'), *common, '--dtype', 'bf16', '--compile',
                                              '--no-gmac', '--no-memory', *sizes['compiled']], 300 * slow_cpu))
    return stages


def junit_counts(junit_xml: Path) -> Optional[Dict[str, object]]:
    """Tests, passed, failed, errors, skipped and the failing tests' ids, from pytest's JUnit XML;
    None where pytest wrote none (or was stopped while writing it)."""
    try:
        root = ElementTree.parse(junit_xml).getroot()
    except (OSError, ElementTree.ParseError):
        return None
    suites = [root] if root.tag == 'testsuite' else list(root.iter('testsuite'))
    tests, failed, errors, skipped = (sum(int(suite.get(key, 0)) for suite in suites)
                                      for key in ('tests', 'failures', 'errors', 'skipped'))
    failing = [f'{case.get("classname")}::{case.get("name")}' for case in root.iter('testcase')
               if case.find('failure') is not None or case.find('error') is not None]
    return {'tests': tests, 'passed': tests - failed - errors - skipped, 'failed': failed, 'errors': errors,
            'skipped': skipped, 'failing': failing}


def modified_times(folder: Path) -> Dict[str, int]:
    return {path.name: path.stat().st_mtime_ns for path in folder.iterdir()}


def log_path(out: Path, stage_name: str) -> Path:
    return out / f'{stage_name.replace(" ", "-")}.log'


def run_stage(stage: Stage, out: Path, limit_s: float) -> StageResult:
    """Runs ``stage`` with its output in ``out/<name>.log``, killed with its process group after
    ``limit_s``; its files are those of ``out`` that it wrote."""
    before = modified_times(out)
    start = time.perf_counter()
    with open(log_path(out, stage.name), 'w') as log:
        process = subprocess.Popen(stage.command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                   env=dict(os.environ, **stage.env), start_new_session=True)
        try:
            returncode = process.wait(timeout=limit_s)
            status = 'passed' if returncode == 0 else 'failed'
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            returncode, status = process.wait(), 'timed out'
    after = modified_times(out)
    files = sorted(name for name, modified in after.items() if before.get(name) != modified)
    return StageResult(stage.name, stage.command, status, returncode, time.perf_counter() - start, files)


def differing_sources(installed: Path, checkout: Path) -> List[str]:
    """The .py files of a package that differ between an installed copy and the checkout's folder
    (those on one side only included): the tests come from the checkout, the package from the wheel."""
    def sources(root: Path) -> Dict[str, bytes]:
        return {path.relative_to(root).as_posix(): path.read_bytes() for path in root.rglob('*.py')}
    ours, theirs = sources(installed), sources(checkout)
    return sorted(name for name in ours.keys() | theirs.keys() if ours.get(name) != theirs.get(name))


def installed_version(distribution: str) -> Optional[str]:
    """The version of an installed distribution; None for a package imported from a source folder."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def tail(path: Path, lines: int = 15) -> str:
    return '\n'.join(path.read_text(errors='replace').splitlines()[-lines:]) if path.exists() else ''


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The options, checked; ``--budget`` filled in from the device where not given."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--device', type=torch.device, default=torch.device('cuda'))
    parser.add_argument('--out', type=Path, required=True, help='folder for the results (made if absent)')
    parser.add_argument('--quick', action='store_true',
                        help='no slow tests, fewer rounds, no torch.compile stage')
    parser.add_argument('--budget', type=float,
                        help='seconds for the whole run (default: 450 on cuda, 1800 on the CPU); each stage '
                             'is cut to what is left')
    parser.add_argument('--no-tests', dest='tests', action='store_false',
                        help='skip the tests: the benchmarks alone')
    args = parser.parse_args(argv)
    if args.device.type not in ('cpu', 'cuda'):
        parser.error(f'--device {args.device}: the kit runs on cpu or cuda')
    if args.device.type == 'cuda' and not torch.cuda.is_available():
        parser.error(f'--device {args.device}: torch {torch.__version__} sees no CUDA device')
    if args.budget is None:
        args.budget = DEFAULT_BUDGET_S[args.device.type]
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the stages of :func:`plan` within the budget, writing ``OUT/summary.json`` after each;
    returns the exit status."""
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()
    installed = Path(posattn.__file__).parent
    stale = differing_sources(installed, REPO / 'posattn')
    if stale:
        print(f'posattn in {installed} differs from the checkout in {", ".join(stale[:5])}'
              f'{" and more" if len(stale) > 5 else ""}: make gpu-wheels again', flush=True)
    summary = {'machine': machine(), 'posattn': {'version': installed_version('posattn'), 'path': str(installed),
                                                 'differs from the checkout in': stale},
               'options': {'device': str(args.device), 'quick': args.quick, 'budget s': args.budget},
               'stages': [], 'tests': None}
    start = time.perf_counter()
    stages = plan(args.device, args.quick, out, args.tests)
    for index, stage in enumerate(stages, 1):
        left = args.budget - (time.perf_counter() - start)
        if left < MIN_STAGE_S:
            result = StageResult(stage.name, stage.command, f'skipped: {left:.0f} s of the budget left')
        else:
            result = run_stage(stage, out, min(stage.limit_s, left))
        summary['stages'].append(asdict(result))
        if stage.name == 'tests':
            summary['tests'] = junit_counts(out / f'tests-{args.device.type}.xml')
        summary['seconds'] = time.perf_counter() - start
        (out / 'summary.json').write_text(json.dumps(summary, indent=2) + '\n')
        print(f'[{index}/{len(stages)}] {stage.name}: {result.status} in {result.seconds:.1f} s'
              + (f' -> {", ".join(result.files)}' if result.files else ''), flush=True)
        if result.status in ('failed', 'timed out'):
            print(tail(log_path(out, stage.name)), flush=True)
    failed = [s['name'] for s in summary['stages'] if s['status'] != 'passed']
    print(f'{len(stages) - len(failed)} of {len(stages)} stages passed in {summary["seconds"]:.0f} s; '
          f'results in {out}' + (f'; not passed: {", ".join(failed)}' if failed else ''))
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
