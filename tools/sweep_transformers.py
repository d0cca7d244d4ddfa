"""Sweep swap_attention over every vision model class of the installed Hugging Face transformers.

For each base model class whose input is ``pixel_values`` (transformers' ``MODEL_MAPPING_NAMES``),
in a child process (a new one after a crash), each within --timeout seconds: build it from its
default config, made small where the config has the usual size fields (a few layers, a narrow
width, small images), with random weights, in float64;
then ``swap_attention(model, phi='none')`` and compare the outputs with the model's own:

    exact    the swap changed no output (max |difference| <= 1e-10)
    refused  swap_attention raised, with the reason it gives
    WRONG    the swap ran and changed an output: a silent wrong answer (the sweep exits 1)
    skipped  the model could not be built or run here, with the error (not posattn's); one that
             builds but needs other inputs (video, image pairs, NaFlex batches) is still swapped,
             and refused where swap_attention refuses it

Prints a markdown table, writes it and a JSON file to --out:

    python tools/sweep_transformers.py --out sweep/        # about a minute on 2 CPU cores
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

CHILD = r'''
import copy, json, signal, sys, warnings
warnings.simplefilter('ignore')
import torch
import transformers
import posattn

SMALL = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128, image_size=64)


def small_config(cls):
    config = cls.config_class()
    for key, value in SMALL.items():
        if isinstance(getattr(config, key, None), int):
            setattr(config, key, value)
    for key in ('depths', 'num_heads'):
        if isinstance(getattr(config, key, None), (list, tuple)):
            setattr(config, key, [min(v, 2) for v in getattr(config, key)])
    return config


LARGEST = 60_000_000  # parameters: a larger model (a language model inside) is not built here


def built(cls, config):
    with torch.device('meta'):
        count = sum(p.numel() for p in cls(config).parameters())
    if count > LARGEST:
        raise MemoryError(f'{count / 1e6:.0f}M parameters with its smallest config here')
    torch.manual_seed(0)
    return cls(config).double().eval()


def ran(model, config):
    """An image batch for ``model`` and its output."""
    size = getattr(config, 'image_size', 224)
    size = size if isinstance(size, int) else 224
    channels = getattr(config, 'num_channels', 3)
    x = torch.randn(1, channels if isinstance(channels, int) else 3, size, size, dtype=torch.float64)
    with torch.no_grad():
        return x, model(x)


def first_error(error):
    return f'{type(error).__name__}: {(str(error).splitlines() or [""])[0][:160]}'


def tensors(output):
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in tensors(item)]
    return []


def sweep(cls):
    if any(hasattr(cls.config_class(), key) for key in ('text_config', 'language_config', 'qformer_config')):
        return dict(status='skipped', detail='takes text as well: not a vision model alone')
    model = x = error = None
    for config in (small_config(cls), cls.config_class()):  # small where the config allows it, else the default
        try:
            candidate = built(cls, config)
        except Exception as failure:
            error = error or failure
            continue
        model = model or candidate
        try:
            x, expected = ran(candidate, config)
        except Exception as failure:
            error = failure
            continue
        model = candidate
        break
    if model is None:
        return dict(status='skipped', detail=first_error(error))
    try:
        swapped = posattn.swap_attention(copy.deepcopy(model), phi='none')
    except (TypeError, ValueError) as failure:
        return dict(status='refused', detail=str(failure).split('; swap_attention knows')[0][:300])
    if x is None:
        return dict(status='skipped', detail=f'swapped; the model itself does not run on a plain image batch ({first_error(error)})')
    try:
        with torch.no_grad():
            got = swapped(x)
    except Exception as error:
        return dict(status='WRONG', detail=f'swapped, then {type(error).__name__}: {str(error).splitlines()[0][:200]}')
    difference = max(((g - e).abs().max().item() for g, e in zip(tensors(got), tensors(expected))), default=0.0)
    same = difference <= 1e-10 and len(tensors(got)) == len(tensors(expected))
    layers = sum(isinstance(m, posattn.swap.SwappedAttention) for m in swapped.modules())
    return dict(status='exact' if same else 'WRONG', detail=f'{layers} layers swapped, max |difference| {difference:.1e}')


def timed_out(signum, frame):
    raise TimeoutError


signal.signal(signal.SIGALRM, timed_out)
timeout = int(sys.argv[1])
for name in sys.argv[2:]:
    signal.alarm(timeout)
    try:
        row = sweep(getattr(transformers, name))
    except TimeoutError:
        row = dict(status='skipped', detail=f'not done in {timeout} s')
    finally:
        signal.alarm(0)
    print(json.dumps(dict(name=name, **row)), flush=True)
'''


def vision_model_classes() -> List[str]:
    """transformers' base model classes that take ``pixel_values``."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES
    names = []
    for name in dict.fromkeys(MODEL_MAPPING_NAMES.values()):
        if not isinstance(name, str):
            continue
        try:  # some need packages that are not installed (torchaudio, ...): left out
            if getattr(getattr(transformers, name), 'main_input_name', None) == 'pixel_values':
                names.append(name)
        except Exception:
            continue
    return names


def sweep(names: List[str], timeout: int) -> Iterator[Tuple[str, Dict[str, str]]]:
    """Each of ``names`` with its row, swept in one child process as long as it lives; a name the
    child died on is skipped with its exit, and the child starts again after it."""
    left = list(names)
    while left:
        child = subprocess.Popen([sys.executable, '-c', CHILD, str(timeout), *left], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        for line in child.stdout:
            if line.startswith('{'):
                row = json.loads(line)
                name = row.pop('name')
                left.remove(name)
                yield name, row
        child.wait()
        if left:  # the child died on left[0]
            error = child.stderr.read().strip().splitlines()[-1:] or [f'exit {child.returncode}']
            yield left.pop(0), dict(status='skipped', detail=f'the process ended: {error[0][:160]}')


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--out', type=Path, required=True, help='folder for sweep.md and sweep.json')
    parser.add_argument('--timeout', type=float, default=180, help='seconds per model (default 180)')
    parser.add_argument('--only', nargs='*', help='these class names alone')
    args = parser.parse_args()
    import transformers
    names = args.only or vision_model_classes()
    rows = {}
    for name, row in sweep(names, int(args.timeout)):
        rows[name] = row
        print(f'[{len(rows)}/{len(names)}] {name}: {row["status"]} ({row["detail"]})', flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    table = [f'transformers {transformers.__version__}, {len(rows)} vision model classes', '',
             '| model | result | detail |', '|---|---|---|']
    table += [f'| `{name}` | {row["status"]} | {row["detail"].replace("|", "/")} |' for name, row in rows.items()]
    (args.out / 'sweep.md').write_text('\n'.join(table) + '\n')
    (args.out / 'sweep.json').write_text(json.dumps(dict(transformers=transformers.__version__, rows=rows), indent=1))
    counts = {status: sum(row['status'] == status for row in rows.values())
              for status in ('exact', 'refused', 'WRONG', 'skipped')}
    print(', '.join(f'{count} {status}' for status, count in counts.items()))
    return 1 if counts['WRONG'] else 0


if __name__ == '__main__':
    sys.exit(main())
