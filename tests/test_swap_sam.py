"""swap_attention on timm's VisionTransformerSAM (Segment Anything's image encoder): windowed and global
blocks at any input size; 'none' keeps its outputs with its decomposed relative positions (or its RoPE)
kept; phi='own' turns the decomposed embeddings into decomposed_rpb Φp with timm's outputs, weights and
training; every Φp trains; own_positions=False drops the model's positions; refusals name the reason."""
import copy
import warnings

import pytest
import torch
from torch import nn

import posattn
from conftest import assert_trains_with_every_phi, randomised
from posattn.phi.decomposed_rpb import DecomposedRelativePositionBias
from posattn.swap import SwappedAttention, swap_attention
from posattn.swap.timm_sam import SamAttention

timm = pytest.importorskip('timm')


def sam(**kwargs):
    """Three blocks, the second global: a 4 x 4 map at 64 x 64, cut into 3 x 3 windows (padded)."""
    return timm.create_model('samvit_base_patch16', pretrained=False, img_size=64, depth=3, embed_dim=32,
                             num_heads=2, window_size=3, global_attn_indexes=(1,), neck_chans=16, num_classes=5,
                             **kwargs)


def drawn(seed=0, **kwargs):
    """A float64 SAM with every parameter drawn, the embeddings (zero at timm's init) as large as trained ones."""
    model = randomised(sam(**kwargs), seed).double()
    with torch.no_grad():
        for table in embeddings(model):
            table.mul_(20)
    return model


def embeddings(model):
    return [p for n, p in model.named_parameters() if 'rel_pos_' in n]


def images(height=64, width=64, batch=2, dtype=torch.float64):
    return torch.randn(batch, 3, height, width, generator=torch.Generator().manual_seed(1), dtype=dtype)


def layers(model):
    return [m for m in model.modules() if isinstance(m, SwappedAttention)]


def assert_same_outputs(got_model, expected_model, x):
    for training in (False, True):  # no dropout: train mode computes the same
        got_model.train(training), expected_model.train(training)
        with torch.no_grad():
            got, expected = got_model(x), expected_model(x)
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


SIZES = [(64, 64), (48, 80)]  # the global block at the 4 x 4 grid its embeddings are learned for, and at 3 x 5


@pytest.mark.parametrize('size', SIZES)
def test_none_keeps_the_outputs_with_its_own_positions(size):
    model = drawn()
    x = images(*size)
    swapped = swap_attention(copy.deepcopy(model), phi='none')
    assert [type(layer) for layer in layers(swapped)] == [SamAttention] * 3
    assert_same_outputs(swapped, model, x)
    assert set(swapped.state_dict()) == set(model.state_dict())  # timm's names: timm's weights load
    with torch.no_grad():  # the embeddings matter: without them the outputs differ
        dropped = swap_attention(copy.deepcopy(model), phi='none', own_positions=False)(x)
    assert (dropped - model(x)).abs().max() > 1e-3


@pytest.mark.parametrize('size', SIZES)
def test_own_gives_timms_outputs(size):
    """decomposed_rpb computes SAM's term, with its linear resampling of the global block's embeddings."""
    model = drawn()
    swapped = swap_attention(copy.deepcopy(model), phi='own')
    assert all(isinstance(layer.phi, DecomposedRelativePositionBias)
               for layer in layers(swapped))
    assert [layer.phi.table_size for layer in layers(swapped)] == [(3, 3), (4, 4), (3, 3)]
    assert_same_outputs(swapped, model, images(*size))


def test_the_phi_sees_the_window_grid_or_the_maps():
    grids = []
    swapped = swap_attention(sam(), phi='decomposed_rpb', table_size=(3, 3))
    for layer in layers(swapped):
        layer.logits_probe.register_forward_pre_hook(lambda probe, args: grids.append(args[3]))
    with torch.no_grad():
        swapped(images(48, 80, dtype=torch.float32))
    assert grids == [posattn.TokenGrid(3, 3), posattn.TokenGrid(3, 5), posattn.TokenGrid(3, 3)]


def test_own_holds_the_models_embeddings_and_a_step_trains_them():
    model = drawn()
    before = embeddings(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # built before the swap
    swapped = swap_attention(model, phi='own').train()
    held = [t for layer in layers(swapped) for t in (layer.phi.rel_pos_h, layer.phi.rel_pos_w)]
    assert [id(t) for t in held] == [id(t) for t in before]  # the very Parameters, each seen once
    assert all(layer.rel_pos_h is None and layer.rel_pos_w is None for layer in layers(swapped))
    saved = [t.detach().clone() for t in before]
    swapped(images()).square().mean().backward()
    optimizer.step()
    for table, old in zip(before, saved):
        assert table.grad is not None and (table - old).abs().max() > 0


def test_timms_weights_load_strictly_into_own_and_give_timms_outputs():
    swapped = swap_attention(drawn(seed=0), phi='own')
    other = drawn(seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # every Φp key comes from timm's renamed ones: no warning
        swapped.load_state_dict(other.state_dict())
    assert_same_outputs(swapped, other, images(48, 80))
    assert {k for k in swapped.state_dict() if 'rel_pos' in k} == {
        f'blocks.{i}.attn.phi.rel_pos_{axis}' for i in range(3) for axis in 'hw'}


def test_rope_is_kept_and_has_no_conversion():
    model = randomised(sam(use_rel_pos=False, use_rope=True)).double()
    x = images()
    swapped = swap_attention(copy.deepcopy(model), phi='none')
    assert_same_outputs(swapped, model, x)
    with torch.no_grad():
        dropped = swap_attention(copy.deepcopy(model), phi='none', own_positions=False)(x)
    assert (dropped - model(x)).abs().max() > 1e-3
    with pytest.raises(TypeError, match="timm VisionTransformerSAM has none that posattn converts"):
        swap_attention(model, phi='own')


def test_every_phi_trains():
    assert_trains_with_every_phi(lambda: randomised(sam()), images(48, 80, dtype=torch.float32))


def test_own_positions_dropped():
    """The absolute embedding zeroed and frozen, the embeddings frozen, and every parameter left
    trainable gets a gradient; with phi='own' the embeddings are the Φp's and stay trainable."""
    model = randomised(sam())
    swapped = swap_attention(copy.deepcopy(model), phi='rpb', own_positions=False).train()
    assert not swapped.pos_embed.requires_grad and not swapped.pos_embed.any()
    assert not any(t.requires_grad for t in embeddings(swapped))
    swapped(images(dtype=torch.float32)).square().mean().backward()
    assert not [n for n, p in swapped.named_parameters() if p.requires_grad and p.grad is None]
    own = swap_attention(copy.deepcopy(model), phi='own', own_positions=False)
    assert not own.pos_embed.any() and all(t.requires_grad for t in embeddings(own))


def test_gradient_checkpointing_gives_the_same_step():
    model = swap_attention(drawn(), phi='own').train()
    x = images()
    model(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.set_grad_checkpointing(True)
    model(x).sum().backward()
    for got, want in zip([p.grad for p in model.parameters()], expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_block_of_another_attention_is_refused():
    model = sam()
    model.blocks[2].attn = nn.Identity()
    with pytest.raises(TypeError, match=r"block 2 holds torch.nn.modules.linear.Identity, not timm's SAM Attention"):
        swap_attention(model)
    assert not layers(model)  # left as it was
