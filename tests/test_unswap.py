"""posattn.unswap: every swapped family back to its own classes, with the weights the swapped model
holds (after a fine-tuning step too), its own outputs and state dict keys, in float64."""
import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

import posattn
from conftest import randomised
from posattn.swap import SwappedAttention, swap_attention, unswap

timm = pytest.importorskip('timm')
torchvision = pytest.importorskip('torchvision')


def timm_vit():
    return timm.create_model('vit_tiny_patch16_224', img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2,
                             num_classes=5)


def torchvision_vit():
    return torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32,
                                                mlp_dim=64, num_classes=5)


def image(size=32, batch=2):
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def timm_families():
    from test_swap_convit import small_convit
    from test_swap_sam import sam
    from test_swap_timm_relative import MODELS
    from test_swap_windows import timm_swin
    return {
        'timm VisionTransformer': (timm_vit, image(32)),
        'timm Eva (EVA-02)': (MODELS['eva02'], image(56)),
        'timm Eva (RoPE ViT with registers)': (MODELS['rope_vit_registers'], image(64)),
        'timm Beit': (MODELS['beit'], image(64)),
        'timm Beit, shared bias': (MODELS['beit_shared_bias'], image(64)),
        'timm VisionTransformerRelPos': (MODELS['relpos_mlp'], image(64)),
        'timm VisionTransformerRelPos, table': (MODELS['relpos_table'], image(64)),
        'timm SwinTransformer': (timm_swin, image(64)),
        'timm VisionTransformerSAM': (sam, image(64)),
        'timm ConVit': (small_convit, image(64)),
        'torchvision VisionTransformer': (torchvision_vit, image(32)),
        'torchvision SwinTransformer': (__import__('test_swap_windows').torchvision_swin, image(64)),
    }


def transformers_families():
    pytest.importorskip('transformers', minversion='5')
    from test_swap_hf import MODELS
    return {f'transformers {name}': (build, image(32)) for name, (build, _) in MODELS.items()}


def openmmlab_families():
    pytest.importorskip('posattn_openmmlab')
    from test_openmmlab_swap import FAMILIES, IMAGES
    from test_swap_windows import mmdet_swin, mmpretrain_swin, mmseg_swin
    families = {name: (lambda build=build: nn.Sequential(build()), IMAGES.double()) for name, (build, *_)
                in FAMILIES.items()}
    families.update({'mmdet SwinTransformer': (mmdet_swin, image(56)), 'mmseg SwinTransformer': (mmseg_swin, image(56)),
                     'mmpretrain SwinTransformer': (lambda: mmpretrain_swin(pad_small_map=True), image(56))})
    return families


SOURCES = {'timm and torchvision': timm_families, 'transformers': transformers_families,
           'OpenMMLab': openmmlab_families}


def tensors(output):
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = [value for value in output.values() if value is not None]
    return [t for item in output for t in tensors(item)]


def called(model, x):
    """``model`` on ``x``: a tensor, a tuple of arguments or a dict of keywords (a NaFlex batch)."""
    return model(*x) if isinstance(x, tuple) else model(**x) if isinstance(x, dict) else model(x)


def outputs(model, x, select=tensors):
    with torch.no_grad():
        return select(called(model.eval(), x))


def assert_same(got, expected, atol=1e-10):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=atol)


