"""Model-level speed and memory: PerViT-T against DeiT-T and against the release's MPA layer.

    python benchmarks/models.py                       # fp32, CPU, batches 8 and 32, 224 x 224
    python benchmarks/models.py --quick               # batch 8, few rounds: checks that it runs
    python benchmarks/models.py --device cuda --dtype bf16 --batch 128 256 --no-profile --no-gmac

Side by side in one run, timed round-robin (median of ``--repeat`` rounds):
- training step (forward, cross-entropy, backward, AdamW step), images/s: PerViT-T, DeiT-T
  (``create_model('vit_tiny', phi='none')``, the same width class), and PerViT-T with every
  attention layer replaced by :class:`ReleaseMPA`, the release's MPA written the straightforward
  way (Φp from the full distance tensor through conv / GroupNorm for every query, then
  ``normalize(exp(S - max S) * Φp, p=1) V``);
- inference (eval, no grad) of the same models, inside ``posattn.cache_positions`` (Φp computed
  on the first call, then served again; ``benchmarks/eval_cache.py`` measures it without), the
  release's layer recomputing it on every call, as the release does;
- peak memory of each (CPU: allocator events; CUDA: the allocator's peak).
Targets: PerViT-T step <= 1.6x DeiT-T's at batch 8 and <= 1.5x at batch 32 (other batches:
1.5x), posattn >= 1.5x faster than the release's layer, inference <= 1.15x DeiT-T's. Then where
the training steps of PerViT-T and DeiT-T spend their time, by kind of op (the CPU profiler, a
separate run: ``common.step_profile``). Then GMAC per image of PerViT-T/S/M and DeiT-T: as the paper
counts them (no Φp, and no q k^T or A v products: that gives its 1.6 / 4.4 / 9.0), with the
attention products but Φp cached, with Φp counted as posattn computes it, and as the release does.
With ``--compile``, the training steps of PerViT-T and DeiT-T compiled by ``torch.compile``
(Inductor, whole graphs, no compile cache) join the same rounds, each against its eager step, and
the first call of each (compiling, then one step) is timed on its own.
Prints the tables and saves ``models-<device>-<dtype>[-compiled].json`` in ``--out``
(``benchmarks/results``).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import time
from typing import Any, Callable, Dict, List

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from common import (add_out_argument, peak_memory_mb, print_table, save_json, step_profile,
                    time_interleaved)

import posattn
from posattn import reference
from posattn._compat import cpu_flash_attention_op
from posattn.grid import TokenGrid
from posattn.phi.peripheral import PeripheralPhi

DTYPES = {'fp32': torch.float32, 'bf16': torch.bfloat16}
STEM_STRIDE = 16
# PerViT-T / DeiT-T training step time, by batch.
STEP_TARGETS = {8: 1.6, 32: 1.5}


def _sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


# FlopCounterMode knows the CUDA SDPA kernels; the CPU one costs the same.
FLOP_MAPPING = {cpu_flash_attention_op(): _sdpa_flops}


class ReleaseMPA(nn.Module):
    """A posattn peripheral layer computed as the release computes it, for one fixed grid:
    Φp recomputed on every call, then ``normalize(exp(S - max S) * Φp, p=1) V`` and the projection
    (``posattn.reference``), with the layer's own parameters."""

    def __init__(self, layer: posattn.Attention, height: int, width: int):
        super().__init__()
        self.layer, self.height, self.width = layer, height, width

    @property
    def phi(self) -> PeripheralPhi:
        """The layer's Φp, which reads the model's distance embedding given with each call."""
        return self.layer.phi

    def taking(self, offered: Dict[str, Any]) -> Dict[str, Any]:
        """What the block offers its attention: this one reads the model's distance embedding."""
        return offered

    def forward(self, x: torch.Tensor, hw: TokenGrid, distance_embedding: nn.Module) -> torch.Tensor:
        layer = self.layer
        phi = reference.peripheral_position_attention(self.height, self.width, layer.phi.weights(distance_embedding))
        return reference.peripheral_attention(x, layer.qkv.weight, layer.qkv.bias, layer.proj.weight,
                                              layer.proj.bias, layer.num_heads, phi)


