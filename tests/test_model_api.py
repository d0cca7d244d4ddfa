"""timm's model API written once for the ViT and PerViT: block indices, the Linear init, and the
block stack's loop, intermediates and pruning, on both models and on a toy stack."""
import pytest
import torch
from torch import nn

import posattn
from posattn.grid import TokenGrid
from posattn.models.blocks import init_linear_layers
from posattn.models.model_api import (BlockStackApi, ClassifierApi, resolve_block_indices, take_indices,
                                      tokens_as_map)
from posattn.phi import PositionalModule


def test_resolve_block_indices_counts_negative_ones_from_the_end_in_the_order_given():
    assert resolve_block_indices([11, -1, 0, -12, 3, 3], 12) == [11, 11, 0, 0, 3, 3]
    assert resolve_block_indices(range(-3, 0), 4) == [1, 2, 3]


@pytest.mark.parametrize('indices,shown', [([3, 12], r'\[3, 12\]'), ((-13,), r'\(-13,\)'), ([], r'\[\]')])
def test_resolve_block_indices_names_the_argument_and_the_range(indices, shown):
    with pytest.raises(ValueError, match=rf'^out_indices {shown} must name blocks in 0..11 \(or -12..-1\)$'):
        resolve_block_indices(indices, 12, name='out_indices')


def test_take_indices_is_timm_convention():
    assert take_indices(12) == list(range(12))
    assert take_indices(12, 3) == [9, 10, 11]  # an int: the last n blocks
    assert take_indices(12, [-1, 3, 11, 0]) == [0, 3, 11]  # sorted, repeats once
    with pytest.raises(ValueError, match='asked for the last 13 blocks of 12'):
        take_indices(12, 13)
    with pytest.raises(ValueError, match=r'^indices \[0, -13\] must name blocks in 0..11'):
        take_indices(12, [0, -13])


def test_tokens_as_map_is_row_major():
    tokens = torch.arange(2 * 6 * 3).view(2, 6, 3)  # (B, h*w, C) of a 2x3 grid
    feature_map = tokens_as_map(tokens, TokenGrid(2, 3))
    assert feature_map.shape == (2, 3, 2, 3)
    assert torch.equal(feature_map[1, 2, 1, 0], tokens[1, 3, 2])  # row 1, column 0 is token 3


class _LinearPhi(PositionalModule):
    """A Φp with a Linear of its own, whose initialisation is its own."""

    def __init__(self):
        super().__init__()
        self.table = nn.Linear(3, 3)
        nn.init.constant_(self.table.weight, 7.0)


def test_init_linear_layers_draws_in_module_order_and_leaves_each_phi_alone():
    model = nn.Sequential(nn.Linear(4, 8), _LinearPhi(), nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 2, bias=False)))
    norm_weight = model[2][0].weight.detach().clone()
    torch.manual_seed(3)
    init_linear_layers(model)
    torch.manual_seed(3)
    first, second = torch.empty(8, 4), torch.empty(2, 8)
    nn.init.trunc_normal_(first, std=0.02)
    nn.init.trunc_normal_(second, std=0.02)
    assert torch.equal(model[0].weight, first) and torch.equal(model[2][1].weight, second)
    assert not model[0].bias.any()
    assert (model[1].table.weight == 7.0).all()
    assert torch.equal(model[2][0].weight, norm_weight)


class _ToyBlock(nn.Module):
    """x + tanh(Linear(x)), counting its calls."""

    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.calls = 0

    def forward(self, x, grid):
        self.calls += 1
        return x + torch.tanh(self.fc(x))


class _ToyStack(ClassifierApi, BlockStackApi, nn.Module):
    """Four blocks on a 2x3 grid with one prefix token; the defaults of every optional hook."""

    def __init__(self, dim=4, num_classes=5):
        super().__init__()
        self.embed = nn.Linear(3, dim)
        self.blocks = nn.ModuleList([_ToyBlock(dim) for _ in range(4)])
        self.norm = nn.LayerNorm(dim)
        self.num_features, self.num_classes, self.global_pool = dim, num_classes, 'avg'
        self.head = nn.Linear(dim, num_classes)
        self.grad_checkpointing = False

    def _checked_pool(self, global_pool):
        return global_pool

    def embed_tokens(self, x):
        return self.embed(x), TokenGrid(2, 3, num_prefix_tokens=1)  # (B, 1 + 6, dim)

    def _as_features(self, tokens, grid):
        return tokens

    def _norm_intermediate(self, index, tokens):
        return self.norm(tokens)

    def forward_head(self, x, pre_logits=False):
        x = x[:, 1:].mean(dim=1) if self.global_pool == 'avg' else x
        return x if pre_logits else self.head(x)


