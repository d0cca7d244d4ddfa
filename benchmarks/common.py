"""Measuring helpers shared by the benchmarks: interleaved timing, peak memory, the machine, tables,
JSON, and the release's Φp on any device.

Ratios are only meaningful when both sides run in the same process, on the same inputs, close
in time: :func:`time_interleaved` alternates the variants round by round and reports medians.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Sequence

import torch
from torch.profiler import ProfilerActivity, profile

RESULTS = Path(__file__).resolve().parent / 'results'


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep the memory a CPU run frees for its next allocations, as a long
    training process settles to. Otherwise whether a step's large buffers come back from the heap or
    from fresh pages (a page fault per 4 KiB) depends on the order of earlier allocations, and moves a
    variant's time by up to 20% from one run to the next. False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL('libc.so.6')
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    trim_threshold, top_pad, mmap_threshold = -1, -2, -3  # malloc.h's M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD
    return all(mallopt(option, value) == 1 for option, value in (
        (mmap_threshold, 1 << 30), (trim_threshold, 1 << 30), (top_pad, 256 << 20)))


def _sync(device: torch.device) -> None:
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def time_interleaved(fns: Mapping[str, Callable[[], object]], repeat: int = 20, warmup: int = 3,
                     device: torch.device = torch.device('cpu')) -> Dict[str, float]:
    """Median milliseconds of each callable, measured round-robin so drift hits all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def _allocation_events(prof) -> List[tuple]:
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        fields = event.extra_fields
        if type(fields).__name__ == '_ExtraFields_Allocation':
            events.append((event.start_time_ns, fields.alloc_size))
    return sorted(events)


def peak_memory_mb(fn: Callable[[], object], device: torch.device = torch.device('cpu')) -> float:
    """Peak bytes allocated by ``fn`` above what was allocated when it started, in MiB.

    CPU: the profiler's allocation events, summed in time order. CUDA: the allocator's peak.
    """
    fn()  # warm up lazily created state outside the measurement
    if device.type == 'cuda':
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    current = peak = 0
    for _, size in _allocation_events(prof):
        current += size
        peak = max(peak, current)
    return peak / 2 ** 20


def machine() -> Dict[str, object]:
    """torch, Python, the CPU and, where CUDA is available, the GPU, its CUDA and cuDNN versions and
    whether TF32 is allowed (it changes float32 speed and precision on the GPU)."""
    info = {'torch': torch.__version__, 'python': platform.python_version(),
            'threads': torch.get_num_threads(), 'processor': platform.processor() or platform.machine()}
    try:
        with open('/proc/cpuinfo') as cpuinfo:
            names = [line.split(':', 1)[1].strip() for line in cpuinfo if line.startswith('model name')]
        info['cpu'] = names[0] if names else None
    except OSError:
        pass
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update({'gpu': properties.name, 'gpu memory GiB': round(properties.total_memory / 2 ** 30, 1),
                     'compute capability': f'{properties.major}.{properties.minor}', 'cuda': torch.version.cuda,
                     'cudnn': torch.backends.cudnn.version(), 'tf32 matmul': torch.backends.cuda.matmul.allow_tf32,
                     'tf32 cudnn': torch.backends.cudnn.allow_tf32})
    return info


def print_table(rows: Sequence[Mapping[str, object]], columns: Sequence[str]) -> None:
    cells = [[_format(row.get(c, '')) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print('  '.join(c.ljust(w) for c, w in zip(columns, widths)))
    print('  '.join('-' * w for w in widths))
    for r in cells:
        print('  '.join(v.ljust(w) for v, w in zip(r, widths)))


def _format(value: object) -> str:
    if isinstance(value, float):
        return f'{value:.3g}' if abs(value) < 100 else f'{value:.0f}'
    if isinstance(value, bool):
        return 'yes' if value else 'NO'
    return str(value)


def add_out_argument(parser: argparse.ArgumentParser) -> None:
    """``--out FOLDER``: where a benchmark saves its JSON (``benchmarks/results`` by default)."""
    parser.add_argument('--out', type=Path, default=RESULTS,
                        help='folder for the JSON results (default: benchmarks/results)')


def save_json(name: str, payload: Mapping[str, object], folder: Path = RESULTS) -> Path:
    """``folder/name.json``: the machine (:func:`machine`) and ``payload``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f'{name}.json'
    path.write_text(json.dumps({'machine': machine(), **payload}, indent=2) + '\n')
    return path


# Where a step's time goes: each top-level op of the profile (an op called from Python, or one
# that autograd's engine runs for a backward node) counted whole, with what it calls, under the
# first category whose name part its name contains.
STEP_CATEGORIES = (
    ('peripheral Φp', ('LogPeripheralAttention',)),
    ('attention (q k^T, softmax, A v)', ('BiasedAttention', 'scaled_dot_product', 'ScaledDotProduct',
                                         'attention', 'Softmax', 'softmax', 'Bmm', 'bmm')),
    ('optimizer', ('Optimizer',)),
    ('convolutions', ('onvolution', 'conv')),
    ('linear layers', ('linear', 'Addmm', 'addmm', 'MmBackward', 'aten::mm', 'aten::matmul')),
    ('norms', ('norm', 'Norm')),
)


def step_profile(fn: Callable[[], object], steps: int = 2,
                 categories: Sequence = STEP_CATEGORIES) -> Dict[str, float]:
    """Milliseconds per call of ``fn`` by category (:data:`STEP_CATEGORIES`, then 'other':
    activations, element-wise ops, reshapes, copies), from the CPU profiler; 'total' is the sum.
    The profiler's own overhead is in every category, so compare the shares, not the totals,
    with untraced timings."""
    fn()  # warm up lazily created state outside the profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
    spent = {name: 0.0 for name, _ in categories}
    spent['other'] = 0.0
    for event in prof.events():
        if event.cpu_parent is not None:
            continue
        name = next((label for label, parts in categories if any(p in event.name for p in parts)), 'other')
        spent[name] += event.cpu_time_total / 1e3 / steps
    spent['total'] = sum(spent.values())
    return spent


def op_profile(fn: Callable[[], object], steps: int = 2, top: int = 12) -> List[Dict[str, object]]:
    """The ``top`` ops of a call of ``fn`` by their own time (the CPU profiler, what they call
    excluded): op, calls and milliseconds per call of ``fn``, share of the total."""
    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
    averages = prof.key_averages()
    total = sum(a.self_cpu_time_total for a in averages)
    ranked = sorted(averages, key=lambda a: a.self_cpu_time_total, reverse=True)[:top]
    return [{'op': a.key, 'calls': a.count / steps, 'self ms': a.self_cpu_time_total / 1e3 / steps,
             'share': a.self_cpu_time_total / total} for a in ranked]
