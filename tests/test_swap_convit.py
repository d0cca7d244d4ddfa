"""Swapping into timm's ConViT: phi='own' turns each GPSA into the gpsa Φp holding its parameters and
gives timm's outputs; the original weights load; training moves the model's own gates; another Φp
swaps in everywhere, beside the gated attention unless the model's own positions are dropped; a non-square grid, which timm's GPSA cannot take, runs the formula."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import posattn
from posattn.phi import PhiStack
from posattn.phi.gpsa import GatedPositionalAttention
from posattn.phi.none import NoPosition
from posattn.phi.peripheral import PeripheralPhi
from posattn.reference import gpsa_attention

timm = pytest.importorskip('timm')


def small_convit(img_size=64, seed=0):
    """A float64 convit_tiny of 3 blocks (2 GPSA, then 1 MHSA with the class token), 4 heads of 8
    channels, with drawn weights: sharp content attention, varied gates, a pos_proj bias."""
    torch.manual_seed(seed)
    model = timm.create_model('convit_tiny', pretrained=False, depth=3, local_up_to_layer=2, img_size=img_size,
                              embed_dim=8, num_classes=5).double().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1 and 'pos_proj' not in name:
                param.normal_(0, 0.3)
        for i, block in enumerate(model.blocks[:2]):
            block.attn.gating_param.copy_(torch.tensor([-3.0, -0.5, 0.5, 2.0], dtype=torch.float64) + i)
            block.attn.pos_proj.bias.normal_()
    return model


def relative_error(got, expected):
    return ((got - expected).abs().max() / expected.abs().max()).item()


def test_own_gives_timms_outputs():
    model = small_convit()
    images = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    with torch.no_grad():
        expected = model(images)
        swapped = posattn.swap_attention(copy.deepcopy(model), phi='own')
        assert relative_error(swapped(images), expected) < 1e-10


def test_own_holds_the_gpsa_parameters_and_says_each_sites_prefix():
    model = small_convit()
    gpsa = [block.attn for block in model.blocks[:2]]
    posattn.swap_attention(model, phi='own')
    layers = [block.attn for block in model.blocks]
    for layer, old in zip(layers[:2], gpsa):
        assert isinstance(layer.phi, GatedPositionalAttention) and layer.num_prefix_tokens == 0
        assert layer.phi.pos_proj is old.pos_proj and layer.phi.gating_param is old.gating_param
        assert layer.qk is old.qk and layer.v is old.v and layer.qkv is None
    assert isinstance(layers[2].phi, NoPosition) and layers[2].num_prefix_tokens == 1
    keys = [key for key in model.state_dict() if key.startswith('blocks.0.attn.')]
    assert sorted(keys) == ['blocks.0.attn.phi.gating_param', 'blocks.0.attn.phi.pos_proj.bias',
                            'blocks.0.attn.phi.pos_proj.weight', 'blocks.0.attn.proj.bias',
                            'blocks.0.attn.proj.weight', 'blocks.0.attn.qk.weight', 'blocks.0.attn.v.weight']


def test_the_original_weights_load_strictly_into_the_converted_model():
    model = small_convit()
    original = copy.deepcopy(model.state_dict())
    swapped = posattn.swap_attention(small_convit(seed=1), phi='own')
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # every key is found: no Φp is left at its initialisation
        swapped.load_state_dict(original, strict=True)
    images = torch.randn(1, 3, 64, 64, dtype=torch.float64)
    with torch.no_grad():
        assert relative_error(swapped(images), model(images)) < 1e-10
    swapped.load_state_dict(swapped.state_dict(), strict=True)


def test_a_training_step_moves_the_models_own_gates():
    model = small_convit().train()
    gate, weight = model.blocks[0].attn.gating_param, model.blocks[0].attn.pos_proj.weight
    before = gate.detach().clone(), weight.detach().clone()
    posattn.swap_attention(model, phi='own')
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = F.cross_entropy(model(torch.randn(2, 3, 64, 64, dtype=torch.float64)), torch.tensor([0, 3]))
    loss.backward()
    optimizer.step()
    assert model.blocks[0].attn.phi.gating_param is gate
    assert not torch.equal(gate, before[0]) and not torch.equal(weight, before[1])


def test_own_positions_false_drops_the_absolute_embedding_alone():
    model = small_convit()
    gate = model.blocks[0].attn.gating_param
    posattn.swap_attention(model, phi='own', own_positions=False)
    assert torch.all(model.pos_embed == 0) and not model.pos_embed.requires_grad
    assert gate.requires_grad and model.blocks[1].attn.phi.pos_proj.weight.requires_grad  # the converted scheme


def test_another_phi_swaps_in_beside_the_gated_attention():
    """The GPSA's gated positional attention is ConViT's own positional term: kept beside another Φp
    (phi='none' gives timm's outputs), trained with it, dropped and frozen with own_positions=False."""
    model = small_convit()
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    with torch.no_grad():
        expected = model(x)
        kept = posattn.swap_attention(copy.deepcopy(model), phi='none')
        assert relative_error(kept(x), expected) < 1e-10
    original = copy.deepcopy(model.state_dict())
    posattn.swap_attention(model, phi='peripheral')
    layers = [block.attn for block in model.blocks]
    # a GPSA block's gated attention comes first in its stack, an MHSA block has the Φp alone
    assert [type(layer.phi) for layer in layers] == [PhiStack, PhiStack, PeripheralPhi]
    assert all(isinstance(layer.phi[0], GatedPositionalAttention) for layer in layers[:2])
    named = [layers[0].phi[1], layers[1].phi[1], layers[2].phi]
    assert [phi.num_heads for phi in named] == [4, 4, 4]
    assert [layer.num_prefix_tokens for layer in layers] == [0, 0, 1]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "blocks\.0\.attn\.phi\.1\.proj1_weight"'):
        model.load_state_dict(original, strict=True)  # strict: the Φp's keys are not in ConViT's weights
    with pytest.warns(UserWarning, match='the loaded weights hold no Φp keys'):
        fresh = posattn.load_original_weights(model, original)  # timm's names of the GPSA's parameters are renamed
    assert len(fresh) == 21 and all('.attn.phi.' in key for key in fresh)  # 3 layers x 7 peripheral parameters
    model.train()
    loss = F.cross_entropy(model(x), torch.tensor([1, 2]))
    loss.backward()
    assert torch.isfinite(loss) and named[0].norm2_bias.grad.abs().sum() > 0
    assert layers[0].phi[0].gating_param.grad.abs().sum() > 0

    dropped = posattn.swap_attention(small_convit(), phi='peripheral', own_positions=False).train()
    unused = [*dropped.blocks[0].attn.own_gpsa.parameters()]
    assert unused and not any(param.requires_grad for param in unused)
    F.cross_entropy(dropped(x), torch.tensor([1, 2])).backward()
    assert all(param.grad is None for param in unused)


def test_a_non_square_grid_runs_the_gpsa_formula():
    """timm's GPSA assumes a square grid; swapped, a ConViT for 64 x 48 images attends on its 4 x 3 grid."""
    model = posattn.swap_attention(small_convit(img_size=(64, 48)), phi='own')
    seen = []
    model.blocks[0].attn.register_forward_hook(lambda module, args, out: seen.append((args[0], out)))
    with torch.no_grad():
        model(torch.randn(2, 3, 64, 48, dtype=torch.float64))
    (x, out), = seen
    layer = model.blocks[0].attn
    qkv_weight = torch.cat([layer.qk.weight, layer.v.weight])
    expected = gpsa_attention(x, qkv_weight, None, layer.proj.weight, layer.proj.bias, 4,
                              layer.phi.pos_proj.weight, layer.phi.pos_proj.bias, layer.phi.gating_param, 4, 3)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_a_block_with_another_attention_is_refused():
    model = small_convit()
    model.blocks[1].attn = torch.nn.Identity()
    with pytest.raises(TypeError, match=r"block 1 holds torch.nn.modules.linear.Identity, not timm's ConViT GPSA "
                                        r'or MHSA'):
        posattn.swap_attention(model, phi='own')
    assert isinstance(model.blocks[0].attn, timm.models.convit.GPSA)  # nothing changed
