"""Sweep swap_attention over every vision model class of the installed Hugging Face transformers.

For each base model class whose input is ``pixel_values`` (transformers' ``MODEL_MAPPING_NAMES``),
in a process of its own: build it from its default config, made small where the config has the
usual size fields (a few layers, a narrow width, small images), with random weights, in float64;
then ``swap_attention(model, phi='none')`` and compare the outputs with the model's own:

    exact    the swap changed no output (max |difference| <= 1e-10)
    refused  swap_attention raised, with the reason it gives
    WRONG    the swap ran and changed an output: a silent wrong answer (the sweep exits 1)
    skipped  the model could not be built or run here, with the error (not posattn's)

Prints a markdown table, writes it and a JSON file to --out:

    python tools/sweep_transformers.py --out sweep/        # minutes on a CPU
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

CHILD = r'''
import copy, json, sys, warnings
warnings.simplefilter('ignore')
import torch
import transformers
import posattn

name = sys.argv[1]
cls = getattr(transformers, name)
SMALL = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128, image_size=64)


def small_config():
    config = cls.config_class()
    for key, value in SMALL.items():
        if isinstance(getattr(config, key, None), int):
            setattr(config, key, value)
    for key in ('depths', 'num_heads'):
        if isinstance(getattr(config, key, None), (list, tuple)):
            setattr(config, key, [min(v, 2) for v in getattr(config, key)])
    return config


def built(config):
    torch.manual_seed(0)
    model = cls(config).double().eval()
    size = getattr(config, 'image_size', 224)
    size = size if isinstance(size, int) else 224
    channels = getattr(config, 'num_channels', 3)
    x = torch.randn(1, channels if isinstance(channels, int) else 3, size, size, dtype=torch.float64)
    with torch.no_grad():
        return model, x, model(x)


try:  # small where the config allows it, else as the default config has it
    model, x, expected = built(small_config())
except Exception:
    try:
        model, x, expected = built(cls.config_class())
    except Exception as error:
        print(json.dumps(dict(status='skipped', detail=f'{type(error).__name__}: {str(error).splitlines()[0][:160]}')))
        sys.exit(0)
try:
    swapped = posattn.swap_attention(copy.deepcopy(model), phi='none')
except (TypeError, ValueError) as error:
    print(json.dumps(dict(status='refused', detail=str(error).split('; swap_attention knows')[0][:300])))
    sys.exit(0)
def tensors(output):
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in tensors(item)]
    return []
try:
    with torch.no_grad():
        got = swapped(x)
    difference = max(((g - e).abs().max().item() for g, e in zip(tensors(got), tensors(expected))), default=0.0)
    status = 'exact' if difference <= 1e-10 and len(tensors(got)) == len(tensors(expected)) else 'WRONG'
    layers = sum(isinstance(m, posattn.swap.SwappedAttention) for m in swapped.modules())
    print(json.dumps(dict(status=status, detail=f'{layers} layers swapped, max |difference| {difference:.1e}')))
except Exception as error:
    print(json.dumps(dict(status='WRONG', detail=f'swapped, then {type(error).__name__}: {str(error).splitlines()[0][:200]}')))
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


def sweep_one(name: str, timeout: float) -> Dict[str, str]:
    try:
        result = subprocess.run([sys.executable, '-c', CHILD, name], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(status='skipped', detail=f'not done in {timeout:.0f} s')
    lines = [line for line in result.stdout.splitlines() if line.startswith('{')]
    if not lines:
        return dict(status='skipped', detail=f'exit {result.returncode}: {result.stderr.strip().splitlines()[-1:]}')
    return json.loads(lines[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--out', type=Path, required=True, help='folder for sweep.md and sweep.json')
    parser.add_argument('--timeout', type=float, default=180, help='seconds per model (default 180)')
    parser.add_argument('--only', nargs='*', help='these class names alone')
    args = parser.parse_args()
    import transformers
    names = args.only or vision_model_classes()
    rows = {}
    for index, name in enumerate(names, 1):
        rows[name] = sweep_one(name, args.timeout)
        print(f'[{index}/{len(names)}] {name}: {rows[name]["status"]} ({rows[name]["detail"]})', flush=True)
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
