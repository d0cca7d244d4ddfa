"""Evaluation of PerViT-T with the Φp computed on every call, and inside ``posattn.cache_positions``:
speed at 224 x 224, and the memory a model still holds after evaluating at several sizes.

    python benchmarks/eval_cache.py                          # CPU, fp32
    python benchmarks/eval_cache.py --baseline ../other-checkout   # the same, also for another copy of posattn

Each measurement runs in a fresh process (``--measure``), so resident memory is the model's own:
- forward ms at batch 1 and 8 (median of ``--repeat``, after two warm-up calls);
- after one eval forward at each of 256, 512, 768 and 1024 px (batch 1): the bytes still held in
  storages of 256 KiB or more that are not parameters (posattn's caches: the position cache,
  grid constants), and the process's resident memory.
With ``--baseline PATH`` the same measurements run with the posattn found at PATH (its own
caches, whatever they are), in the same run, for a side-by-side comparison.
Prints a table and saves ``benchmarks/results/eval-cache-cpu-fp32.json``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import print_table, save_json

SIZES = (256, 512, 768, 1024)
HERE = Path(__file__).resolve().parent


def resident_mib() -> float:
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith('VmRSS:'):
                return int(line.split()[1]) / 1024
    return float('nan')


def measure(cached: bool, repeat: int) -> dict:
    import torch

    import posattn
    torch.manual_seed(0)
    model = posattn.create_model('pervit_tiny').eval()
    scope = posattn.cache_positions(model) if cached else contextlib.nullcontext()
    result = {}
    with scope, torch.no_grad():
        for batch in (1, 8):
            images = torch.randn(batch, 3, 224, 224)
            for _ in range(2):
                model(images)
            times = []
            for _ in range(repeat):
                start = time.perf_counter()
                model(images)
                times.append((time.perf_counter() - start) * 1e3)
            result[f'batch {batch} ms'] = statistics.median(times)
        for size in SIZES:
            model(torch.randn(1, 3, size, size))
        import gc
        gc.collect()
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in gc.get_objects()
                    if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter)
                    and t.untyped_storage().nbytes() >= 1 << 18}  # views counted once, with their storage
        held = sum(storages.values())
        result['kept after 256-1024 px (storages of 256 KiB+), MiB'] = held / 2 ** 20
        result['resident after 256-1024 px, MiB'] = resident_mib()
    return result


def run_in_subprocess(posattn_root: Path, cached: bool, repeat: int) -> dict:
    env = dict(os.environ, PYTHONPATH=f'{posattn_root}{os.pathsep}{HERE}')
    command = [sys.executable, str(HERE / 'eval_cache.py'), '--measure', '--repeat', str(repeat)]
    if cached:
        command.append('--cached')
    output = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--repeat', type=int, default=10)
    parser.add_argument('--baseline', type=Path, help='another checkout of posattn, measured alongside')
    parser.add_argument('--measure', action='store_true', help=argparse.SUPPRESS)
    parser.add_argument('--cached', action='store_true', help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.cached, args.repeat)))
        return
    root = HERE.parent
    rows = [{'posattn': 'this checkout', 'Φp': 'each call', **run_in_subprocess(root, False, args.repeat)},
            {'posattn': 'this checkout', 'Φp': 'cache_positions', **run_in_subprocess(root, True, args.repeat)}]
    if args.baseline is not None:
        rows.append({'posattn': f'baseline ({args.baseline.name})', 'Φp': 'its default',
                     **run_in_subprocess(args.baseline.resolve(), False, args.repeat)})
    print_table(rows, list(rows[0]))
    save_json('eval-cache-cpu-fp32', {'rows': rows})


if __name__ == '__main__':
    main()
