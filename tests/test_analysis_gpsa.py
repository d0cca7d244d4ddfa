"""posattn.analysis on a Φp that mixes probabilities (gpsa): Φc is the content softmax, Φp the positional
attention, Φa the mixture the layer attends with, and the gate per head is reported; other Φp keep
their outputs."""
import math

import pytest
import torch
from einops import rearrange

import posattn
from posattn import Attention, TokenGrid
from posattn.analysis import attention_maps, collect_attention_maps, measure_attention, plot_position_maps
from posattn.functional import attention_probs
from test_analysis import layer_model


def gpsa_layer(prefix, seed=0):
    torch.manual_seed(seed)
    layer = Attention(32, 4, phi='gpsa', num_prefix_tokens=prefix).double()
    with torch.no_grad():
        layer.qkv.weight.mul_(3)  # content attention far from uniform
        layer.phi.pos_proj.weight.normal_(0, 0.5)
        layer.phi.gating_param.copy_(torch.tensor([-2.0, -0.5, 0.5, 2.0]))
    return layer


@pytest.mark.parametrize('prefix', [0, 1])
def test_gpsa_maps_are_what_the_layer_attends_with(prefix):
    grid = TokenGrid(4, 5, prefix)
    layer = gpsa_layer(prefix)
    x = torch.randn(3, grid.num_tokens, 32, dtype=torch.float64)
    (maps,) = collect_attention_maps(layer_model(layer, grid), x).values()
    q, k, v = rearrange(layer.qkv(x), 'b n (three h d) -> three b h n d', three=3, h=4).unbind(0)
    content = (q @ k.transpose(-2, -1) / math.sqrt(8)).softmax(-1)
    gate = torch.sigmoid(layer.phi.gating_param.detach())
    position = layer.phi.position_attention(4, 5).detach()  # (heads, 20, 20)
    gate_ = gate[:, None, None]
    mixed = (1 - gate_) * content[..., prefix:, :] + gate_ * grid.pad_prefix(position)[:, prefix:]  # grid queries
    mixed = mixed / mixed.sum(-1, keepdim=True)
    cut = slice(prefix, None)
    torch.testing.assert_close(maps.content, content[..., cut, cut].float().detach())
    torch.testing.assert_close(maps.mixed, mixed[..., cut].float().detach())
    torch.testing.assert_close(maps.position, position[None].float())
    torch.testing.assert_close(maps.gate, gate.float())
    assert not torch.allclose(maps.mixed, maps.content, atol=1e-3)
    if not prefix:  # the layer's output is the mixed attention applied to v
        out = layer.proj(rearrange(maps.mixed.double() @ v, 'b h n d -> b n (h d)'))
        torch.testing.assert_close(out, layer(x, grid), rtol=1e-5, atol=1e-6)


def test_gpsa_maps_with_a_key_mask_mix_over_the_kept_keys():
    layer = gpsa_layer(1).float()
    grid = TokenGrid(2, 3, 1)
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 4, 7, 8, generator=generator) for _ in range(2))
    key_mask = torch.tensor([[1, 1, 0, 1, 1, 0, 1], [1] * 7], dtype=torch.bool)
    maps = attention_maps(q, k, None, grid, key_mask, phi=layer.phi)
    expected = layer.phi.mix_probabilities(attention_probs(q, k, None, key_mask), grid, key_mask)[..., 1:, 1:]
    torch.testing.assert_close(maps.mixed, expected.detach())
    assert torch.all(maps.mixed[0][..., [1, 4]] == 0)
    assert attention_maps(q, k, None, grid, key_mask).gate is None  # no Φp given: the content alone
    torch.testing.assert_close(attention_maps(q, k, None, grid, key_mask).mixed, maps.content)


def test_measures_report_the_gate_of_gpsa_and_of_no_other_phi():
    torch.manual_seed(1)
    model = posattn.create_model('vit_tiny', phi='gpsa', img_size=64, depth=2, num_classes=0)
    with torch.no_grad():
        model.blocks[1].attn.phi.gating_param.copy_(torch.tensor([-1.0, 0.0, 3.0]))
    images = torch.randn(2, 3, 64, 64)
    measures = measure_attention(model, [images[:1], images[1:]])
    torch.testing.assert_close(measures[0].gate, torch.full((3,), 1 / (1 + math.exp(-1))))
    torch.testing.assert_close(measures[1].gate, torch.sigmoid(torch.tensor([-1.0, 0.0, 3.0])))
    record = measures[1].to_dict()
    assert record['gate'] == pytest.approx(torch.sigmoid(torch.tensor([-1.0, 0.0, 3.0])).tolist())
    assert len(record['nonlocality_position']) == 3 and len(record['regions']) == 3
    plain = measure_attention(posattn.create_model('vit_tiny', phi='peripheral', img_size=64, depth=1,
                                                   num_classes=0), [images])
    assert plain[0].gate is None and 'gate' not in plain[0].to_dict()


def test_local_gpsa_heads_are_local_in_the_measures():
    """ConViT's local init with a strong locality: Φp of every head stays within its 3x3 neighbourhood,
    so Ω of Φp is small next to that of a uniform map."""
    torch.manual_seed(2)
    layer = Attention(36, 9, phi='gpsa', phi_cfg=dict(locality_strength=4.0))
    (measures,) = measure_attention(layer_model(layer, TokenGrid(6, 6)), [torch.randn(2, 36, 36)])
    uniform = measure_attention(layer_model(Attention(36, 9, phi='gpsa', phi_cfg=dict(local_init=False)),
                                            TokenGrid(6, 6)), [torch.randn(2, 36, 36)])[0]
    assert torch.all(measures.nonlocality_position < 1.5)
    assert torch.all(uniform.nonlocality_position > 2 * measures.nonlocality_position)


def test_a_swapped_convit_is_analysed_and_its_position_maps_drawn(tmp_path):
    timm = pytest.importorskip('timm')
    pytest.importorskip('matplotlib')
    model = timm.create_model('convit_tiny', pretrained=False, depth=3, local_up_to_layer=2, img_size=64,
                              embed_dim=8, num_classes=0)
    posattn.swap_attention(model, phi='own')
    maps = collect_attention_maps(model, torch.randn(1, 3, 64, 64))
    assert [maps[f'blocks.{i}.attn'].gate is not None for i in range(3)] == [True, True, False]
    assert maps['blocks.0.attn'].position.shape == (1, 4, 16, 16) and maps['blocks.2.attn'].position is None
    plot_position_maps(maps, tmp_path / 'position.png')
    assert (tmp_path / 'position.png').stat().st_size > 2000
