"""A training step of timm's NaFlexViT on a NaFlex batch of mixed aspect ratios, timm's own model beside
the same model with its attention swapped for posattn's (``phi='none'``, ``'rope'``, ``'rpb'``), side
by side in one run.

    python benchmarks/naflex_swap.py                      # fp32, CPU
    python benchmarks/naflex_swap.py --device cuda --dtype bf16

The model: ``naflexvit_base_patch16_gap``'s layout at a smaller width and depth (``--dim``, ``--depth``,
``--heads``), 16-px patches, average pooling. The batch: ``--images`` images of distinct sizes of about
196 patches (14x14, 13x15, 15x13, 12x16, ...), patchified and padded as timm's NaFlex loader does
(``patches``, ``patch_coord``, ``patch_valid``). Each row: median ms of forward + backward of a
cross-entropy loss, and the ratio to timm's model. Saves ``benchmarks/results/naflex-swap-<device>-<dtype>.json``.
"""
from __future__ import annotations

import argparse
import copy
import warnings
from typing import Callable, Dict, List

import torch
from timm.models.naflexvit import NaFlexVit, NaFlexVitCfg, batch_patchify

from common import add_out_argument, keep_freed_memory, print_table, save_json, time_interleaved
from native_resolution import distinct_grids

import posattn

PATCH = 16
DTYPES = {'fp32': torch.float32, 'bf16': torch.bfloat16}
PHIS = ('none', 'rope', 'rpb')


def naflex_batch(grids, device: torch.device):
    """patches (B, L, P*P*3), patch_coord (B, L, 2), patch_valid (B, L) of images of ``grids`` (in patches)."""
    images = [torch.randn(3, height * PATCH, width * PATCH) for height, width in grids]
    patches = [batch_patchify(image[None], (PATCH, PATCH))[0][0] for image in images]
    length = max(p.shape[0] for p in patches)
    flat = torch.zeros(len(images), length, patches[0].shape[-1])
    coord = torch.zeros(len(images), length, 2, dtype=torch.long)
    valid = torch.zeros(len(images), length, dtype=torch.bool)
    for i, (p, (height, width)) in enumerate(zip(patches, grids)):
        rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing='ij')
        flat[i, :p.shape[0]], valid[i, :p.shape[0]] = p, True
        coord[i, :p.shape[0]] = torch.stack([rows.flatten(), cols.flatten()], -1)
    return flat.to(device), coord.to(device), valid.to(device)


def models(args) -> Dict[str, torch.nn.Module]:
    cfg = NaFlexVitCfg(patch_size=PATCH, embed_dim=args.dim, depth=args.depth, num_heads=args.heads,
                       global_pool='avg', class_token=False, reg_tokens=0, fc_norm=False)
    torch.manual_seed(0)
    timm_model = NaFlexVit(cfg, num_classes=10, img_size=224).to(args.device).train()
    out = {'timm': timm_model}
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', posattn.swap.AddedParametersWarning)
        for phi in PHIS:
            out[f'posattn {phi}'] = posattn.swap_attention(copy.deepcopy(timm_model), phi=phi).train()
    return out


def steps(args) -> Dict[str, Callable[[], None]]:
    batch = naflex_batch(distinct_grids(args.images), args.device)
    labels = torch.randint(0, 10, (args.images,), device=args.device)

    def step_of(model):
        def step():
            with torch.autocast(args.device.type, dtype=DTYPES[args.dtype], enabled=args.dtype != 'fp32'):
                loss = torch.nn.functional.cross_entropy(model(*batch), labels)
            loss.backward()
        return step
    return {name: step_of(model) for name, model in models(args).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--device', type=torch.device, default=torch.device('cpu'))
    parser.add_argument('--dtype', choices=sorted(DTYPES), default='fp32')
    parser.add_argument('--dim', type=int, default=192)
    parser.add_argument('--depth', type=int, default=4)
    parser.add_argument('--heads', type=int, default=3)
    parser.add_argument('--images', type=int, default=16)
    parser.add_argument('--repeat', type=int, default=10)
    add_out_argument(parser)
    args = parser.parse_args()
    args.freed_memory_kept = keep_freed_memory()
    times = time_interleaved(steps(args), repeat=args.repeat, device=args.device)
    rows: List[dict] = [{'model': name, 'ms': ms, 'vs timm': ms / times['timm']} for name, ms in times.items()]
    print(f'NaFlexViT dim={args.dim} depth={args.depth} heads={args.heads}, {args.images} images of distinct '
          f'grids of about 196 patches, {args.dtype} on {args.device}, {torch.get_num_threads()} threads')
    print_table(rows, ['model', 'ms', 'vs timm'])
    path = save_json(f'naflex-swap-{args.device.type}-{args.dtype}', {'settings': {
        name: str(value) if name in ('device', 'out') else value for name, value in vars(args).items()},
        'rows': rows}, folder=args.out)
    print(f'saved {path}')


if __name__ == '__main__':
    main()