def test_block_stack_intermediates_are_the_blocks_outputs():
    model = _ToyStack().eval()
    x = torch.randn(2, 7, 3)
    with torch.no_grad():
        tokens, grid = model.embed_tokens(x)
        outputs = [t for _, t in model.iter_blocks(tokens, grid)]
        final, maps = model._forward_intermediates(x, [-1, 1], norm=True, stop_early=False, output_fmt='NCHW',
                                                   intermediates_only=False, return_prefix_tokens=True)
        nlc = model.forward_intermediates(x, 2, output_fmt='NLC', intermediates_only=True)
        logits = model(x)
    torch.testing.assert_close(final, model.norm(outputs[3]))
    torch.testing.assert_close(model.forward_features(x), final)
    spatial, prefix = maps[0]
    assert spatial.shape == (2, 4, 2, 3) and prefix.shape == (2, 1, 4)
    torch.testing.assert_close(spatial, tokens_as_map(model.norm(outputs[1])[:, 1:], grid))
    torch.testing.assert_close(maps[1][1], model.norm(outputs[3])[:, :1])
    assert len(nlc) == 2
    torch.testing.assert_close(nlc[0], outputs[2][:, 1:])
    torch.testing.assert_close(logits, model.head(final[:, 1:].mean(dim=1)))
    with pytest.raises(ValueError, match="output_fmt must be 'NCHW' or 'NLC', got 'NHWC'"):
        model.forward_intermediates(x, output_fmt='NHWC')


def test_block_stack_stops_early_and_prunes():
    model = _ToyStack().eval()
    x = torch.randn(1, 7, 3)
    with torch.no_grad():
        expected = model.forward_intermediates(x, [0, 1], intermediates_only=True)
        assert [block.calls for block in model.blocks] == [1, 1, 0, 0]
        model.forward_intermediates(x, [1], stop_early=True)
        assert [block.calls for block in model.blocks] == [2, 2, 0, 0]
        assert model.prune_intermediate_layers([0, -3], prune_norm=True) == [0, 1]
        assert len(model.blocks) == 2 and isinstance(model.norm, nn.Identity) and model.num_classes == 0
        for got, want in zip(model.forward_intermediates(x, [0, 1], intermediates_only=True), expected):
            torch.testing.assert_close(got, want)


def test_block_stack_checkpointing_changes_no_gradient():
    model = _ToyStack().train()
    x = torch.randn(2, 7, 3)
    grads = []
    for enable in (False, True):
        model.zero_grad()
        model.set_grad_checkpointing(enable)
        model(x).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert [block.calls for block in model.blocks] == [3, 3, 3, 3]  # the checkpointed pass recomputes each block
    for plain, checkpointed in zip(*grads):
        torch.testing.assert_close(plain, checkpointed)


@pytest.mark.parametrize('name,kwargs', [('vit_tiny', dict(depth=3, peg_after=(0, 2))), ('pervit_tiny', {})])
def test_both_models_prune_to_the_blocks_asked_for(name, kwargs):
    """The ViT's PEGs go with the blocks they follow; PerViT's norm only its last block's output."""
    model = posattn.create_model(name, **kwargs).eval()
    x = torch.randn(1, 3, 48, 64)
    with torch.no_grad():
        before = model.forward_intermediates(x, [0, 1], norm=True, intermediates_only=True)
        model.prune_intermediate_layers([0, 1])
        after = model.forward_intermediates(x, [0, 1], intermediates_only=True)
    assert len(model.blocks) == 2
    if name == 'vit_tiny':
        assert list(model.pegs) == ['0']
        torch.testing.assert_close(before[1].flatten(2).transpose(1, 2),
                                   model.norm(after[1].flatten(2).transpose(1, 2)))
    else:
        torch.testing.assert_close(before[0], after[0])  # not the last block: left as it is
        torch.testing.assert_close(before[1], after[1])
