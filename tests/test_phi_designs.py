"""The peripheral Φp's network designs (PerViT Table 5, bottom): the embedding R (Euc, Lrn), the
neighbourhood N of the projections and the multi-layer design ML, against a per-query float64
formula that evaluates R at every padded key and runs the projections and norms as written."""
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import posattn
from posattn.models.pervit import PerViT
from posattn.phi.peripheral import (DistanceEmbedding, LearnedEmbedding, PeripheralPhi, design_log_attention,
                                    distance_canvas)

from conftest import needs_openmmlab

DESIGNS = list(itertools.product(['euc', 'lrn'], [True, False], [True, False]))  # embedding, N, ML
EPS = 1e-5


def axis_coordinates(length, pad):
    """linspace(-1, 1, n) extended by ``pad`` positions each side (the keys' padding), float64."""
    step = 2.0 / (length - 1) if length > 1 else 2.0
    return torch.arange(-pad, length + pad, dtype=torch.float64) * step - 1.0


def bilinear(table, dy, dx):
    """The table (C, S, S) over offsets [-2, 2]^2 read at (dy, dx), border-clamped: written out."""
    size = table.shape[-1]

    def cell(offset):
        u = min(max((offset / 2 + 1) * (size - 1) / 2, 0.0), size - 1.0)
        low = min(int(math.floor(u)), size - 2)
        return low, u - low

    (i, fi), (j, fj) = cell(dy), cell(dx)
    return ((1 - fi) * (1 - fj) * table[:, i, j] + (1 - fi) * fj * table[:, i, j + 1]
            + fi * (1 - fj) * table[:, i + 1, j] + fi * fj * table[:, i + 1, j + 1])


def instance_norm(x, weight, bias):
    mean = x.mean((-2, -1), keepdim=True)
    var = ((x - mean) ** 2).mean((-2, -1), keepdim=True)
    return (x - mean) / torch.sqrt(var + EPS) * weight[:, None, None] + bias[:, None, None]


def slow_log_phi(phi, height, width):
    """log Φp (heads, HW, HW): for each query, R over its padded keys, then the layers in float64."""
    k = phi.proj2_weight.shape[-1]
    pad = (k - 1) // 2 * (2 if phi.multi_layer else 1)
    rows, cols = axis_coordinates(height, pad), axis_coordinates(width, pad)
    q_rows, q_cols = axis_coordinates(height, 0), axis_coordinates(width, 0)
    embedding = phi.distance_embedding
    out = []
    for qy, qx in itertools.product(q_rows.tolist(), q_cols.tolist()):
        if isinstance(embedding, DistanceEmbedding):
            distances = torch.sqrt((rows[:, None] - qy) ** 2 + (cols[None, :] - qx) ** 2)
            r = embedding.weight.double()[:, :, None] * distances  # (C, H+2pad, W+2pad)
        else:
            table = embedding.table.detach().double()
            r = torch.stack([torch.stack([bilinear(table, y - qy, x - qx) for x in cols.tolist()], -1)
                             for y in rows.tolist()], -2)
        x = r[None]
        if phi.multi_layer:
            x = F.relu(instance_norm(F.conv2d(x, phi.proj1_weight.double()), phi.norm1_weight.double(),
                                     phi.norm1_bias.double()))
        z = instance_norm(F.conv2d(x, phi.proj2_weight.double()), phi.norm2_weight.double(), phi.norm2_bias.double())
        out.append(F.logsigmoid(z)[0].flatten(1))  # (heads, H*W)
    return torch.stack(out, 1)


def random_phi(embedding, neighbourhood, multi_layer, seed=0):
    torch.manual_seed(seed)
    return PeripheralPhi(4, embedding=embedding, neighbourhood=neighbourhood, multi_layer=multi_layer,
                         init='rand').double()


