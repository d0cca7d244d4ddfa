"""Speed and memory of the attention layer and its Φp, side by side in one run.

    python benchmarks/attention.py                     # fp32, CPU, B=8, dim 128, 4 heads
    python benchmarks/attention.py --device cuda --dtype bf16 --batch 64

Then, for each grid, where the time goes (the CPU profiler, a separate run): the peripheral and
``none`` layers' fwd+bwd by kind of op (``common.step_profile``), and the ops of posattn's Φp
fwd+bwd that take the most time (``common.op_profile``).

Prints the tables and saves ``benchmarks/results/attention-<device>-<dtype>.json``. Each ratio
compares two variants timed round-robin in this process (median of ``--repeat`` rounds).
The baseline of the Φp rows is the release's computation as ``posattn.reference`` states it (the
full distance embedding, all 4 * heads channels through PP1 for every query, instance norms).
"""
from __future__ import annotations

import argparse
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from common import (add_out_argument, op_profile, peak_memory_mb, print_table, save_json,
                    step_profile, time_interleaved)

from posattn import Attention, TokenGrid, cache_positions, reference
from posattn.functional import biased_attention

DTYPES = {'fp32': torch.float32, 'bf16': torch.bfloat16}


def fwd_bwd(forward: Callable[[], torch.Tensor], upstream: torch.Tensor) -> Callable[[], None]:
    def step():
        forward().backward(upstream)
    return step


def layer_steps(layers: Dict[str, Attention], grid: TokenGrid, args, autocast) -> Dict[str, Callable[[], None]]:
    """fwd+bwd of each layer on the same random (B, N, dim) input and upstream gradient."""
    x = torch.randn(args.batch, grid.num_tokens, args.dim, device=args.device, requires_grad=True)
    upstream = torch.randn(args.batch, grid.num_tokens, args.dim, device=args.device)

    def step(layer):
        def forward():
            with autocast:
                return layer(x, grid)
        return fwd_bwd(forward, upstream)
    return {name: step(layer) for name, layer in layers.items()}


def compare(name: str, grid: int, variants: Dict[str, Callable[[], None]], target: str,
            check: Optional[Callable[[Dict[str, object]], bool]], args, memory: bool = False) -> Dict[str, object]:
    a, b = variants
    times = time_interleaved(variants, repeat=args.repeat, device=args.device)
    row = {'comparison': name, 'grid': f'{grid}x{grid}', 'A': a, 'B': b,
           'A ms': times[a], 'B ms': times[b], 'A/B time': times[a] / times[b]}
    if memory:
        mem_a, mem_b = (peak_memory_mb(variants[v], args.device) for v in (a, b))
        row.update({'A MiB': mem_a, 'B MiB': mem_b, 'A/B memory': mem_a / mem_b})
    row.update({'target': target, 'met': check(row) if check else ''})
    return row


