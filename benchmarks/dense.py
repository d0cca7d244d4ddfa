"""Dense-prediction backbone speed and memory: windowed + global PerViT-T against the same with Φp ``none``.

    python benchmarks/dense.py                              # fp32, CPU, batch 2, 512x512 and 800x1344
    python benchmarks/dense.py --sizes 512x512 --repeat 2   # one size
    python benchmarks/dense.py --device cuda --dtype bf16

Side by side in one run, timed round-robin (median of ``--repeat`` rounds), in train mode (Φp
recomputed every forward, as while training), for each image size:
- backbone forward + backward (PerViT-T without its head, 14 x 14 windows, global blocks 3, 7,
  11, the last map out through the final norm: the model that the detection configs'
  ``PosattnPerViT`` wraps, built here without OpenMMLab): peripheral Φp; the same backbone with
  every Φp swapped for ``none`` (plain attention, the CPE convolutions kept, so the difference is
  Φp's cost); peripheral with gradient checkpointing (the configs' ``with_cp``);
- Φp alone, one layer (4 heads), on the window grid and on the whole grid of the global blocks:
  forward without grad (eval, before the per-grid cache holds it), forward + backward;
- peak memory of each (CPU: allocator events; CUDA: the allocator's peak);
- where the forward + backward of the peripheral and ``none`` backbones spend their time, by
  kind of op (the CPU profiler, a separate run: ``common.step_profile``).
Targets, peripheral / none backbone time: <= 1.4x at 512 x 512, <= 2.5x at 800 x 1344.
Prints the tables and saves ``dense-<device>-<dtype>.json`` in ``--out`` (``benchmarks/results``).
"""
from __future__ import annotations

import argparse
import copy
from typing import Callable, Dict, List, Tuple

import torch
from torch import nn

from common import add_out_argument, peak_memory_mb, print_table, save_json, step_profile, time_interleaved

import posattn
from posattn.models.pervit import PerViT
from posattn.phi.peripheral import PeripheralPhi

DTYPES = {'fp32': torch.float32, 'bf16': torch.bfloat16}
STEM_STRIDE = 16
# Backbone fwd+bwd time, peripheral / none, by image size.
TARGETS = {(512, 512): 1.4, (800, 1344): 2.5}


def image_size(text: str) -> Tuple[int, int]:
    height, _, width = text.partition('x')
    try:
        return int(height), int(width)
    except ValueError:
        raise argparse.ArgumentTypeError(f'image size {text!r} is not HEIGHTxWIDTH, e.g. 800x1344') from None


def backbones(args) -> Dict[str, PerViT]:
    """The backbone with peripheral Φp, with every Φp swapped for ``none``, and with gradient
    checkpointing; the same weights."""
    torch.manual_seed(0)
    peripheral = posattn.create_model('pervit_tiny', num_classes=0, global_pool='', window_size=args.window_size,
                                      global_blocks=tuple(args.global_blocks))
    plain = copy.deepcopy(peripheral)
    for block in plain.blocks:
        block.attn.phi = posattn.build_phi('none')
    checkpointed = copy.deepcopy(peripheral)
    checkpointed.set_grad_checkpointing(True)
    return {'peripheral': peripheral, 'none': plain, 'peripheral, with_cp': checkpointed}


def forward_backward(backbone: PerViT, images: torch.Tensor, autocast) -> Callable[[], None]:
    backbone.train()

    def step():
        with autocast:
            feature_map = backbone.forward_features(images)  # (B, C, H/16, W/16)
        feature_map.float().mean().backward()
        backbone.zero_grad(set_to_none=True)
    return step


def phi_steps(phi: PeripheralPhi, embedding: nn.Module, height: int, width: int) -> Dict[str, Callable[[], None]]:
    tokens = height * width
    upstream = torch.randn(phi.num_heads, tokens, tokens, device=phi.proj1_weight.device)

    def forward():
        with torch.no_grad():
            phi.log_position_attention(height, width, embedding)

    def forward_backward():
        phi.log_position_attention(height, width, embedding).backward(upstream)
        phi.zero_grad(set_to_none=True)
    return {'forward (eval)': forward, 'forward + backward': forward_backward}


def backbone_rows(args, size: Tuple[int, int], models: Dict[str, PerViT], autocast) -> List[Dict[str, object]]:
    images = torch.randn(args.batch, 3, *size, device=args.device)
    fns = {name: forward_backward(model, images, autocast) for name, model in models.items()}
    times = time_interleaved(fns, repeat=args.repeat, warmup=args.warmup, device=args.device)
    rows = []
    limit = TARGETS.get(tuple(size))
    for name, fn in fns.items():
        ratio = times[name] / times['none']
        checked = name == 'peripheral' and limit is not None
        rows.append({'size': f'{size[0]}x{size[1]}', 'batch': args.batch, 'Φp': name, 'fwd+bwd ms': times[name],
                     'peak MiB': peak_memory_mb(fn, args.device) if args.memory else None,
                     'vs none': ratio, 'target': f'<= {limit}x' if checked else '',
                     'met': ratio <= limit if checked else ''})
    return rows


