"""swap_attention into timm's NaFlexVit: a NaFlex batch (patches, patch_coord, patch_valid) of
images of three aspect ratios, each image attending within its own grid; exact against timm with
phi='none' (float64, outputs and gradients), each image's output that of the image alone with any
Φp, training steps, and the refusals."""
import copy
import warnings

import pytest
import torch

import posattn
from posattn import ImageLayout

timm = pytest.importorskip('timm')
from timm.models.naflexvit import NaFlexVit, NaFlexVitCfg, batch_patchify  # noqa: E402

PATCH = 8
SIZES = [(24, 40), (40, 16), (32, 32)]  # grids 3x5, 5x2, 4x4


def naflex_model(pool='avg', reg_tokens=2, **options):
    cfg = NaFlexVitCfg(patch_size=PATCH, embed_dim=32, depth=2, num_heads=2, global_pool=pool,
                       reg_tokens=reg_tokens, class_token=pool == 'token', **options)
    torch.manual_seed(0)
    model = NaFlexVit(cfg, num_classes=5, img_size=32).double()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(std=0.05)
    return model.eval()


def naflex_batch(images):
    """timm's NaFlex input: patches (B, N, P*P*3) row-major per image, padded at the end, their
    (row, column) and a validity mask."""
    patches = [batch_patchify(image[None], (PATCH, PATCH)) for image in images]
    length = max(p.shape[1] for p, _ in patches)
    flat = torch.zeros(len(images), length, patches[0][0].shape[-1], dtype=images[0].dtype)
    coord = torch.zeros(len(images), length, 2, dtype=torch.long)
    valid = torch.zeros(len(images), length, dtype=torch.bool)
    for i, (p, (height, width)) in enumerate(patches):
        rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing='ij')
        flat[i, :p.shape[1]], valid[i, :p.shape[1]] = p[0], True
        coord[i, :p.shape[1]] = torch.stack([rows.flatten(), cols.flatten()], -1)
    return flat, coord, valid


def images(seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(3, *size, generator=generator, dtype=torch.float64) for size in SIZES]


def swapped(model, phi='none', **options):
    """A swapped copy of ``model`` (the added-parameters warning is the swap tests' subject, not this file's)."""
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', posattn.swap.AddedParametersWarning)
        return posattn.swap_attention(copy.deepcopy(model), phi=phi, **options)


@pytest.mark.parametrize('pool,reg_tokens', [('avg', 2), ('map', 0), ('token', 0)])
def test_phi_none_is_timm_on_a_naflex_batch_outputs_and_gradients(pool, reg_tokens):
    model = naflex_model(pool, reg_tokens)
    copy_of = swapped(model)
    patches, coord, valid = naflex_batch(images())
    expected, out = model(patches, coord, valid), copy_of(patches, coord, valid)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    weights = torch.randn(expected.shape, dtype=torch.float64)
    (expected * weights).sum().backward()
    (out * weights).sum().backward()
    theirs = dict(model.named_parameters())
    for name, param in copy_of.named_parameters():
        torch.testing.assert_close(param.grad, theirs[name].grad, rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize('phi', ['peripheral', 'rpb', 'rope', 'peg', 'alibi', ['rope', 'rpb']], ids=str)
def test_each_image_of_a_naflex_batch_gets_its_output_alone(phi):
    model = swapped(naflex_model(), phi)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)  # Φp away from their initialisation
    batch = images()
    out = model(*naflex_batch(batch))
    alone = torch.cat([model(*naflex_batch([image])) for image in batch])
    torch.testing.assert_close(out, alone, rtol=0, atol=1e-10)