def run(args) -> List[Dict[str, object]]:
    device, dtype = args.device, DTYPES[args.dtype]
    batch, dim, heads = args.batch, args.dim, args.heads
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    rows = []
    for size in args.grids:
        tokens = size * size
        grid = TokenGrid(size, size)
        layers = {phi: Attention(dim, heads, phi=phi).to(device) for phi in ('peripheral', 'none')}
        x = torch.randn(batch, tokens, dim, device=device)

        limit_time, limit_mem = (1.6, None) if size <= 14 else (2.0, 3.0)
        rows.append(compare(
            'layer fwd+bwd', size, layer_steps(layers, grid, args, autocast),
            f'time <= {limit_time}x' + (f', memory <= {limit_mem}x' if limit_mem else ''),
            lambda r, lt=limit_time, lm=limit_mem: r['A/B time'] <= lt and (lm is None or r['A/B memory'] <= lm),
            args, memory=True))

        phi = layers['peripheral'].phi
        phi_upstream = torch.randn(1, heads, tokens, tokens, device=device)
        q = torch.empty(1, heads, tokens, dim // heads, device=device)
        minimum = 4.0 if size <= 14 else 10.0
        rows.append(compare(
            'Φp fwd+bwd', size,
            {'release': fwd_bwd(lambda: reference.peripheral_position_attention(size, size, phi.weights()),
                                phi_upstream[0]),
             'posattn': fwd_bwd(lambda: phi.logits_bias(q, q, grid), phi_upstream)},
            f'speed-up >= {minimum}x', lambda r, m=minimum: r['A/B time'] >= m, args, memory=True))

        for layer in layers.values():
            layer.eval()

        def inference(phi):
            def forward():
                with torch.no_grad(), autocast:
                    layers[phi](x, grid)
            return forward
        rows.append(compare('eval forward, Φp each call', size,
                            {'peripheral': inference('peripheral'), 'none': inference('none')},
                            'report', None, args))
        with cache_positions(layers['peripheral']):
            rows.append(compare('eval forward, cache_positions', size,
                                {'peripheral': inference('peripheral'), 'none': inference('none')},
                                'time <= 1.15x', lambda r: r['A/B time'] <= 1.15, args))

        qkv = [torch.randn(batch, heads, tokens, dim // heads, device=device, dtype=dtype,
                           requires_grad=True) for _ in range(3)]
        bias = torch.randn(1, heads, tokens, tokens, device=device, dtype=dtype, requires_grad=True)
        out_upstream = torch.randn_like(qkv[0])
        rows.append(compare(
            'attention fwd+bwd, bias with grad', size,
            {'biased_attention': fwd_bwd(lambda: biased_attention(*qkv, bias), out_upstream),
             'SDPA, no bias': fwd_bwd(lambda: F.scaled_dot_product_attention(*qkv), out_upstream)},
            'report', None, args, memory=True))
        rows.append(compare(
            'attention fwd+bwd, bias with grad', size,
            {'SDPA, grad mask': fwd_bwd(lambda: F.scaled_dot_product_attention(*qkv, attn_mask=bias),
                                        out_upstream),
             'biased_attention': fwd_bwd(lambda: biased_attention(*qkv, bias), out_upstream)},
            'report', None, args, memory=True))
    rows.extend(plugin_rows(args))
    return rows


# iRPE as in the DeiT-iRPE-K models: contextual product method on k, one table shared by the heads.
IRPE_K = dict(method='product', mode='ctx', on='k', shared_head=True, ratio=1.9)


# The Φp of the plugin rows, one or more per hook of the Φp interface (docs/phi.md): tokens (peg),
# queries_keys (rope), logits_bias (irpe ctx-k, rpb, alibi, decomposed_rpb), mix_probabilities
# (gpsa), value_term (irpe ctx-v).
PLUGINS = {'peg': ('peg', None), 'irpe ctx-k': ('irpe', IRPE_K), 'irpe ctx-v': ('irpe', dict(mode='ctx', on='v')),
           'rpb': ('rpb', None), 'alibi': ('alibi', None), 'decomposed_rpb': ('decomposed_rpb', None),
           'rope axial': ('rope', None), 'rope mixed': ('rope', dict(frequencies='mixed')), 'gpsa': ('gpsa', None)}


def plugin_rows(args) -> List[Dict[str, object]]:
    """The layer with each Φp of ``PLUGINS`` against plain attention, fwd+bwd, with a class token."""
    device, dtype = args.device, DTYPES[args.dtype]
    dim, heads = args.dim, args.heads
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    rows = []
    for size in args.grids:
        grid = TokenGrid(size, size, 1)
        layers = {'none': Attention(dim, heads, num_prefix_tokens=1),
                  **{name: Attention(dim, heads, phi=phi, phi_cfg=cfg, num_prefix_tokens=1)
                     for name, (phi, cfg) in PLUGINS.items()}}
        steps = layer_steps({name: layer.to(device) for name, layer in layers.items()}, grid, args, autocast)
        for phi in PLUGINS:
            limit = 1.35 if phi == 'irpe ctx-k' and size <= 14 else None
            rows.append(compare(
                'layer fwd+bwd, class token', size, {phi: steps[phi], 'none': steps['none']},
                f'time <= {limit}x' if limit else 'report',
                (lambda r, lt=limit: r['A/B time'] <= lt) if limit else None, args, memory=True))
    return rows


def profile_rows(args) -> Dict[str, List[Dict[str, object]]]:
    """Per grid: the layer fwd+bwd by kind of op (peripheral, none), and Φp's top ops."""
    autocast = torch.autocast(args.device.type, dtype=DTYPES[args.dtype], enabled=args.dtype != 'fp32')
    layers, phi_ops = [], []
    for size in args.grids:
        grid = TokenGrid(size, size)
        attention = {phi: Attention(args.dim, args.heads, phi=phi).to(args.device) for phi in ('peripheral', 'none')}
        steps = layer_steps(attention, grid, args, autocast)
        spent = {phi: step_profile(step, steps=3) for phi, step in steps.items()}
        difference = spent['peripheral']['total'] - spent['none']['total']
        layers += [{'grid': f'{size}x{size}', 'ops': category, 'peripheral ms': spent['peripheral'][category],
                    'none ms': spent['none'][category],
                    'share of the difference': (spent['peripheral'][category] - spent['none'][category]) / difference}
                   for category in spent['peripheral']]
        phi = attention['peripheral'].phi
        upstream = torch.randn(1, args.heads, grid.num_tokens, grid.num_tokens, device=args.device)
        q = torch.empty(1, args.heads, grid.num_tokens, args.dim // args.heads, device=args.device)
        phi_ops += [{'grid': f'{size}x{size}', **row}
                    for row in op_profile(fwd_bwd(lambda: phi.logits_bias(q, q, grid), upstream), steps=3)]
    return {'layer': layers, 'phi': phi_ops}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--device', type=torch.device, default=torch.device('cpu'))
    parser.add_argument('--dtype', choices=sorted(DTYPES), default='fp32')
    parser.add_argument('--batch', type=int, default=8)
    parser.add_argument('--dim', type=int, default=128)
    parser.add_argument('--heads', type=int, default=4)
    parser.add_argument('--grids', type=int, nargs='+', default=[14, 28])
    parser.add_argument('--repeat', type=int, default=15)
    parser.add_argument('--no-profile', dest='profile', action='store_false',
                        help='skip the profiles of where the layer and Φp spend their time')
    add_out_argument(parser)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = run(args)
    columns = ['comparison', 'grid', 'A', 'B', 'A ms', 'B ms', 'A/B time', 'A MiB', 'B MiB',
               'A/B memory', 'target', 'met']
    print(f'B={args.batch} dim={args.dim} heads={args.heads} {args.dtype} on {args.device}, '
          f'{torch.get_num_threads()} threads, torch {torch.__version__}')
    print_table(rows, columns)
    profiles = profile_rows(args) if args.profile else {}
    if profiles:
        print()
        print('Where the layer fwd+bwd goes (CPU profiler, ms; its overhead included):')
        print_table(profiles['layer'], ['grid', 'ops', 'peripheral ms', 'none ms', 'share of the difference'])
        print()
        print("posattn's Φp fwd+bwd, the ops that take the most time (own time, ms per fwd+bwd):")
        print_table(profiles['phi'], ['grid', 'op', 'calls', 'self ms', 'share'])
    path = save_json(f'attention-{args.device.type}-{args.dtype}', {'settings': {
        'batch': args.batch, 'dim': args.dim, 'heads': args.heads, 'dtype': args.dtype,
        'device': str(args.device), 'repeat': args.repeat, 'profile': args.profile}, 'rows': rows,
        'profile': profiles}, folder=args.out)
    print(f'saved {path}')


if __name__ == '__main__':
    main()