def profile_rows(args, size: Tuple[int, int], models: Dict[str, PerViT], autocast) -> List[Dict[str, object]]:
    """Milliseconds of the peripheral and ``none`` backbones' forward + backward by kind of op."""
    images = torch.randn(args.batch, 3, *size, device=args.device)
    spent = {name: step_profile(forward_backward(models[name], images, autocast), steps=1)
             for name in ('peripheral', 'none')}
    difference = spent['peripheral']['total'] - spent['none']['total']
    return [{'size': f'{size[0]}x{size[1]}', 'ops': category, 'peripheral ms': spent['peripheral'][category],
             'none ms': spent['none'][category],
             'share of the difference': (spent['peripheral'][category] - spent['none'][category]) / difference}
            for category in spent['peripheral']]


def phi_rows(args, size: Tuple[int, int], phi: PeripheralPhi, embedding: nn.Module) -> List[Dict[str, object]]:
    grid = (-(-size[0] // STEM_STRIDE), -(-size[1] // STEM_STRIDE))
    rows = []
    for label, (height, width) in (('window', (args.window_size,) * 2), ('global', grid)):
        fns = phi_steps(phi, embedding, height, width)
        times = time_interleaved(fns, repeat=args.repeat, warmup=args.warmup, device=args.device)
        for task, fn in fns.items():
            rows.append({'size': f'{size[0]}x{size[1]}', 'layer': label, 'grid': f'{height}x{width}',
                         'Φp values M': phi.num_heads * (height * width) ** 2 / 1e6, 'task': task, 'ms': times[task],
                         'peak MiB': peak_memory_mb(fn, args.device) if args.memory else None})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--device', type=torch.device, default=torch.device('cpu'))
    parser.add_argument('--dtype', choices=sorted(DTYPES), default='fp32')
    parser.add_argument('--sizes', type=image_size, nargs='+', default=[(512, 512), (800, 1344)],
                        help='image sizes HEIGHTxWIDTH')
    parser.add_argument('--batch', type=int, default=2)
    parser.add_argument('--window-size', type=int, default=14)
    parser.add_argument('--global-blocks', type=int, nargs='*', default=[3, 7, 11])
    parser.add_argument('--repeat', type=int, default=3)
    parser.add_argument('--warmup', type=int, default=1)
    parser.add_argument('--no-memory', dest='memory', action='store_false', help='skip peak-memory runs')
    parser.add_argument('--no-profile', dest='profile', action='store_false',
                        help='skip the profile of where the backbones spend their time')
    add_out_argument(parser)
    args = parser.parse_args()
    autocast = torch.autocast(args.device.type, dtype=DTYPES[args.dtype], enabled=args.dtype != 'fp32')
    models = {name: model.to(args.device) for name, model in backbones(args).items()}
    phi = models['peripheral'].blocks[args.global_blocks[0] if args.global_blocks else 0].attn.phi
    rows, phis, profiles = [], [], []
    for size in args.sizes:
        rows += backbone_rows(args, size, models, autocast)
        phis += phi_rows(args, size, phi, models['peripheral'].distance_embedding)
        if args.profile:
            profiles += profile_rows(args, size, models, autocast)
    print(f'PerViT-T backbone, {args.window_size}x{args.window_size} windows, global blocks {args.global_blocks}, '
          f'{args.dtype} on {args.device}, {torch.get_num_threads()} threads, torch {torch.__version__}, '
          f'median of {args.repeat} rounds')
    print_table(rows, ['size', 'batch', 'Φp', 'fwd+bwd ms', 'peak MiB', 'vs none', 'target', 'met'])
    print()
    print(f'Φp of one layer ({phi.num_heads} heads), no batch dimension')
    print_table(phis, ['size', 'layer', 'grid', 'Φp values M', 'task', 'ms', 'peak MiB'])
    if profiles:
        print()
        print('Where the backbone forward + backward goes (CPU profiler, ms; its overhead included):')
        print_table(profiles, ['size', 'ops', 'peripheral ms', 'none ms', 'share of the difference'])
    path = save_json(f'dense-{args.device.type}-{args.dtype}', {
        'settings': {'sizes': [f'{h}x{w}' for h, w in args.sizes], 'batch': args.batch, 'dtype': args.dtype,
                     'device': str(args.device), 'window_size': args.window_size,
                     'global_blocks': args.global_blocks, 'repeat': args.repeat, 'warmup': args.warmup,
                     'profile': args.profile, 'memory': args.memory},
        'backbone': rows, 'phi': phis, 'profile': profiles}, folder=args.out)
    print(f'saved {path}')


if __name__ == '__main__':
    main()
