"""posattn's own models on a list of images of different sizes: the ViT runs the whole list in one
call through its blocks, each image on its own grid; PerViT runs one batch per size, and refuses
in training a size too few images hold for BatchNorm's statistics."""
import pytest
import torch

from posattn.layout import ImageLayout
from posattn.models.pervit import PerViT
from posattn.models.vit import VisionTransformer

# (H, W) in pixels; with 8-pixel patches the grids 4x6 (twice), 1x5, 5x1, 4x4 (the position
# embedding's own) and 3x2.
SIZES = [(32, 48), (8, 40), (32, 48), (40, 8), (32, 32), (24, 16)]


def tiny_vit(**options):
    return VisionTransformer(img_size=32, patch_size=8, embed_dim=16, depth=2, num_heads=2, num_classes=3,
                             **options).double()


def random_images(sizes, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(3, *size, generator=generator, dtype=dtype) for size in sizes]


def count_calls(*modules):
    """A list counting each module's forward calls, and the hook handles to remove."""
    counts = [0] * len(modules)

    def counter(index):
        def hook(module, args, output):
            counts[index] += 1
        return hook
    return counts, [module.register_forward_hook(counter(i)) for i, module in enumerate(modules)]


def gradients(output, weights, params):
    return torch.autograd.grad((output * weights).sum(), params, allow_unused=True)


HEADS = {'class token': dict(global_pool='token'),
         'avg, class token, PEG': dict(global_pool='avg', peg_after=(0,)),
         'avg': dict(global_pool='avg', class_token=False)}


@pytest.mark.parametrize('head', HEADS)
@pytest.mark.parametrize('phi', ['none', 'rope', 'rpb', 'peg'])
def test_vit_runs_a_list_in_one_call_each_image_as_alone(phi, head):
    """Logits and every parameter's gradient of a list equal those of each image alone (float64,
    training mode with no dropout or drop path), with one patch embedding per distinct size and one
    call of each block and each attention layer for the whole list. The PEG after block 0 runs on
    each image's grid; 'avg' leaves the class token out of the mean."""
    model = tiny_vit(phi=phi, **HEADS[head]).train()
    images = random_images(SIZES)
    weights = torch.randn(len(images), 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    names, params = zip(*model.named_parameters())
    blocks = list(model.blocks)
    counts, handles = count_calls(model.patch_embed, *blocks, *(block.attn for block in blocks))
    seen_by_blocks = []
    handles += [block.register_forward_pre_hook(lambda module, args: seen_by_blocks.append(args[1]))
                for block in blocks]
    logits = model(images)
    for handle in handles:
        handle.remove()
    assert counts == [len(set(SIZES))] + [1] * 2 * len(blocks)
    assert all(isinstance(where, ImageLayout) and where.num_images == len(images) for where in seen_by_blocks)
    together = gradients(logits, weights, params)
    alone = torch.cat([model(image[None]) for image in images])
    expected = gradients(alone, weights, params)
    assert logits.shape == (len(images), 3)
    torch.testing.assert_close(logits, alone, rtol=0, atol=1e-10)
    for name, grad, want in zip(names, together, expected):
        # the absolute embedding is resampled to other grids in float32 (models/pos_embed.py): its
        # gradient is summed over a size's images in float32 in the list, in float64 alone
        tolerance = dict(rtol=1e-5, atol=1e-8) if name == 'pos_embed' else dict(rtol=0, atol=1e-10)
        torch.testing.assert_close(grad, want, **tolerance, msg=name)


def test_vit_list_with_gradient_checkpointing_and_no_head():
    """Gradient checkpointing recomputes each block on the layout, to the same gradients; with no
    classifier the list gives each image's pooled features (len(list), embed_dim)."""
    model = tiny_vit(phi='rope').train()
    images = random_images(SIZES[:4])
    params = list(model.parameters())
    expected = torch.autograd.grad(model(images).sum(), params)
    model.set_grad_checkpointing(True)
    for grad, want in zip(torch.autograd.grad(model(images).sum(), params), expected):
        torch.testing.assert_close(grad, want, rtol=0, atol=1e-12)
    model.reset_classifier(0)
    with torch.no_grad():
        features = model(images)
        assert features.shape == (4, 16)
        torch.testing.assert_close(features, torch.cat([model(image[None]) for image in images]), rtol=0, atol=1e-10)


def test_vit_refuses_a_list_it_cannot_pool_before_any_work():
    """global_pool='' hands the head every token, and the images' token counts differ."""
    model = tiny_vit(global_pool='')
    counts, handles = count_calls(model.patch_embed)
    with pytest.raises(ValueError, match=r"global_pool='' gives the head every token, and images of different sizes "
                                         r"have different token counts: pool them \(global_pool='token' or 'avg'"):
        model(random_images(SIZES[:2]))
    assert counts == [0]
    with pytest.raises(ValueError, match=r'each image of a list must be a tensor \(C, H, W\)'):
        tiny_vit()([torch.zeros(1, 3, 32, 32)])


def tiny_pervit(**options):
    return PerViT(embed_dims=(16, 16), depths=(1, 1), num_heads=2, stem_dims=(8, 8, 8, 8), num_classes=3, **options)


def test_pervit_refuses_too_few_images_of_a_size_in_training_before_any_work():
    model = tiny_pervit().train()
    images = random_images([(32, 48)] * 3 + [(48, 32)] + [(32, 32)] * PerViT.min_images_per_size, torch.float32)
    counts, _ = count_calls(model.stem)
    with pytest.raises(ValueError) as refusal:
        model(images)
    assert str(refusal.value) == (
        "in training mode PerViT runs the images of each size of a list as one batch through BatchNorm, whose "
        "statistics over fewer than 8 images (min_images_per_size) are not a batch's; these sizes hold fewer: "
        "32x48 (3 images), 48x32 (1 image). Resize the images to a few sizes, each held by at least 8 images of "
        "the list, or give batches (B, C, H, W) of one size")
    assert counts == [0]
    assert all(int(norm.num_batches_tracked) == 0 for norm in model.modules()
               if isinstance(norm, torch.nn.BatchNorm2d))


def test_pervit_trains_on_enough_images_of_each_size_one_batch_per_size():
    model = tiny_pervit().train()
    images = random_images([(32, 48), (32, 32)] * PerViT.min_images_per_size, torch.float32)
    counts, _ = count_calls(model.stem, *model.blocks)
    logits = model(images)
    logits.sum().backward()
    assert logits.shape == (len(images), 3) and torch.isfinite(logits).all()
    assert counts == [2] * (1 + len(model.blocks))


def test_pervit_runs_a_list_by_size_in_eval_and_without_batch_norm():
    """In eval mode (running statistics) any list runs, each image's logits as alone; so it does in
    training with the patch stem, which has no BatchNorm."""
    images = random_images([(32, 48), (48, 32), (32, 48)], torch.float64)
    model = tiny_pervit().double().eval()
    with torch.no_grad():
        torch.testing.assert_close(model(images), torch.cat([model(image[None]) for image in images]),
                                   rtol=0, atol=1e-10)
    patch_stem = tiny_pervit(stem='patch').double().train()
    assert patch_stem(images).shape == (3, 3)