def fine_tuning_step(model, x):
    """One SGD step of the whole model in train mode (lr 0.05 on the mean square of its outputs)."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    loss = sum(t.square().mean() for t in tensors(called(model, x)) if t.is_floating_point())
    loss.backward()
    with torch.no_grad():
        for param in params:
            if param.grad is not None:
                param.sub_(0.05 * param.grad)
                param.grad = None
    return model.eval()


def module_classes(model):
    return [(name, type(module)) for name, module in model.named_modules()]


def assert_round_trip(build, x, phi='none', select=tensors):
    """Swapped and unswapped: the model's own classes, keys and outputs; then swapped, fine-tuned and
    unswapped: the fine-tuned swapped model's outputs and weights, under the model's own keys. (EVA's own
    RoPE computes its angles in float32, which the converted Φp reproduces to 1e-8.)"""
    atol = 1e-10 if phi == 'none' else 1e-8
    torch.manual_seed(0)
    model = randomised(build()).double()
    reference = copy.deepcopy(model)
    expected_classes, expected_keys = module_classes(model), list(model.state_dict())

    unswap(swap_attention(model, phi=phi))
    assert module_classes(model) == expected_classes
    assert list(model.state_dict()) == expected_keys
    assert_same(outputs(model, x, select), outputs(reference, x, select), atol)

    swapped = fine_tuning_step(swap_attention(model, phi=phi), x)
    tuned_outputs = outputs(swapped, x, select)
    tuned_state = {k: v.clone() for k, v in swapped.state_dict().items()}
    unswapped = unswap(swapped)
    assert unswapped is model and module_classes(model) == expected_classes
    state = model.state_dict()
    assert list(state) == expected_keys
    moved = [key for key in expected_keys if not torch.equal(state[key], reference.state_dict()[key])]
    assert moved, 'the fine-tuning step moved no weight'
    for key, tensor in tuned_state.items():
        if key in state:
            assert torch.equal(state[key], tensor), key
    assert_same(outputs(model, x, select), tuned_outputs, atol)
    reference.load_state_dict(state)  # the original classes load the unswapped weights strictly
    assert_same(outputs(reference, x, select), tuned_outputs, atol)
    return model


@pytest.mark.parametrize('source', SOURCES)
def test_every_family_round_trips_and_carries_the_fine_tuned_weights(source):
    for name, (build, x) in SOURCES[source]().items():
        try:
            assert_round_trip(build, x)
        except Exception as error:
            raise AssertionError(f'{name}: {error}') from error


def test_naflex_models_round_trip_on_naflex_batches():
    """timm's NaFlexViT and transformers' SigLIP 2 on batches of images of three grids, padded: their
    outputs at the valid tokens (a padding token's output is the model's own business)."""
    from test_swap_naflex import images, naflex_batch, naflex_model, siglip2, siglip2_batch
    assert_round_trip(naflex_model, naflex_batch(images()))
    pytest.importorskip('transformers', minversion='5')
    batch = siglip2_batch()
    valid = batch['pixel_attention_mask'].bool()
    assert_round_trip(lambda: siglip2('sdpa'), batch,
                      select=lambda out: [out.last_hidden_state[valid], out.pooler_output])


@pytest.mark.parametrize('name', ['timm SwinTransformer', 'timm VisionTransformerSAM', 'timm ConVit', 'timm Eva (EVA-02)',
                                  'timm Beit'])
def test_own_hands_the_trained_tables_back_to_the_models_modules(name):
    build, x = timm_families()[name]
    assert_round_trip(build, x, phi='own')


@pytest.mark.parametrize('name', ['beit', 'data2vec_vision', 'swin'])
def test_transformers_own_puts_the_detached_table_modules_back(name):
    build, x = transformers_families()[f'transformers {name}']
    model = assert_round_trip(build, x, phi='own')
    assert not any(isinstance(m, SwappedAttention) for m in model.modules())


def test_a_named_phi_with_parameters_is_refused_unless_dropped():
    model = randomised(timm_vit()).double()
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', posattn.swap.AddedParametersWarning)
        swap_attention(model, phi='rpb')
    with pytest.raises(ValueError, match=r'no place for 2 trained Φp parameters \(blocks\.0\.attn\.phi\.relative_position_'
                                         r'bias_table, blocks\.1\.attn\.phi\.relative_position_bias_table\).*'
                                         r'drop_phi=True'):
        unswap(model)
    assert isinstance(model.blocks[0].attn, SwappedAttention)  # unchanged by the refusal
    unswap(model, drop_phi=True)
    assert module_classes(model) == module_classes(reference)
    assert_same(outputs(model, image()), outputs(reference, image()))


def test_a_phi_without_parameters_unswaps_without_asking():
    model = randomised(timm_vit()).double()
    unswap(swap_attention(model, phi='alibi'))
    assert not any(isinstance(m, SwappedAttention) for m in model.modules())


def test_own_positions_false_unfreezes_what_it_froze_and_keeps_the_values():
    model = timm_vit()
    model.pos_embed.data.normal_()
    swap_attention(model, phi='none', own_positions=False)
    assert not model.pos_embed.requires_grad
    unswap(model)
    assert model.pos_embed.requires_grad and not model.pos_embed.abs().sum()


def test_hooks_and_config_records_go_and_the_model_swaps_again():
    model = timm_vit()
    swap_attention(model, phi='none')
    tracker = model.blocks[0].attn.grid_tracker
    unswap(model)
    assert not tracker.handles
    assert not model.patch_embed.proj._forward_hooks and not model.blocks[0]._forward_pre_hooks
    swap_attention(model, phi='irpe')
    assert isinstance(model.blocks[1].attn, posattn.Attention)


def test_a_transformers_config_forgets_the_swap():
    pytest.importorskip('transformers', minversion='5')
    from test_swap_hf import MODELS
    model = swap_attention(MODELS['vit'][0](), phi='none')
    assert hasattr(model.config, 'posattn_swap')
    unswap(model)
    assert not hasattr(model.config, 'posattn_swap')


@pytest.mark.parametrize('copied', [copy.deepcopy, lambda model: pickle.loads(pickle.dumps(model))],
                         ids=['deepcopy', 'pickle'])
def test_a_copy_unswaps_alone_on_its_own_device_and_dtype(copied):
    model = randomised(timm_vit())
    swap_attention(model, phi='none')
    copy_ = copied(model).double()
    x = image()
    expected = outputs(copy_, x)
    unswap(copy_)
    assert type(copy_.blocks[0].attn).__name__ == 'Attention' and not copy_.patch_embed.proj._forward_hooks
    assert isinstance(model.blocks[0].attn, SwappedAttention) and model.patch_embed.proj._forward_hooks
    assert all(p.dtype == torch.float64 for p in copy_.parameters())
    assert_same(outputs(copy_, x), expected)


def test_weights_loaded_with_assign_are_the_ones_put_back():
    model = randomised(timm_vit()).double()
    swap_attention(model, phi='none')
    other = {key: torch.randn_like(value) for key, value in model.state_dict().items()}
    model.load_state_dict(other, assign=True)
    unswap(model)
    assert all(torch.equal(model.state_dict()[key], value) for key, value in other.items())


def test_a_layer_that_keeps_no_original_is_an_error_that_changes_nothing():
    model = swap_attention(timm_vit(), phi='none')
    model.blocks[1].attn.original = None  # as a layer unpickled from a posattn without unswap
    with pytest.raises(ValueError, match=r'blocks\.1\.attn is a TimmAttention that keeps no original module'):
        unswap(model)
    assert isinstance(model.blocks[0].attn, SwappedAttention)


def test_a_model_without_a_swap_is_an_error():
    with pytest.raises(ValueError, match='no swapped attention layer to unswap'):
        unswap(timm_vit())
