"""A batch of images at their own resolutions through the attention layer: padded, packed, image by
image, and a batch of one shared grid, for every Φp, side by side in one run.

    python benchmarks/native_resolution.py                 # fp32, CPU, dim 128, 4 heads, both batches
    python benchmarks/native_resolution.py --device cuda --dtype bf16

Two batches, each image with a class token:

- ``32 grids``: 32 images of 32 distinct grids of 190-208 tokens (14x14, 13x15, 15x13, 12x16, ...);
- ``8 images``: 8 images of 7 grids of about 196 tokens (14x14 twice, 10x20, 20x10, 12x16, 16x12,
  8x24, 24x8).

Each row times the layer's forward and backward (median of ``--repeat`` rounds, the variants in
turn) and its peak memory:

- padded: one image a row, padded to the longest (:meth:`posattn.ImageLayout.padded`);
- packed: the images one after another in one row (:meth:`posattn.ImageLayout.packed`);
- image by image: the layer called once per image;
- one grid: as many images, all 14x14: the single-grid batch of about the same tokens.

Prints the table and saves ``benchmarks/results/native-resolution-<device>-<dtype>.json``.
"""
from __future__ import annotations

import argparse
from typing import Callable, Dict, List, Sequence, Tuple

import torch

from common import add_out_argument, keep_freed_memory, peak_memory_mb, print_table, save_json, time_interleaved

from posattn import Attention, ImageLayout, TokenGrid

DTYPES = {'fp32': torch.float32, 'bf16': torch.bfloat16}
EIGHT = [(14, 14), (10, 20), (20, 10), (12, 16), (14, 14), (16, 12), (8, 24), (24, 8)]
PHIS = ('none', 'rope', 'alibi', 'rpb', 'decomposed_rpb', 'irpe', 'gpsa', 'peg', 'peripheral')


def distinct_grids(count: int, tokens: int = 196, spread: int = 12) -> List[Tuple[int, int]]:
    """``count`` distinct (H, W) with H * W within ``spread`` of ``tokens``, nearest first, then the
    squarer: 14x14, 13x15, 15x13, ..."""
    near = [(h, w) for h in range(4, tokens) for w in range(4, tokens) if abs(h * w - tokens) <= spread]
    near.sort(key=lambda hw: (abs(hw[0] - hw[1]) + abs(hw[0] * hw[1] - tokens), hw))
    if len(near) < count:
        raise ValueError(f'only {len(near)} grids within {spread} tokens of {tokens}')
    return near[:count]


BATCHES = {'32 grids': distinct_grids(32), '8 images': EIGHT}


def steps(layer: Attention, sizes: Sequence[Tuple[int, int]], args, autocast) -> Dict[str, Callable[[], None]]:
    """fwd+bwd of each variant on the same images (tokens and upstream gradient)."""
    grids = [TokenGrid(height, width, 1) for height, width in sizes]
    images = [torch.randn(grid.num_tokens, args.dim, device=args.device) for grid in grids]
    upstream = [torch.randn_like(image) for image in images]

    def placed(layout: ImageLayout, tensors: List[torch.Tensor]) -> torch.Tensor:
        out = torch.zeros(layout.num_rows, layout.length, args.dim, device=args.device)
        for tensor, row, start in zip(tensors, layout.rows, layout.starts):
            out[row, start:start + tensor.shape[0]] = tensor
        return out

    def in_layout(layout: ImageLayout) -> Callable[[], None]:
        x, grad = placed(layout, images).requires_grad_(), placed(layout, upstream)

        def step():
            with autocast():
                out = layer(x, layout)
            out.backward(grad)
        return step

    alone = [image[None].clone().requires_grad_() for image in images]

    def image_by_image():
        for x, grid, grad in zip(alone, grids, upstream):
            with autocast():
                out = layer(x, grid)
            out.backward(grad[None])

    one_grid = TokenGrid(14, 14, 1)
    square = torch.randn(len(grids), one_grid.num_tokens, args.dim, device=args.device, requires_grad=True)
    square_grad = torch.randn_like(square)

    def single_grid():
        with autocast():
            out = layer(square, one_grid)
        out.backward(square_grad)

    return {'padded': in_layout(ImageLayout.padded(grids, 1)), 'packed': in_layout(ImageLayout.packed(grids, 1)),
            'image by image': image_by_image, 'one grid': single_grid}


def run(args) -> List[dict]:
    rows = []
    for batch in args.batches:
        for phi in args.phis:
            torch.manual_seed(0)
            layer = Attention(args.dim, args.heads, phi=phi, num_prefix_tokens=1).to(args.device)

            def autocast():
                return torch.autocast(args.device.type, dtype=DTYPES[args.dtype], enabled=args.dtype != 'fp32')
            variants = steps(layer, BATCHES[batch], args, autocast)
            times = time_interleaved(variants, repeat=args.repeat, device=args.device)
            memory = {name: peak_memory_mb(step, args.device) for name, step in variants.items()}
            for name in variants:
                rows.append({'batch': batch, 'Φp': phi, 'variant': name, 'ms': times[name],
                             'vs one grid': times[name] / times['one grid'], 'MiB': memory[name],
                             'MiB vs one grid': memory[name] / memory['one grid'],
                             'one call': layer.phi.runs_on_token_positions})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--device', type=torch.device, default=torch.device('cpu'))
    parser.add_argument('--dtype', choices=sorted(DTYPES), default='fp32')
    parser.add_argument('--dim', type=int, default=128)
    parser.add_argument('--heads', type=int, default=4)
    parser.add_argument('--repeat', type=int, default=15)
    parser.add_argument('--phis', nargs='+', default=list(PHIS), choices=PHIS)
    parser.add_argument('--batches', nargs='+', default=list(BATCHES), choices=list(BATCHES))
    add_out_argument(parser)
    args = parser.parse_args()
    freed_memory_kept = keep_freed_memory()
    rows = run(args)
    print(f'dim={args.dim} heads={args.heads} {args.dtype} on {args.device}, {torch.get_num_threads()} threads, '
          f'torch {torch.__version__}; 32 grids: {BATCHES["32 grids"]}')
    print_table(rows, ['batch', 'Φp', 'variant', 'one call', 'ms', 'vs one grid', 'MiB', 'MiB vs one grid'])
    path = save_json(f'native-resolution-{args.device.type}-{args.dtype}', {'settings': {
        'batches': BATCHES, 'dim': args.dim, 'heads': args.heads, 'dtype': args.dtype,
        'device': str(args.device), 'repeat': args.repeat, 'freed memory kept': freed_memory_kept},
        'rows': rows}, folder=args.out)
    print(f'saved {path}')


if __name__ == '__main__':
    main()
