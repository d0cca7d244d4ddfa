"""swap_attention(model, phi='own') on timm's Eva: the RoPE of EVA-02, of the axial and mixed RoPE
ViTs (one with a register token) and of a Perception Encoder becomes the rope Φp of every layer, and
the model's outputs stay its own, at its size and at another; its weights load as they are; the
mixed frequencies stay the model's tensor and train; the RoPEs the rope Φp does not compute are
refused with the reason."""
import copy

import pytest
import torch
import torch.nn.functional as F

import posattn
from conftest import randomised
from posattn.phi.rope import RotaryPositionEmbedding
from posattn.swap.given import GivenRotation
from posattn.swap import swap_attention

timm = pytest.importorskip('timm')
from timm.layers import RotaryEmbeddingMixed, build_rotary_pos_embed  # noqa: E402
from timm.layers.pos_embed_sincos import get_mixed_grid  # noqa: E402

SMALL = dict(pretrained=False, depth=2, num_classes=5)
# name: (build, the model's input size, another size, the settings of its rope Φp). The sizes keep
# the coordinates exact in float32 (powers of two between grid and reference grid): timm's grid.
MODELS = {
    'eva02': (lambda **kw: timm.create_model('eva02_tiny_patch14_224', img_size=56, **SMALL, **kw),
              (56, 56), (28, 112), dict(frequencies='axial', temperature=10000.0, reference_grid=(16, 16),
                                        axis_order='yx', pairing='interleaved')),
    'eva02_rotate_half': (lambda **kw: timm.create_model('eva02_tiny_patch14_224', img_size=56, rope_rotate_half=True,
                                                         **SMALL, **kw),
                          (56, 56), (28, 112), dict(pairing='halves')),
    'perception_encoder': (lambda **kw: timm.create_model('vit_pe_core_tiny_patch16_384', img_size=64, **SMALL, **kw),
                           (64, 64), (32, 128), dict(position_offset=1.0, reference_grid=(24, 24), axis_order='xy')),
    'rope_axial': (lambda **kw: timm.create_model('vit_small_patch16_rope_224', img_size=64, embed_dim=64, num_heads=4,
                                                  **SMALL, **kw),
                   (64, 64), (48, 80), dict(frequencies='axial', temperature=100.0, reference_grid=None,
                                            axis_order='xy')),
    'rope_registers': (lambda **kw: timm.create_model('vit_medium_patch16_rope_reg1_gap_256', img_size=64, embed_dim=64,
                                                      num_heads=4, **SMALL, **kw),
                       (64, 64), (32, 128), dict(frequencies='axial', temperature=10000.0, reference_grid=(16, 16),
                                                 axis_order='yx')),
    'rope_mixed': (lambda **kw: timm.create_model('vit_small_patch16_rope_mixed_224', img_size=64, embed_dim=64,
                                                  num_heads=4, **SMALL, **kw),
                   (64, 64), (48, 80), dict(frequencies='mixed', axis_order='xy')),
}


def nontrivial(model):
    """Random weights whose RoPE matters: large queries and keys, mixed frequencies of order one."""
    model = randomised(model)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(('attn.qkv.weight', 'attn.q_proj.weight', 'attn.k_proj.weight')):
                param.mul_(8)
        if isinstance(model.rope, RotaryEmbeddingMixed):
            model.rope.freqs.copy_(torch.randn(model.rope.freqs.shape, generator=generator))
    return model


def image(size, dtype=torch.float32):
    return torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(1), dtype=dtype)