def with_release_mpa(model: nn.Module, image_size: int) -> nn.Module:
    """A copy of a PerViT whose attention layers are :class:`ReleaseMPA` (224 x 224 -> 14 x 14 grid)."""
    model = copy.deepcopy(model)
    side = -(-image_size // STEM_STRIDE)
    for block in model.blocks:
        block.attn = ReleaseMPA(block.attn, side, side)
    return model


def train_step(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, autocast) -> Callable[[], None]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05)
    model.train()

    def step():
        with autocast:
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def compiled(model: nn.Module) -> nn.Module:
    """``torch.compile`` of a copy of ``model``, one graph, compiled afresh (no cached kernels)."""
    return torch.compile(copy.deepcopy(model), fullgraph=True, options={'fx_graph_cache': False})


def first_call_s(fn: Callable[[], None], device: torch.device) -> float:
    """Seconds of ``fn``'s first call: for a compiled step, the compilation and one step."""
    start = time.perf_counter()
    fn()
    if device.type == 'cuda':
        torch.cuda.synchronize()
    return time.perf_counter() - start


def inference(model: nn.Module, images: torch.Tensor, autocast) -> Callable[[], None]:
    model = copy.deepcopy(model).eval()
    cache = contextlib.ExitStack()
    cache.enter_context(posattn.cache_positions(model))  # for the benchmark's lifetime

    def forward():
        with torch.no_grad(), autocast:
            model(images)
    forward.cache = cache  # kept alive with the closure
    return forward


def gmac(model: nn.Module, images: torch.Tensor, phi_counted: bool, attention_counted: bool = True) -> float:
    """Multiply-accumulates of one forward per image, in G. Φp left out: eval with Φp cached;
    counted: train mode, where every layer computes it (independent of the batch). Without
    ``attention_counted``, q k^T and A v are left out too, which reproduces the paper's figures."""
    model.train(phi_counted)
    with torch.no_grad(), posattn.cache_positions(model):
        model(images)  # fills the position cache
        with FlopCounterMode(display=False, custom_mapping=FLOP_MAPPING if attention_counted else {}) as counter:
            model(images)
    model.eval()
    return counter.get_total_flops() / 2 / images.shape[0] / 1e9


def release_phi_gmac(num_heads: int, side: int, num_layers: int) -> float:
    weights = PeripheralPhi(num_heads).weights()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        reference.peripheral_position_attention(side, side, weights)
    return counter.get_total_flops() / 2 * num_layers / 1e9


def speed_rows(args, compile_rows: List[Dict[str, object]]) -> List[Dict[str, object]]:
    """Training step and inference rows; with ``args.compile``, the compiled training steps too,
    their first calls recorded in ``compile_rows``."""
    device, dtype, size = args.device, DTYPES[args.dtype], args.size
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    torch.manual_seed(0)
    pervit = posattn.create_model('pervit_tiny').to(device)
    models = {'PerViT-T': pervit, 'DeiT-T': posattn.create_model('vit_tiny', phi='none').to(device),
              'PerViT-T, release MPA': with_release_mpa(pervit, size).to(device)}
    rows = []
    for batch in args.batch:
        images = torch.randn(batch, 3, size, size, device=device)
        labels = torch.randint(0, 1000, (batch,), device=device)
        for task, make in (('train step', lambda m: train_step(copy.deepcopy(m), images, labels, autocast)),
                           ('inference', lambda m: inference(m, images, autocast))):
            fns = {name: make(model) for name, model in models.items()}
            if args.compile and task == 'train step':
                for name in ('PerViT-T', 'DeiT-T'):
                    torch.compiler.reset()
                    step = train_step(compiled(models[name]), images, labels, autocast)
                    compile_rows.append({'model': f'{name}, compiled', 'batch': batch,
                                         'first call s': first_call_s(step, device)})
                    fns[f'{name}, compiled'] = step
            times = time_interleaved(fns, repeat=args.repeat, warmup=args.warmup, device=device)
            for name, fn in fns.items():
                rows.append({'task': task, 'batch': batch, 'model': name, 'ms': times[name],
                             'images/s': batch / times[name] * 1e3,
                             'peak MiB': peak_memory_mb(fn, device) if args.memory else None,
                             'vs PerViT-T': times[name] / times['PerViT-T']})
    return rows