def test_a_swapped_naflexvit_trains_on_naflex_batches():
    model = swapped(naflex_model(), 'peripheral').train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch, labels = naflex_batch(images()), torch.tensor([0, 3, 1])
    losses = []
    for _ in range(4):
        loss = torch.nn.functional.cross_entropy(model(*batch), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert all(param.grad is not None for param in posattn.parameters_added_by_swap(model))


def test_images_of_one_size_still_take_the_single_grid_path():
    model = naflex_model()
    copy_of = swapped(model)
    x = torch.randn(2, 3, 24, 40, dtype=torch.float64)
    torch.testing.assert_close(copy_of(x), model(x), rtol=0, atol=1e-12)


def test_a_mask_that_is_not_the_batchs_padding_is_refused():
    model = swapped(naflex_model())
    patches, coord, valid = naflex_batch(images())
    layout = ImageLayout.from_patch_coords(coord, valid, num_prefix_tokens=2)
    mask = torch.zeros(3, 1, layout.length, layout.length, dtype=torch.float64)  # attends to padding too
    with pytest.raises(ValueError, match='not the padding mask of the NaFlex batch'):
        model.forward_features(patches, coord, valid, attn_mask=mask)


def test_a_naflex_batch_out_of_row_major_order_is_refused():
    model = swapped(naflex_model())
    patches, coord, valid = naflex_batch(images())
    coord[0, :2] = coord[0, :2].flip(0)
    with pytest.raises(ValueError, match='valid patches of image 0 of the NaFlex batch are not its 3x5 grid'):
        model(patches, coord, valid)
    coord[0, :2] = coord[0, :2].flip(0)
    valid[1, 0] = False
    with pytest.raises(ValueError, match='image 1 of the NaFlex batch has its valid patches after padding'):
        ImageLayout.from_patch_coords(coord, valid)


def test_naflexvits_that_posattn_cannot_swap_say_why():
    with pytest.raises(ValueError, match='patch_drop_rate=0'):
        posattn.swap_attention(naflex_model(patch_drop_rate=0.25), phi='none')
    with pytest.raises(TypeError, match="not its EVA and RoPE blocks"):
        posattn.swap_attention(naflex_model(rope_type='axial', pos_embed='none'), phi='none')


def test_a_copy_and_a_pickled_model_read_naflex_batches_too():
    import io
    model = swapped(naflex_model(), 'rpb')
    batch = naflex_batch(images())
    expected = model(*batch)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for other in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        torch.testing.assert_close(other(*batch), expected, rtol=0, atol=0)


@pytest.mark.parametrize('name', timm.list_models('naflexvit*'))
def test_every_registered_naflexvit_swaps_exactly(name):
    """Each of timm's NaFlexViT models, narrowed to 2 blocks of width 64, its parameters random: phi='none'
    gives its outputs on a NaFlex batch of three aspect ratios."""
    model = timm.create_model(name, depth=2, embed_dim=64, num_heads=2, img_size=64, patch_size=PATCH,
                              num_classes=3).double().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(std=0.05)
    batch = naflex_batch(images())
    torch.testing.assert_close(swapped(model)(*batch), model(*batch), rtol=0, atol=1e-12)


def siglip2(attn_implementation):
    transformers = pytest.importorskip('transformers', minversion='5')
    config = transformers.Siglip2VisionConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                              intermediate_size=128, patch_size=PATCH, num_patches=64)
    config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    model = transformers.Siglip2VisionModel(config).double().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(std=0.05)
    return model


def siglip2_batch():
    """SigLIP 2's NaFlex input for the three grids: patches padded to 16, their mask and grid shapes."""
    shapes = [(size[0] // PATCH, size[1] // PATCH) for size in SIZES]
    generator = torch.Generator().manual_seed(2)
    patches = torch.zeros(len(shapes), 16, 3 * PATCH * PATCH, dtype=torch.float64)
    mask = torch.zeros(len(shapes), 16, dtype=torch.long)
    for i, (height, width) in enumerate(shapes):
        patches[i, :height * width] = torch.randn(height * width, patches.shape[-1], generator=generator,
                                                  dtype=torch.float64)
        mask[i, :height * width] = 1
    return dict(pixel_values=patches, pixel_attention_mask=mask, spatial_shapes=torch.tensor(shapes))


# transformers' eager attention takes its softmax in float32; SDPA's is the float64 one
@pytest.mark.parametrize('attn_implementation,atol', [('sdpa', 1e-12), ('eager', 1e-8)])
def test_phi_none_is_transformers_siglip2_on_a_naflex_batch(attn_implementation, atol):
    model = siglip2(attn_implementation)
    batch = siglip2_batch()
    expected, out = model(**batch), swapped(model)(**batch)
    valid = batch['pixel_attention_mask'].bool()
    torch.testing.assert_close(out.last_hidden_state[valid], expected.last_hidden_state[valid], rtol=0, atol=atol)
    torch.testing.assert_close(out.pooler_output, expected.pooler_output, rtol=0, atol=atol)


def test_each_image_of_a_siglip2_batch_gets_its_output_alone():
    model = swapped(siglip2('sdpa'), 'peripheral')
    batch = siglip2_batch()
    pooled = model(**batch).pooler_output
    for i in range(len(SIZES)):
        length = int(batch['pixel_attention_mask'][i].sum())
        alone = model(pixel_values=batch['pixel_values'][i:i + 1, :length],
                      pixel_attention_mask=batch['pixel_attention_mask'][i:i + 1, :length],
                      spatial_shapes=batch['spatial_shapes'][i:i + 1]).pooler_output
        torch.testing.assert_close(pooled[i:i + 1], alone, rtol=0, atol=1e-10)


def test_a_padding_mask_checked_in_one_thread_is_checked_again_in_another():
    """The memo that spares a model's layers from checking one mask each is the thread's own: another
    thread giving the same tensor for another layout, where it is no padding mask, is refused."""
    import threading
    from posattn.swap.core import check_padding_mask
    fits = ImageLayout.padded([(1, 2), (1, 1)], length=2)  # the second image has one token, then padding
    mask = torch.tensor([[True, True], [True, False]])[:, None, None, :]
    check_padding_mask(mask, fits)
    errors = []

    def other_thread():
        try:
            check_padding_mask(mask, ImageLayout.padded([(1, 2), (1, 2)], length=2))
        except ValueError as error:
            errors.append(str(error))
    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert errors and 'is not the padding mask of the NaFlex batch' in errors[0]
    check_padding_mask(mask, fits)  # this thread's memo still serves