def rope_tables_in_float64(model):
    """timm forms its RoPE tables in float32 whatever the model's dtype: for a float64 comparison,
    ``model.rope.get_embed`` forms them with timm's own builders in float64 (timm's grid, layout and
    application; frequency bands in float64)."""
    rope = model.rope
    if isinstance(rope, RotaryEmbeddingMixed):
        def get_embed(shape=None, dtype=None):
            t_x, t_y = get_mixed_grid(list(shape or rope.feat_shape), grid_indexing=rope.grid_indexing,
                                      dtype=torch.float64)
            angles = t_x[:, None] * rope.freqs[0][..., None, :] + t_y[:, None] * rope.freqs[1][..., None, :]
            return torch.cat([angles.sin().repeat_interleave(2, -1), angles.cos().repeat_interleave(2, -1)], -1)
    else:
        count = rope.dim // 4
        bands = 1.0 / rope.temperature ** (torch.arange(count, dtype=torch.float64) / count)

        def get_embed(shape=None, dtype=None):
            sin, cos = build_rotary_pos_embed(list(shape or rope.feat_shape), bands=bands, in_pixels=False,
                                              ref_feat_shape=rope.ref_feat_shape, grid_offset=rope.grid_offset,
                                              grid_indexing=rope.grid_indexing, rotate_half=rope.rotate_half,
                                              dtype=torch.float64)
            return torch.cat([sin, cos], -1)
    rope.get_embed = get_embed
    return model


def own_and_original(name, dtype=torch.float32, **kw):
    """The converted model and the original, both in eval mode."""
    build = MODELS[name][0]
    original = nontrivial(build(**kw)).to(dtype)
    converted = swap_attention(copy.deepcopy(original), phi='own').eval()
    return converted, original