def check_targets(rows: List[Dict[str, object]]) -> List[Dict[str, object]]:
    checks = []
    ms = {(r['task'], r['batch'], r['model']): r['ms'] for r in rows}
    for (task, batch, model), value in ms.items():
        if model != 'PerViT-T':
            continue
        deit, release = ms[(task, batch, 'DeiT-T')], ms[(task, batch, 'PerViT-T, release MPA')]
        if task == 'train step':
            limit = STEP_TARGETS.get(batch, 1.5)
            checks.append({'check': 'PerViT-T / DeiT-T step time', 'batch': batch, 'ratio': value / deit,
                           'target': f'<= {limit}', 'met': value / deit <= limit})
            checks.append({'check': 'release MPA / posattn step time', 'batch': batch, 'ratio': release / value,
                           'target': '>= 1.5', 'met': release / value >= 1.5})
            if (task, batch, 'PerViT-T, compiled') in ms:
                ratio = ms[(task, batch, 'PerViT-T, compiled')] / ms[(task, batch, 'DeiT-T, compiled')]
                checks.append({'check': 'PerViT-T / DeiT-T step time, both compiled', 'batch': batch, 'ratio': ratio,
                               'target': f'<= {limit}', 'met': ratio <= limit})
                for name in ('PerViT-T', 'DeiT-T'):
                    checks.append({'check': f'{name} compiled / eager step time', 'batch': batch,
                                   'ratio': ms[(task, batch, f'{name}, compiled')] / ms[(task, batch, name)],
                                   'target': 'report', 'met': ''})
        else:
            checks.append({'check': 'PerViT-T / DeiT-T inference time', 'batch': batch, 'ratio': value / deit,
                           'target': '<= 1.15', 'met': value / deit <= 1.15})
    return checks


def profile_rows(args) -> List[Dict[str, object]]:
    """Milliseconds per training step of PerViT-T and DeiT-T by kind of op, at each batch."""
    device, dtype, size = args.device, DTYPES[args.dtype], args.size
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    rows = []
    for batch in args.batch:
        torch.manual_seed(0)
        images = torch.randn(batch, 3, size, size, device=device)
        labels = torch.randint(0, 1000, (batch,), device=device)
        spent = {name: step_profile(train_step(posattn.create_model(model, **kwargs).to(device), images, labels,
                                               autocast))
                 for name, (model, kwargs) in {'PerViT-T': ('pervit_tiny', {}),
                                               'DeiT-T': ('vit_tiny', {'phi': 'none'})}.items()}
        for category in spent['PerViT-T']:
            pervit, deit = spent['PerViT-T'][category], spent['DeiT-T'][category]
            rows.append({'batch': batch, 'ops': category, 'PerViT-T ms': pervit, 'DeiT-T ms': deit,
                         'difference ms': pervit - deit,
                         'share of the difference': (pervit - deit) / (spent['PerViT-T']['total']
                                                                       - spent['DeiT-T']['total'])})
    return rows


def check_compile(compile_rows: List[Dict[str, object]]) -> List[Dict[str, object]]:
    """The first compile of PerViT-T's training step (with its first step) within two minutes."""
    return [{'check': 'PerViT-T first compiled step, s', 'batch': row['batch'], 'ratio': row['first call s'],
             'target': '<= 120', 'met': row['first call s'] <= 120}
            for row in compile_rows if row['model'] == 'PerViT-T, compiled']


