"""Swap PerViT's peripheral Φp into a timm ViT, then fine-tune it.

    .venv/bin/python examples/swap_finetune.py

Builds a small timm ViT (random weights, nothing downloaded), swaps its attention, builds the
optimiser after the swap so that it holds the new Φp parameters, trains a few steps on a task
that needs positions (which quadrant holds a bright square) and shows that every Φp parameter
moved. With an optimiser built before the swap, add the Φp parameters to it:
``optimizer.add_param_group({'params': posattn.parameters_added_by_swap(model)})``.
"""
import warnings

import timm
import torch
import torch.nn.functional as F

import posattn

IMAGE_SIZE, SQUARE = 32, 8
STEPS = 5


def quadrant_images(batch: int, generator: torch.Generator):
    """Noise images with one bright SQUARE x SQUARE square; the label is its quadrant (0-3, row-major)."""
    images = 0.1 * torch.randn(batch, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
    labels = torch.randint(0, 4, (batch,), generator=generator)
    half = IMAGE_SIZE // 2
    for image, label in zip(images, labels.tolist()):
        top, left = (label // 2) * half, (label % 2) * half
        row, col = torch.randint(0, half - SQUARE + 1, (2,), generator=generator).tolist()
        image[:, top + row:top + row + SQUARE, left + col:left + col + SQUARE] += 1.0
    return images, labels


def main() -> None:
    torch.manual_seed(0)
    # Pooled over the tokens: a ViT that classifies from its class token alone gives the last
    # block's peripheral Φp no gradient (the swap warns: posattn.UnreachedPhiWarning).
    model = timm.create_model('vit_tiny_patch16_224', pretrained=False, img_size=IMAGE_SIZE, patch_size=8,
                              depth=4, num_classes=4, global_pool='avg')
    print(f'timm ViT: {len(model.blocks)} blocks, {sum(p.numel() for p in model.parameters()):,} parameters')

    with warnings.catch_warnings():
        # The warning says that an optimiser built before the swap misses the new Φp parameters;
        # this one is built after it.
        warnings.simplefilter('ignore', posattn.swap.AddedParametersWarning)
        posattn.swap_attention(model, phi='peripheral')
    added = posattn.parameters_added_by_swap(model)
    print(f"swap_attention(model, phi='peripheral') added {len(added)} Φp parameters "
          f'({sum(p.numel() for p in added):,} values)')

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # after the swap: it holds the Φp parameters
    held = {id(p) for group in optimizer.param_groups for p in group['params']}
    print(f'the optimiser holds {sum(id(p) in held for p in added)} of them')

    before = [p.detach().clone() for p in added]
    generator = torch.Generator().manual_seed(0)
    model.train()
    for step in range(1, STEPS + 1):
        images, labels = quadrant_images(32, generator)
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f'step {step}: loss {loss.item():.4f}')

    changes = [(p - old).abs().max().item() for p, old in zip(added, before)]
    print(f'after {STEPS} steps, {sum(c > 0 for c in changes)} of {len(added)} Φp parameters changed '
          f'(largest change {max(changes):.2e}, smallest {min(changes):.2e})')


if __name__ == '__main__':
    main()