@pytest.mark.parametrize('embedding,neighbourhood,multi_layer', DESIGNS)
@pytest.mark.parametrize('grid', [(4, 5), (1, 3), (6, 6)])
def test_each_design_matches_the_per_query_formula(embedding, neighbourhood, multi_layer, grid):
    phi = random_phi(embedding, neighbourhood, multi_layer)
    with torch.no_grad():
        torch.testing.assert_close(phi.log_position_attention(*grid), slow_log_phi(phi, *grid), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize('neighbourhood,multi_layer', list(itertools.product([True, False], [True, False])))
def test_the_general_path_has_exact_gradients(neighbourhood, multi_layer):
    """torch.autograd.gradcheck of every input: the embedding canvas and each layer's parameters."""
    phi = random_phi('lrn', neighbourhood, multi_layer)
    k = phi.proj2_weight.shape[-1]
    pad = (k - 1) // 2 * (2 if multi_layer else 1)
    canvas = phi.distance_embedding.canvas(2, 3, pad).detach()
    names = ['proj2_weight', 'norm2_weight', 'norm2_bias'] + (['proj1_weight', 'norm1_weight', 'norm1_bias']
                                                              if multi_layer else [])
    inputs = [canvas.requires_grad_()] + [getattr(phi, name).detach().clone().requires_grad_() for name in names]
    # fast mode (random directions) where full Jacobians of 3x3 PP1's 2304 weights would take a minute
    assert torch.autograd.gradcheck(lambda *tensors: design_log_attention(2, 3, *tensors), inputs,
                                    fast_mode=neighbourhood and multi_layer)


def test_pervit_design_takes_the_fast_path_and_the_general_path_agrees():
    phi = random_phi('euc', True, True)
    assert phi.is_pervit_design and phi.design == 'Euc + N + ML'
    for grid in [(5, 6), (1, 4), (7, 7)]:
        general = design_log_attention(*grid, phi.distance_embedding.canvas(*grid, 2), phi.proj2_weight,
                                       phi.norm2_weight, phi.norm2_bias, phi.proj1_weight, phi.norm1_weight,
                                       phi.norm1_bias)
        torch.testing.assert_close(phi.log_position_attention(*grid), general, rtol=1e-10, atol=1e-10)


def test_learned_embedding_starts_as_the_distance_embedding():
    """At init, Lrn's table is -0.02 ||offset||: on the 14 x 14 grid its cells are the offsets of
    the keys, so without padded keys (1x1 projections) the initial Lrn Φp is the Euc Φp there."""
    learned, distance = LearnedEmbedding(16), DistanceEmbedding(16)
    torch.testing.assert_close(learned.canvas(14, 14, 0), distance.canvas(14, 14, 0))
    torch.testing.assert_close(distance.canvas(5, 7, 1)[3], -0.02 * distance_canvas(5, 7, 1))
    assert not torch.allclose(learned.canvas(10, 10, 0), distance.canvas(10, 10, 0))  # interpolated between cells
    euc, lrn = (PeripheralPhi(4, embedding=embedding, neighbourhood=False) for embedding in ('euc', 'lrn'))
    with torch.no_grad():
        torch.testing.assert_close(lrn.log_position_attention(14, 14), euc.log_position_attention(14, 14),
                                   rtol=1e-5, atol=1e-5)


def test_designs_train_in_pervit_and_reach_create_model():
    for embedding, neighbourhood, multi_layer in DESIGNS:
        torch.manual_seed(0)
        model = PerViT(embed_dims=(32, 32), depths=(1, 1), num_heads=4, stem_dims=(8, 16), num_classes=3,
                       phi_embedding=embedding, phi_neighbourhood=neighbourhood, phi_multi_layer=multi_layer)
        phis = [block.attn.phi for block in model.blocks]
        assert all(phi.distance_embedding is None and phi.call_inputs == ('distance_embedding',)
                   for phi in phis)  # one R per model, given with each call
        assert (phis[0].proj1_weight is None) != multi_layer
        assert phis[0].proj2_weight.shape[-1] == (3 if neighbourhood else 1)
        F.cross_entropy(model(torch.randn(2, 3, 20, 24)), torch.tensor([0, 2])).backward()
        assert all(p.grad is not None for p in model.parameters())
    model = posattn.create_model('pervit_tiny', num_classes=0, phi_embedding='lrn', phi_multi_layer=False)
    assert model.blocks[3].attn.phi.design == 'Lrn + N'
    rand = PerViT(embed_dims=(32,), depths=(2,), num_heads=4, stem_dims=(8,), phi_embedding='lrn', phi_init='rand')
    assert rand.distance_embedding.table.std() > 0.5  # drawn, not the -0.02 ||offset|| start


@needs_openmmlab
def test_designs_reach_the_openmmlab_backbone():
    from posattn_openmmlab.backbones import PosattnPerViT
    backbone = PosattnPerViT(phi_embedding='lrn', phi_neighbourhood=False)
    assert backbone.model.blocks[0].attn.phi.design == 'Lrn + ML'
    assert backbone(torch.randn(1, 3, 48, 32))[0].shape == (1, 280, 3, 2)


def test_bad_designs_are_named():
    with pytest.raises(ValueError, match="unknown Φp embedding 'sinusoid'"):
        PeripheralPhi(4, embedding='sinusoid')
    with pytest.raises(ValueError, match="reads a LearnedEmbedding of 16 channels .* got DistanceEmbedding of 16"):
        PeripheralPhi(4, embedding='lrn', shared_embedding=True).log_position_attention(
            3, 3, distance_embedding=DistanceEmbedding(16))
    with pytest.raises(ValueError, match="this Φp is Euc \\+ ML"):
        PeripheralPhi(4, neighbourhood=False).weights()
    with pytest.raises(ValueError, match="unknown phi_embedding 'rope'"):
        PerViT(phi_embedding='rope')
    with pytest.raises(ValueError, match="with phi='none' there is none"):
        PerViT(phi='none', phi_multi_layer=False)