def gmac_rows(size: int) -> List[Dict[str, object]]:
    images = torch.randn(1, 3, size, size)
    side = -(-size // STEM_STRIDE)
    rows = []
    for name in ('pervit_tiny', 'pervit_small', 'pervit_medium', 'vit_tiny'):
        model = posattn.create_model(name, **({'phi': 'none'} if name == 'vit_tiny' else {}))
        row = {'model': name, 'params M': sum(p.numel() for p in model.parameters()) / 1e6,
               'GMAC, Φp cached': gmac(model, images, phi_counted=False),
               'GMAC as the paper counts': gmac(model, images, phi_counted=False, attention_counted=False)}
        if name.startswith('pervit'):
            row['GMAC, Φp by posattn'] = gmac(model, images, phi_counted=True)
            row['Φp by the release, GMAC'] = release_phi_gmac(model.blocks[0].attn.num_heads, side, len(model.blocks))
            row['GMAC, Φp by the release'] = row['GMAC, Φp cached'] + row['Φp by the release, GMAC']
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--device', type=torch.device, default=torch.device('cpu'))
    parser.add_argument('--dtype', choices=sorted(DTYPES), default='fp32')
    parser.add_argument('--batch', type=int, nargs='+', default=[8, 32])
    parser.add_argument('--size', type=int, default=224)
    parser.add_argument('--repeat', type=int, default=10)
    parser.add_argument('--warmup', type=int, default=2)
    parser.add_argument('--no-memory', dest='memory', action='store_false', help='skip peak-memory runs')
    parser.add_argument('--quick', action='store_true', help='batch 8, 3 rounds, 1 warm-up: checks that it runs')
    parser.add_argument('--compile', action='store_true',
                        help='add the training steps of PerViT-T and DeiT-T compiled by torch.compile')
    parser.add_argument('--no-profile', dest='profile', action='store_false',
                        help='skip the profile of where the training steps spend their time')
    parser.add_argument('--no-gmac', dest='gmac', action='store_false',
                        help='skip the GMAC count of PerViT-T/S/M and DeiT-T (on the CPU, whatever --device)')
    add_out_argument(parser)
    args = parser.parse_args()
    if args.quick:
        args.batch, args.repeat, args.warmup = [8], 3, 1
    compile_rows: List[Dict[str, object]] = []
    rows = speed_rows(args, compile_rows)
    checks = check_targets(rows) + check_compile(compile_rows)
    macs = gmac_rows(args.size) if args.gmac else []
    profiles = profile_rows(args) if args.profile else []
    print(f'{args.size}x{args.size} {args.dtype} on {args.device}, {torch.get_num_threads()} threads, '
          f'torch {torch.__version__}, median of {args.repeat} rounds')
    print_table(rows, ['task', 'batch', 'model', 'ms', 'images/s', 'peak MiB', 'vs PerViT-T'])
    print()
    print_table(checks, ['check', 'batch', 'ratio', 'target', 'met'])
    print()
    if profiles:
        print('Where the training step goes (CPU profiler, ms per step; its overhead included):')
        print_table(profiles, ['batch', 'ops', 'PerViT-T ms', 'DeiT-T ms', 'difference ms', 'share of the difference'])
        print()
    if compile_rows:
        print_table(compile_rows, ['model', 'batch', 'first call s'])
        print()
    if macs:
        print_table(macs, ['model', 'params M', 'GMAC as the paper counts', 'GMAC, Φp cached', 'GMAC, Φp by posattn',
                           'GMAC, Φp by the release', 'Φp by the release, GMAC'])
    path = save_json(f'models-{args.device.type}-{args.dtype}' + ('-compiled' if args.compile else ''), {
        'settings': {'batch': args.batch, 'size': args.size, 'dtype': args.dtype, 'device': str(args.device),
                     'repeat': args.repeat, 'warmup': args.warmup, 'quick': args.quick, 'compile': args.compile,
                     'profile': args.profile, 'memory': args.memory},
        'rows': rows, 'checks': checks, 'compile': compile_rows, 'gmac': macs,
        'step profile': profiles}, folder=args.out)
    print(f'saved {path}')


if __name__ == '__main__':
    main()