def relative_error(got, expected):
    return ((got - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize('name', list(MODELS))
@pytest.mark.parametrize('size', ['model', 'other'])
def test_outputs_are_the_models_in_float64(name, size):
    """To 1e-10 relative, with timm's tables formed in float64; at the model's own size, and, built
    with dynamic_img_size, at another. Without the converted RoPE the outputs differ."""
    _, model_size, other_size, _ = MODELS[name]
    dynamic = dict(dynamic_img_size=True) if size == 'other' else {}
    converted, original = own_and_original(name, torch.float64, **dynamic)
    x = image(model_size if size == 'model' else other_size, torch.float64)
    without = swap_attention(copy.deepcopy(original), phi='none', own_positions=False).eval()
    rope_tables_in_float64(original)
    rope_tables_in_float64(converted)  # RoPE-Mixed's: the model's, given to each block's Φp
    with torch.no_grad():
        expected, got = original(x), converted(x)
        assert relative_error(got, expected) < 1e-10
        assert relative_error(without(x), expected) > 1e-3


@pytest.mark.parametrize('name', list(MODELS))
def test_outputs_are_timms_in_float32(name):
    """timm as it is, tables in float32: the rope Φp computes them with timm's operations in its order."""
    other_size = MODELS[name][2]
    converted, original = own_and_original(name, dynamic_img_size=True)
    with torch.no_grad():
        torch.testing.assert_close(converted(image(other_size)), original(image(other_size)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('name', list(MODELS))
def test_each_layer_holds_the_rope_of_the_models_settings(name):
    converted, _ = own_and_original(name)
    settings = MODELS[name][3]
    for index, block in enumerate(converted.blocks):
        phi = block.attn.phi
        if settings.get('frequencies') == 'mixed':  # the model owns the frequencies and gives each block its RoPE
            assert isinstance(phi, GivenRotation) and phi.call_inputs == ('rope',) and not list(phi.parameters())
            continue
        assert isinstance(phi, RotaryPositionEmbedding)
        assert all(getattr(phi, option) == value for option, value in settings.items())


@pytest.mark.parametrize('name', list(MODELS))
def test_the_original_weights_load_strictly(name):
    converted, original = own_and_original(name)
    assert set(converted.state_dict()) == set(original.state_dict())
    fresh = swap_attention(MODELS[name][0](), phi='own').eval()
    fresh.load_state_dict(original.state_dict())
    x = image(MODELS[name][1])
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), converted(x), rtol=0, atol=0)


def test_a_training_step_updates_the_models_mixed_frequencies():
    converted, _ = own_and_original('rope_mixed')
    freqs = converted.rope.freqs
    assert [name for name, param in converted.named_parameters() if param is freqs] == ['rope.freqs']
    before = freqs.detach().clone()
    optimizer = torch.optim.SGD(converted.parameters(), lr=0.1)
    loss = F.cross_entropy(converted.train()(image((64, 64))), torch.tensor([1, 3]))
    loss.backward()
    assert torch.isfinite(loss) and torch.all(freqs.grad.abs().sum((0, 2, 3)) > 0)  # every layer's slice
    optimizer.step()
    assert converted.rope.freqs is freqs and (freqs.detach() - before).abs().min() > 0


def test_a_copy_reads_its_own_frequencies():
    """The frequencies are the model's, its RoPE given to each block with the call: a copy reads its own."""
    converted, _ = own_and_original('rope_mixed')
    copied = copy.deepcopy(converted)
    with torch.no_grad():
        copied.rope.freqs.mul_(2)
        x = image((64, 64))
        assert not torch.allclose(copied(x), converted(x))
        converted.rope.freqs.mul_(2)
        torch.testing.assert_close(copied(x), converted(x), rtol=0, atol=0)


def tiny_eva(**kw):
    return timm.models.eva.Eva(**dict(dict(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2,
                                           num_classes=5, use_abs_pos_emb=False, use_rot_pos_emb=True), **kw))


def with_rope(rope):
    model = tiny_eva()
    model.rope = rope
    return model


@pytest.mark.parametrize('build,reason', [
    (lambda: tiny_eva(rope_type='dinov3', rope_rotate_half=True),
     "cannot convert this Eva's RotaryEmbeddingDinoV3: DINOv3's RoPE .* centres the coordinates"),
    (lambda: tiny_eva(rope_type='mrope'),
     "cannot convert this Eva's RotaryEmbeddingMRope: MRoPE .* strided interleave"),
    (lambda: tiny_eva(rope_shift_coords=1.0), 'augments its coordinates while training'),
    (lambda: with_rope(timm.layers.RotaryEmbeddingCat(16, in_pixels=True)),
     "converts RoPE on grid indices; this Eva's RotaryEmbeddingCat has in_pixels=True, grid_type='pixel'"),
    (lambda: with_rope(timm.layers.RotaryEmbedding(16, in_pixels=False)),
     "converts timm's RotaryEmbeddingCat and RotaryEmbeddingMixed, not this Eva's .*RotaryEmbedding;"),
])
def test_ropes_the_phi_does_not_compute_are_refused_with_the_reason(build, reason):
    model = build()
    with pytest.raises(TypeError, match=reason):
        swap_attention(model, phi='own')
    assert not any(isinstance(m, posattn.swap.SwappedAttention) for m in model.modules())  # left as it was
    swap_attention(model, phi='peripheral')  # any named Φp still swaps in


def test_an_eva_without_rope_has_nothing_to_convert():
    with pytest.raises(TypeError, match="phi='own' converts .* timm Eva has none that posattn converts"):
        swap_attention(tiny_eva(use_rot_pos_emb=False, use_abs_pos_emb=True), phi='own')


@pytest.mark.parametrize('phi', ['own', 'peripheral'])
def test_own_positions_dropped_keep_the_converted_rope_alone(phi):
    """own_positions=False zeroes the absolute embedding; the mixed frequencies train in the converted
    model and are frozen where a named Φp replaces the RoPE: no trainable parameter is left unused."""
    model = nontrivial(MODELS['rope_mixed'][0](use_abs_pos_emb=True))
    swapped = swap_attention(model, phi=phi, own_positions=False).train()
    swapped(image((64, 64))).square().mean().backward()
    assert not swapped.pos_embed.requires_grad and not swapped.pos_embed.any()
    assert swapped.rope.freqs.requires_grad == (phi == 'own')
    assert not [name for name, p in swapped.named_parameters() if p.requires_grad and p.grad is None]
