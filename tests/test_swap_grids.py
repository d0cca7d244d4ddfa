"""A swapped model's token grid belongs to each call: threads, activation checkpointing with
several forwards of different grids before one backward, and re-entrant calls compute exactly
what one call alone computes."""
import threading

import pytest
import torch

from conftest import randomised
from posattn.swap import swap_attention

timm = pytest.importorskip('timm')

SIZES = [(16, 32), (32, 16)]  # the same token count, 2x4 and 4x2 grids of 8-pixel patches


def dynamic_vit(phi: str, **phi_cfg):
    torch.manual_seed(0)
    model = timm.create_model('vit_tiny_patch16_224', pretrained=False, img_size=32, patch_size=8, embed_dim=32,
                              depth=3, num_heads=2, num_classes=5, dynamic_img_size=True)
    return swap_attention(randomised(model), phi=phi, **phi_cfg)


def alone(model, images):
    """Each image batch through the model on its own, in eval mode, no grad."""
    with torch.no_grad():
        return [model(x) for x in images]


@pytest.mark.parametrize('phi', ['peripheral', 'irpe'])
def test_threads_at_different_sizes_see_their_own_grid(phi):
    model = dynamic_vit(phi).eval()
    images = [torch.randn(2, 3, *size) for size in SIZES + [(24, 40), (40, 24)]]
    expected = alone(model, images)
    results, errors = {}, []
    barrier = threading.Barrier(len(images))

    def run(i):
        try:
            barrier.wait()
            with torch.no_grad():
                for _ in range(5):
                    results.setdefault(i, []).append(model(images[i]))
        except Exception as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(images))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for i, outputs in results.items():
        for out in outputs:
            torch.testing.assert_close(out, expected[i], rtol=0, atol=0)


def gradients(model, images, checkpointing, use_reentrant=False):
    """Gradients of the summed outputs of every batch, all forwards run before one backward."""
    model.zero_grad()
    model.set_grad_checkpointing(checkpointing)
    timm.layers.set_reentrant_ckpt(use_reentrant)
    try:
        loss = sum(model(x).square().sum() for x in images)
    finally:
        timm.layers.set_reentrant_ckpt(False)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize('use_reentrant', [False, True])
@pytest.mark.parametrize('phi,cfg', [('peripheral', {}), ('irpe', dict(mode='bias', method='euc'))])
def test_checkpoint_recompute_uses_the_grid_of_its_forward(phi, cfg, use_reentrant):
    """Two forwards (2x4, then 4x2, as in multi-crop training), then one backward: each block's
    recompute runs on the grid of the forward it repeats."""
    model = dynamic_vit(phi, **cfg).train()
    images = [torch.randn(2, 3, *size, requires_grad=use_reentrant) for size in SIZES]
    expected = gradients(model, images, checkpointing=False)
    found = gradients(model, images, checkpointing=True, use_reentrant=use_reentrant)
    assert found.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(found[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_call_from_inside_a_call_leaves_the_outer_grid_alone():
    """A forward hook on the first block runs the model on an image of another grid (re-entrant):
    the outer call's later blocks still see the outer grid."""
    model = dynamic_vit('peripheral').eval()
    outer, inner = (torch.randn(1, 3, *size) for size in SIZES)
    expected_outer, expected_inner = alone(model, [outer, inner])
    inner_outputs, calls = [], []

    def run_inner(module, args, output):
        calls.append(None)
        if len(calls) == 1:
            inner_outputs.append(model(inner))

    handle = model.blocks[0].register_forward_hook(run_inner)
    try:
        with torch.no_grad():
            found = model(outer)
    finally:
        handle.remove()
    torch.testing.assert_close(found, expected_outer, rtol=0, atol=0)
    torch.testing.assert_close(inner_outputs[0], expected_inner, rtol=0, atol=0)


def test_tags_go_with_their_tensors_and_hooks_can_be_removed():
    model = dynamic_vit('none').eval()
    tracker = model.blocks[0].attn.grid_tracker
    with torch.no_grad():
        model(torch.randn(1, 3, 16, 32))
    assert len(tracker._tagged) == 0  # the forward's tensors are gone, so are their tags
    assert len(tracker.handles) == 1 + 2 * len(model.blocks)
    tracker.detach()
    assert not model.patch_embed.proj._forward_hooks and not model.blocks[0]._forward_pre_hooks
