"""Writes the GPU table of docs/performance.md from the results of one ``gpu_check.py`` run.

    python benchmarks/report.py OUT                   # OUT: the folder of make gpu-check
    python benchmarks/report.py OUT --doc page.md     # another copy of the page

Everything between the page's markers :data:`BEGIN` and :data:`END` is replaced by: the card,
torch, CUDA, cuDNN and Python of the run, the tests' counts, the stages that did not pass, and one
table with a column per dtype (fp32, bf16): each ratio measured in one process, with the
milliseconds or MiB it divides. The same results give the same page, however often it runs. Only
the files that a stage which passed wrote are read; a measurement of another stage reads as that
stage's status (failed, timed out, skipped) or "not run". Results of a CPU run are refused unless
``--allow-cpu``: the section reports GPU figures.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / 'docs' / 'performance.md'
BEGIN = '<!-- gpu-table:begin (written by benchmarks/report.py) -->'
END = '<!-- gpu-table:end -->'
DTYPES = ('fp32', 'bf16')
NOT_RUN = 'not run'
# A stage that passed but whose JSON lacks the measurement (e.g. peak memory under --no-memory).
NOT_MEASURED = 'not measured'
# Failing tests named on the page; the rest are counted.
MAX_FAILING_SHOWN = 10

Results = Mapping[str, object]
# (measurement, setting) -> a cell from one benchmark's JSON, None where that JSON lacks it.
Row = Tuple[str, str, Callable[[Results], Optional[str]]]


def number(value: float) -> str:
    """Three significant digits, whole numbers from 100 on (the benchmarks' own tables)."""
    return f'{value:.3g}' if abs(value) < 100 else f'{value:.0f}'


def ratio(a: float, b: float, unit: str) -> str:
    return f'{number(a / b)}x ({number(a)} / {number(b)} {unit})'


def peaks(found: Sequence[Optional[Mapping[str, object]]]) -> Optional[str]:
    """'a / b / c MiB' of the found rows' peak memory; None where a row or its peak is missing."""
    if not all(found) or any(row['peak MiB'] is None for row in found):
        return None
    return ' / '.join(number(row['peak MiB']) for row in found) + ' MiB'


def find(rows: Sequence[Mapping[str, object]], **match: object) -> Optional[Mapping[str, object]]:
    """The first row with every key of ``match`` equal to its value."""
    return next((row for row in rows if all(row.get(key) == value for key, value in match.items())), None)


def attention_rows(grids: Sequence[str]) -> List[Row]:
    """benchmarks/attention.py: the layer against plain attention (SDPA without a bias), posattn's Φp
    against the release's, biased_attention against SDPA without a bias, at each grid."""
    def compared(comparison: str, a: str, b: str, grid: str) -> Callable[[Results], Optional[str]]:
        def cell(results: Results) -> Optional[str]:
            row = find(results['rows'], comparison=comparison, grid=grid, A=a, B=b)
            return row and ratio(row['A ms'], row['B ms'], 'ms')
        return cell
    rows = []
    for grid in grids:
        rows += [('attention layer fwd+bwd, peripheral / none (SDPA without a bias)', grid,
                  compared('layer fwd+bwd', 'peripheral', 'none', grid)),
                 ('Φp fwd+bwd, the release\'s computation / posattn\'s', grid,
                  compared('Φp fwd+bwd', 'release', 'posattn', grid)),
                 ('attention fwd+bwd with a bias gradient, `biased_attention` / SDPA without a bias', grid,
                  compared('attention fwd+bwd, bias with grad', 'biased_attention', 'SDPA, no bias', grid)),
                 ('eval forward in `cache_positions`, peripheral / none', grid,
                  compared('eval forward, cache_positions', 'peripheral', 'none', grid))]
    return rows


def models_rows(batches: Sequence[int]) -> List[Row]:
    """benchmarks/models.py: PerViT-T against DeiT-T and against the release's MPA, per batch."""
    def compared(task: str, model: str, baseline: str, batch: int) -> Callable:
        def cell(results: Results) -> Optional[str]:
            a = find(results['rows'], task=task, batch=batch, model=model)
            b = find(results['rows'], task=task, batch=batch, model=baseline)
            return a and b and ratio(a['ms'], b['ms'], 'ms')
        return cell

    def peak(batch: int) -> Callable:
        def cell(results: Results) -> Optional[str]:
            return peaks([find(results['rows'], task='train step', batch=batch, model=model)
                          for model in ('PerViT-T', 'DeiT-T', 'PerViT-T, release MPA')])
        return cell
    rows = []
    for batch in batches:
        rows += [('PerViT-T / DeiT-T, training step time', f'batch {batch}',
                  compared('train step', 'PerViT-T', 'DeiT-T', batch)),
                 ('PerViT-T / DeiT-T, inference time (Φp cached)', f'batch {batch}',
                  compared('inference', 'PerViT-T', 'DeiT-T', batch)),
                 ('the release\'s MPA / posattn, PerViT-T training step time', f'batch {batch}',
                  compared('train step', 'PerViT-T, release MPA', 'PerViT-T', batch)),
                 ('training step peak memory, PerViT-T / DeiT-T / release MPA', f'batch {batch}', peak(batch))]
    return rows


def compiled_rows(batches: Sequence[int]) -> List[Row]:
    """benchmarks/models.py --compile: compiled against eager training steps, and the first compile."""
    def compared(model: str, batch: int) -> Callable:
        def cell(results: Results) -> Optional[str]:
            compiled = find(results['rows'], task='train step', batch=batch, model=f'{model}, compiled')
            eager = find(results['rows'], task='train step', batch=batch, model=model)
            return compiled and eager and ratio(compiled['ms'], eager['ms'], 'ms')
        return cell

    def first_call(batch: int) -> Callable:
        def cell(results: Results) -> Optional[str]:
            found = [find(results['compile'], model=f'{model}, compiled', batch=batch)
                     for model in ('PerViT-T', 'DeiT-T')]
            if not all(found):
                return None
            return ' / '.join(number(row['first call s']) for row in found) + ' s'
        return cell
    rows = []
    for batch in batches:
        rows += [(f'{model} training step, `torch.compile` / eager', f'batch {batch}', compared(model, batch))
                 for model in ('PerViT-T', 'DeiT-T')]
        rows.append(('first compiled training step (compiling included), PerViT-T / DeiT-T', f'batch {batch}',
                     first_call(batch)))
    return rows


def dense_rows(sizes: Sequence[str]) -> List[Row]:
    """benchmarks/dense.py: the windowed + global PerViT-T backbone's time against Φp ``none``, and
    the peak memory of each variant."""
    def time_cell(size: str) -> Callable:
        def cell(results: Results) -> Optional[str]:
            a = find(results['backbone'], size=size, **{'Φp': 'peripheral'})
            b = find(results['backbone'], size=size, **{'Φp': 'none'})
            return a and b and ratio(a['fwd+bwd ms'], b['fwd+bwd ms'], 'ms')
        return cell

    def peak(size: str) -> Callable:
        def cell(results: Results) -> Optional[str]:
            return peaks([find(results['backbone'], size=size, **{'Φp': variant})
                          for variant in ('peripheral', 'none', 'peripheral, with_cp')])
        return cell
    rows = []
    for size in sizes:
        rows += [('dense backbone fwd+bwd, peripheral / none', size, time_cell(size)),
                 ('dense backbone peak memory, peripheral / none / peripheral with checkpointing', size, peak(size))]
    return rows


def device_type(summary: Results) -> str:
    """'cuda' or 'cpu': the device of the run's tests and benchmarks."""
    return summary['options']['device'].split(':')[0]


def load(folder: Path) -> Tuple[Results, Dict[str, Dict[str, Results]]]:
    """The run's summary and the JSON its passed stages wrote, as {kind: {dtype: results}}: kinds
    attention, models, dense and compiled (gpu_check.py's stage ``f'{kind} {dtype}'``)."""
    summary_path = folder / 'summary.json'
    if not summary_path.exists():
        raise SystemExit(f'{summary_path} is absent: give the folder that gpu_check.py (make gpu-check) wrote')
    summary = json.loads(summary_path.read_text())
    written = {name for stage in summary['stages'] if stage['status'] == 'passed' for name in stage['files']}
    results: Dict[str, Dict[str, Results]] = {}
    for kind in ('attention', 'models', 'dense', 'compiled'):
        for dtype in DTYPES:
            script, suffix = ('models', '-compiled') if kind == 'compiled' else (kind, '')
            name = f'{script}-{device_type(summary)}-{dtype}{suffix}.json'
            if name in written:
                results.setdefault(kind, {})[dtype] = json.loads((folder / name).read_text())
    return summary, results


def missing(summary: Results, kind: str, dtype: str) -> str:
    """What a cell of ``kind`` and ``dtype`` without a measurement says: its stage's status."""
    status = {stage['name']: stage['status'] for stage in summary['stages']}.get(f'{kind} {dtype}')
    if status is None:
        return NOT_RUN
    return NOT_MEASURED if status == 'passed' else status.split(':')[0]


def measured(results: Dict[str, Dict[str, Results]], kind: str, rows: str, key: str, default: Sequence) -> List:
    """The values of ``key`` in the ``rows`` of ``kind``'s runs, in order (e.g. attention.py's grids),
    or ``default`` where no run of that kind is there."""
    values = [row[key] for run in results.get(kind, {}).values() for row in run[rows]]
    return list(dict.fromkeys(values)) or list(default)


def table(summary: Results, results: Dict[str, Dict[str, Results]]) -> List[str]:
    """The markdown table: one line per measurement, one column per dtype."""
    sections = [('attention', attention_rows(measured(results, 'attention', 'rows', 'grid', ['14x14', '28x28']))),
                ('models', models_rows(measured(results, 'models', 'rows', 'batch', [128, 256]))),
                ('compiled', compiled_rows(measured(results, 'compiled', 'compile', 'batch', [128]))),
                ('dense', dense_rows(measured(results, 'dense', 'backbone', 'size', ['800x1344'])))]
    lines = ['| measurement | setting | ' + ' | '.join(DTYPES) + ' |', '|---|---|' + '---|' * len(DTYPES)]
    for kind, rows in sections:
        for measurement, setting, cell in rows:
            cells = []
            for dtype in DTYPES:
                run = results.get(kind, {}).get(dtype)
                cells.append((run is not None and cell(run)) or missing(summary, kind, dtype))
            lines.append(f'| {measurement} | {setting} | ' + ' | '.join(cells) + ' |')
    return lines


def header(summary: Results, results: Dict[str, Dict[str, Results]]) -> List[str]:
    """Where and how the figures were measured, the tests' counts and the stages that did not pass."""
    info = summary['machine']
    if device_type(summary) == 'cuda':
        where = (f'{info["gpu"]} ({info["gpu memory GiB"]} GiB, compute capability {info["compute capability"]}), '
                 f'torch {info["torch"]}, CUDA {info["cuda"]}, cuDNN {info["cudnn"]}, Python {info["python"]}; '
                 f'TF32 {"on" if info["tf32 matmul"] else "off"} in matmuls, '
                 f'{"on" if info["tf32 cudnn"] else "off"} in cuDNN')
    else:
        where = (f'the CPU ({info.get("cpu")}, {info["threads"]} threads), torch {info["torch"]}, '
                 f'Python {info["python"]}')
    quick = ', `QUICK=1` (fewer rounds, no slow tests, no compiled stage)' if summary['options']['quick'] else ''
    lines = [f'Measured by `make gpu-check` on {where}{quick}. fp32 and bf16 (autocast) columns come from '
             'separate runs of each script; each ratio compares two variants timed round-robin in one run.', '']
    tests = summary.get('tests')
    if tests:
        shown = tests['failing'][:MAX_FAILING_SHOWN]
        more = len(tests['failing']) - len(shown)
        failing = (f': {", ".join(shown)}' + (f' and {more} more (OUT/tests.log)' if more else '')) if shown else ''
        lines += [f'Device tests (`pytest --device {summary["options"]["device"]}`): {tests["passed"]} passed, '
                  f'{tests["failed"]} failed, {tests["errors"]} errors, {tests["skipped"]} skipped{failing}.', '']
    not_passed = [f'{stage["name"]} ({stage["status"]})' for stage in summary['stages'] if stage['status'] != 'passed']
    if not_passed:
        lines += [f'Stages that did not pass: {", ".join(not_passed)}.', '']
    return lines + table(summary, results)


def rewrite(doc: Path, lines: Sequence[str]) -> None:
    """Replaces what lies between :data:`BEGIN` and :data:`END` in ``doc`` by ``lines``."""
    text = doc.read_text()
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise SystemExit(f'{doc} needs one line {BEGIN} and, after it, one line {END}: the table goes between them')
    before, rest = text.split(BEGIN, 1)
    after = rest.split(END, 1)[1]
    doc.write_text(before + BEGIN + '\n' + '\n'.join(lines) + '\n' + END + after)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('results', type=Path, help='the folder gpu_check.py wrote (OUT of make gpu-check)')
    parser.add_argument('--doc', type=Path, default=DOC, help='the page to rewrite (default: docs/performance.md)')
    parser.add_argument('--allow-cpu', action='store_true', help='accept the results of a CPU run (to check the kit)')
    args = parser.parse_args(argv)
    summary, results = load(args.results)
    if device_type(summary) != 'cuda' and not args.allow_cpu:
        parser.error(f'{args.results} holds the results of a {summary["options"]["device"]} run, not a GPU\'s; '
                     'pass --allow-cpu to write them anyway')
    rewrite(args.doc, header(summary, results))
    print(f'rewrote the GPU table of {args.doc}')


if __name__ == '__main__':
    main(sys.argv[1:])
