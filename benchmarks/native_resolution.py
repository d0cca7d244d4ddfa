"""A batch of images at their own resolutions through the attention layer: padded, packed, and
image by image, for a few Φp, side by side in one run.

    python benchmarks/native_resolution.py                 # fp32, CPU, 8 images, dim 128, 4 heads
    python benchmarks/native_resolution.py --device cuda --dtype bf16

The batch holds 8 images of 7 grids of about 196 tokens each (14x14 twice, 10x20, 20x10, 12x16,
16x12, 8x24, 24x8) and a class token. Each row times the layer's forward and backward (median of
``--repeat`` rounds, the variants in turn) and its peak memory:

- padded: one image a row, padded to the longest (:meth:`posattn.ImageLayout.padded`);
- packed: the images one after another in one row (:meth:`posattn.ImageLayout.packed`);
- image by image: the layer called once per image;
- one grid: the same number of images all at 14x14, the single-grid batch, for scale.

Prints the table and saves ``benchmarks/results/native-resolution-<device>-<dtype>.json``.
"""
from __future__ import annotations

import argparse
from typing import Callable, Dict, List

import torch

from common import add_out_argument, peak_memory_mb, print_table, save_json, time_interleaved

from posattn import Attention, ImageLayout, TokenGrid

DTYPES = {'fp32': torch.float32, 'bf16': torch.bfloat16}
GRIDS = [(14, 14), (10, 20), (20, 10), (12, 16), (14, 14), (16, 12), (8, 24), (24, 8)]
PHIS = ('none', 'rpb', 'rope', 'peripheral')


def steps(layer: Attention, args, autocast) -> Dict[str, Callable[[], None]]:
    """fwd+bwd of each variant on the same images (tokens and upstream gradient)."""
    grids = [TokenGrid(height, width, 1) for height, width in GRIDS]
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
    square = torch.randn(len(GRIDS), one_grid.num_tokens, args.dim, device=args.device, requires_grad=True)
    square_grad = torch.randn_like(square)

    def single_grid():
        with autocast():
            out = layer(square, one_grid)
        out.backward(square_grad)

    return {'padded': in_layout(ImageLayout.padded(grids, 1)), 'packed': in_layout(ImageLayout.packed(grids, 1)),
            'image by image': image_by_image, 'one grid (14x14)': single_grid}


def run(args) -> List[dict]:
    rows = []
    for phi in PHIS:
        layer = Attention(args.dim, args.heads, phi=phi, num_prefix_tokens=1).to(args.device)

        def autocast():
            return torch.autocast(args.device.type, dtype=DTYPES[args.dtype], enabled=args.dtype != 'fp32')
        variants = steps(layer, args, autocast)
        times = time_interleaved(variants, repeat=args.repeat, device=args.device)
        for name, step in variants.items():
            rows.append({'Φp': phi, 'variant': name, 'ms': times[name],
                         'vs padded': times[name] / times['padded'],
                         'MiB': peak_memory_mb(step, args.device)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--device', type=torch.device, default=torch.device('cpu'))
    parser.add_argument('--dtype', choices=sorted(DTYPES), default='fp32')
    parser.add_argument('--dim', type=int, default=128)
    parser.add_argument('--heads', type=int, default=4)
    parser.add_argument('--repeat', type=int, default=15)
    add_out_argument(parser)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = run(args)
    print(f'{len(GRIDS)} images of {len(set(GRIDS))} grids, dim={args.dim} heads={args.heads} {args.dtype} '
          f'on {args.device}, {torch.get_num_threads()} threads, torch {torch.__version__}')
    print_table(rows, ['Φp', 'variant', 'ms', 'vs padded', 'MiB'])
    path = save_json(f'native-resolution-{args.device.type}-{args.dtype}', {'settings': {
        'grids': GRIDS, 'dim': args.dim, 'heads': args.heads, 'dtype': args.dtype,
        'device': str(args.device), 'repeat': args.repeat}, 'rows': rows}, folder=args.out)
    print(f'saved {path}')


if __name__ == '__main__':
    main()
