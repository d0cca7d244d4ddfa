"""Caches are never stale, never poisoned and bounded.

Without :func:`posattn.cache_positions` every call computes its Φp bias, so no way of changing a
weight (parametrizations, pruning, hooks that edit the bias) can leave a stale one. Inside it, the
bias is reused only while the tensors it was computed from are unchanged. Every result is compared
with a freshly built layer holding the same weights.
"""
import contextlib
import copy
import io
import itertools
import threading

import pytest
import torch
from torch.nn.utils import parametrize

import posattn
from posattn import Attention, cache_positions
from posattn._cache import grid_constant
from posattn.phi.cache import PositionCache
from posattn.phi.irpe import bucket_ids
from posattn.phi.peripheral_kernel import _grid_moments

GRID = (4, 5)
CACHED = ['uncached', 'cached']


def peripheral_layer(seed=0):
    torch.manual_seed(seed)
    return Attention(32, 4, phi='peripheral', num_prefix_tokens=1).eval()


def tokens(seed=1):
    return torch.randn(2, 1 + GRID[0] * GRID[1], 32, generator=torch.Generator().manual_seed(seed))


def fresh_output(layer, x, grid=GRID):
    """The output of a newly built layer with ``layer``'s current weights (nothing cached)."""
    fresh = Attention(32, 4, phi='peripheral', num_prefix_tokens=1).to(layer.qkv.weight.dtype).eval()
    fresh.load_state_dict(copy.deepcopy(layer.state_dict()))
    with torch.no_grad():
        return fresh(x.to(layer.qkv.weight.dtype), grid)


def output(layer, x, grid=GRID):
    with torch.no_grad():
        return layer(x, grid)


def assert_fresh(layer, x, grid=GRID):
    """The layer gives what a fresh layer with its weights gives, bit for bit."""
    out = output(layer, x, grid)
    assert torch.equal(out, fresh_output(layer, x, grid))
    return out


@pytest.fixture(params=CACHED)
def scope(request):
    """A function that opens the scope a test runs its layer in: with or without the cache."""
    if request.param == 'uncached':
        return lambda layer: contextlib.nullcontext()
    return cache_positions


def random_gradients(layer):
    for p in layer.parameters():
        p.grad = torch.randn_like(p)


class Scale(torch.nn.Module):
    """A parametrization whose state is a buffer, not a parameter."""

    def __init__(self):
        super().__init__()
        self.register_buffer('scale', torch.tensor(1.0))

    def forward(self, value):
        return value * self.scale


def test_the_cache_serves_the_bias_again_per_grid():
    layer, x = peripheral_layer(), tokens()
    q = torch.randn(2, 4, 21, 8)
    with cache_positions(layer) as cache, torch.no_grad():
        first = layer.phi.logits_bias(q, q, posattn.TokenGrid(4, 5, 1))
        assert layer.phi.logits_bias(q, q, posattn.TokenGrid(4, 5, 1)) is first
        other = layer.phi.logits_bias(q, q, posattn.TokenGrid(5, 4, 1))
        assert other is not first and other.shape == first.shape == (1, 4, 21, 21)
        assert len(cache) == 2 and cache.nbytes == 2 * first.numel() * 4
        assert_fresh(layer, x)
    assert layer.phi.position_cache is None and len(cache) == 0 and cache.nbytes == 0
    assert layer.phi.logits_bias(q, q, posattn.TokenGrid(4, 5, 1)) is not first


def test_nothing_is_kept_without_the_cache():
    layer = peripheral_layer()
    q = torch.randn(2, 4, 21, 8)
    with torch.no_grad():
        first = layer.phi.logits_bias(q, q, posattn.TokenGrid(4, 5, 1))
        assert layer.phi.logits_bias(q, q, posattn.TokenGrid(4, 5, 1)) is not first
    assert not [v for v in vars(layer.phi).values() if isinstance(v, (torch.Tensor, PositionCache))]


OPTIMISERS = {
    'fused-adamw': lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True),
    'fused-sgd': lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True),
    'foreach-adamw': lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=True),
    'sgd': lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False),
}


@pytest.mark.parametrize('scope,optimiser', [
    *((lambda layer: contextlib.nullcontext(), name) for name in OPTIMISERS),
    # Fused optimisers write without autograd's version counts: the cache cannot see their steps.
    *((cache_positions, name) for name in OPTIMISERS if not name.startswith('fused')),
], ids=[*(f'uncached-{name}' for name in OPTIMISERS),
        *(f'cached-{name}' for name in OPTIMISERS if not name.startswith('fused'))])
def test_optimiser_steps_are_seen(scope, optimiser):
    optimiser = OPTIMISERS[optimiser]
    layer, x = peripheral_layer(), tokens()
    step = optimiser(list(layer.parameters()))
    with scope(layer):
        before = output(layer, x)
        for _ in range(2):
            random_gradients(layer)
            step.step()
            assert not torch.equal(assert_fresh(layer, x), before)


def test_load_state_dict_dtype_moves_and_in_place_writes_are_seen(scope):
    layer, x = peripheral_layer(0), tokens()
    with scope(layer):
        before = output(layer, x)
        layer.load_state_dict(peripheral_layer(3).state_dict())
        after = assert_fresh(layer, x)
        assert not torch.equal(after, before)
        layer.load_state_dict(peripheral_layer(4).state_dict(), assign=True)
        assert not torch.equal(assert_fresh(layer, x), after)
        with torch.no_grad():
            layer.phi.distance_embedding.weight.mul_(2)
        assert_fresh(layer, x)
        layer.double()
        assert assert_fresh(layer, x.double()).dtype == torch.float64
        layer.float()
        assert_fresh(layer, x)


def test_data_writes_are_seen_without_the_cache_and_after_clear():
    """Writes through ``.data`` bypass autograd's version counters, which the cache reads: the
    documented remedy inside the cache is ``clear()``."""
    layer, x = peripheral_layer(), tokens()
    before = output(layer, x)
    layer.phi.norm2_bias.data.add_(3.0)
    assert not torch.equal(assert_fresh(layer, x), before)
    with cache_positions(layer) as cache:
        output(layer, x)
        layer.phi.norm2_bias.data.add_(3.0)
        cache.clear()
        assert_fresh(layer, x)


def test_a_parametrization_whose_state_is_a_buffer_is_seen(scope):
    layer, x = peripheral_layer(), tokens()
    parametrize.register_parametrization(layer.phi, 'norm2_bias', Scale())
    with scope(layer):
        before = output(layer, x)
        layer.phi.parametrizations.norm2_bias[0].scale.fill_(0.25)
        after = output(layer, x)
    assert not torch.equal(after, before)
    plain = peripheral_layer()
    with torch.no_grad():
        plain.phi.norm2_bias.mul_(0.25)
    assert torch.equal(after, output(plain, x))


def test_masking_by_parametrization_applies_and_trains(scope):
    """A pruning mask as a parametrization (applied at every read; prune's hooks are refused on a Φp)."""
    class Mask(torch.nn.Module):
        def __init__(self, mask):
            super().__init__()
            self.register_buffer('mask', mask)

        def forward(self, value):
            return value * self.mask

    layer, x = peripheral_layer(), tokens()
    mask = (torch.rand_like(layer.phi.proj2_weight, generator=None) > 0.5).float()
    parametrize.register_parametrization(layer.phi, 'proj2_weight', Mask(mask))
    with scope(layer):
        masked = output(layer, x)
    plain = peripheral_layer()
    with torch.no_grad():
        plain.phi.proj2_weight.mul_(mask)
    assert torch.equal(masked, output(plain, x))
    layer.train()
    step = torch.optim.SGD(layer.parameters(), lr=0.1)
    for _ in range(2):
        layer(x, GRID).square().sum().backward()
        step.step()
        step.zero_grad()
    assert torch.all(layer.phi.proj2_weight[mask == 0] == 0)


def test_a_hook_that_edits_the_bias_in_place_changes_only_its_own_call(scope):
    layer, x = peripheral_layer(), tokens()
    expected = fresh_output(layer, x)

    def ablate(module, args):
        args[2].zero_()  # (q, k, bias, grid): the bias, edited in place for this call

    with scope(layer):
        output(layer, x)
        handle = layer.logits_probe.register_forward_pre_hook(ablate)
        ablated = output(layer, x)
        handle.remove()
        assert not torch.equal(ablated, expected)
        assert torch.equal(output(layer, x), expected)
        assert torch.equal(output(layer, x), expected)


def test_requires_grad_decides_whether_the_bias_is_cached():
    layer, x = peripheral_layer(), tokens()
    q = torch.randn(2, 4, 21, 8)
    with cache_positions(layer) as cache:
        layer(x, GRID).sum().backward()  # eval, but the bias needs its gradient: not cached
        assert len(cache) == 0 and layer.phi.norm2_weight.grad is not None
        layer.phi.requires_grad_(False)
        first = layer.phi.logits_bias(q, q, posattn.TokenGrid(4, 5, 1))  # frozen Φp: cached although autograd is on
        assert len(cache) == 1 and layer.phi.logits_bias(q, q, posattn.TokenGrid(4, 5, 1)) is first
        layer.train()
        assert layer.phi.logits_bias(q, q, posattn.TokenGrid(4, 5, 1)) is not first


def test_the_byte_budget_holds():
    layer, x = peripheral_layer(), tokens()
    one_bias = 4 * 21 * 21 * 4  # (1, heads, N, N) float32 at 4x5 with a class token
    with cache_positions(layer, max_bytes=one_bias) as cache:
        output(layer, x)
        output(layer, x.flip(1), (5, 4))
        assert len(cache) == 1 and cache.nbytes == one_bias  # the older grid was evicted
        assert_fresh(layer, x)
    with cache_positions(layer, max_bytes=one_bias - 1) as cache:
        output(layer, x)
        assert len(cache) == 0  # larger than the whole budget: never kept


def test_grid_constants_are_bounded_in_bytes():
    calls = []

    @grid_constant(max_bytes=1000)
    def ones(n):
        calls.append(n)
        return torch.ones(n, dtype=torch.float64)

    ones(100), ones(20), ones(100)
    assert calls == [100, 20] and ones.cache_nbytes() == 800 + 160
    ones(50)  # 400 more bytes: the least recently used go until the rest fits
    assert calls == [100, 20, 50] and ones.cache_nbytes() == 400
    ones(20), ones(200), ones(200)
    assert calls[-3:] == [20, 200, 200] and ones.cache_nbytes() == 400 + 160  # 1600 bytes: never kept
    bucket_ids.cache_clear()
    bucket_ids(40, 40, 1, 'product', 1.9)
    assert bucket_ids.cache_nbytes() == 1601 ** 2 * 8


@pytest.mark.parametrize('phi,cfg', [('peripheral', {}), ('irpe', dict(mode='bias', on='qk'))])
def test_threads_share_one_cache_safely(phi, cfg):
    torch.manual_seed(0)
    layer = Attention(32, 4, phi=phi, phi_cfg=cfg, num_prefix_tokens=1).eval()
    grids = [(4, 5), (5, 4), (2, 10), (10, 2), (3, 3), (6, 2), (2, 6), (1, 7)]
    inputs = [torch.randn(2, 1 + h * w, 32) for h, w in grids]
    expected = [output(layer, x, grid) for x, grid in zip(inputs, grids)]
    errors, mismatches = [], []

    def run(pairs):
        try:
            for _ in range(20):
                for i in pairs:
                    if not torch.equal(output(layer, inputs[i], grids[i]), expected[i]):
                        mismatches.append(i)
        except Exception as error:  # reported below
            errors.append(error)

    one_bias = 4 * 21 * 21 * 4
    with cache_positions(layer, max_bytes=3 * one_bias):  # evictions while other threads read
        threads = [threading.Thread(target=run, args=([2 * t, 2 * t + 1],)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not errors and not mismatches


@pytest.mark.parametrize('how', ['deepcopy', 'torch.save'])
def test_a_copy_made_inside_a_block_carries_no_cache_out(how):
    """A copy is not attached: it computes every call, exact after its weights change."""
    layer, x = peripheral_layer(), tokens()
    with cache_positions(layer) as cache:
        output(layer, x)
        if how == 'deepcopy':
            clone = copy.deepcopy(layer)
        else:
            buffer = io.BytesIO()
            torch.save(layer, buffer)
            buffer.seek(0)
            clone = torch.load(buffer, weights_only=False)
        assert clone.phi.position_cache is None and len(cache) == 1
        assert torch.equal(output(clone, x), output(layer, x))
    assert layer.phi.position_cache is None and clone.phi.position_cache is None
    output(clone, x)
    with torch.no_grad():
        clone.phi.norm2_bias.add_(1.0)
        clone.phi.proj2_weight.data.mul_(2.0)  # a write no version counter sees
    assert_fresh(clone, x)


@pytest.mark.parametrize('round_trip', ['double', 'half', 'bfloat16'])
def test_a_dtype_round_trip_inside_a_block_serves_no_earlier_bias(round_trip):
    layer, x = peripheral_layer(), tokens()
    with cache_positions(layer):
        output(layer, x)
        getattr(layer, round_trip)().float()  # the weights are rounded (or not) and back
        assert_fresh(layer, x)


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_a_converted_learned_rope_is_served_its_own_rotation(dtype):
    """RoPE-Mixed converted to half precision inside a block rotates by its rounded frequencies."""
    torch.manual_seed(0)
    layer = Attention(32, 2, phi='rope', phi_cfg=dict(frequencies='mixed')).eval()
    x = torch.randn(2, 20, 32)
    with cache_positions(layer):
        output(layer, x)
        layer.to(dtype)
        cached = output(layer, x.to(dtype))
    torch.testing.assert_close(cached, output(layer, x.to(dtype)), rtol=0, atol=0)


@pytest.mark.parametrize('name,kwargs', [('pervit_tiny', {}),
                                         ('vit_tiny', dict(phi='irpe', phi_cfg=dict(mode='ctx', on='qkv')))])
def test_inference_mode_does_not_poison_later_training(name, kwargs):
    torch.manual_seed(0)
    first = posattn.create_model(name, **kwargs).eval()
    with torch.inference_mode(), cache_positions(first):
        first(torch.randn(1, 3, 64, 64))
    second = posattn.create_model(name, **kwargs)
    second(torch.randn(2, 3, 64, 64)).sum().backward()  # grid constants made under inference_mode would fail here
    assert all(p.grad is not None for n, p in second.named_parameters() if 'phi' in n and 'bias' not in n)
    with torch.no_grad():
        first(torch.randn(1, 3, 64, 64))


@pytest.mark.slow
@pytest.mark.parametrize('name,kwargs', [('pervit_tiny', {}), ('vit_tiny', dict(phi='irpe')),
                                         ('vit_tiny', dict(phi='peg'))], ids=['pervit_tiny', 'irpe', 'peg'])
def test_export_works_and_leaves_eager_results_untouched(name, kwargs):
    _grid_moments.cache_clear()  # the export is the first to ask for this grid's constants
    bucket_ids.cache_clear()
    torch.manual_seed(0)
    model = posattn.create_model(name, **kwargs).eval()
    x = torch.randn(1, 3, 64, 80)
    exported = torch.export.export(model, (x,))
    with torch.no_grad():
        after = model(x)
    reference = posattn.create_model(name, **kwargs).eval()
    reference.load_state_dict(model.state_dict())
    _grid_moments.cache_clear()
    bucket_ids.cache_clear()
    with torch.no_grad():
        expected = reference(x)
    assert type(after) is torch.Tensor and torch.equal(after, expected)
    assert torch.equal(exported.module()(x), expected)
    other = posattn.create_model(name, **kwargs)  # same grid, new model, training
    out = other(torch.randn(2, 3, 64, 80))
    assert type(out) is torch.Tensor
    out.sum().backward()


def _blocks_closing_in_order(layer, x, close_order):
    """Opens one ``cache_positions`` block on ``layer`` per thread, in thread order, each running the
    layer inside it, then closes them in ``close_order``; returns, after each close, the cache that
    then served the layer and the caches of the blocks still open."""
    count = len(close_order)
    entered = [threading.Event() for _ in range(count)]
    may_close = [threading.Event() for _ in range(count)]
    closed = [threading.Event() for _ in range(count)]
    caches, errors = [None] * count, []

    def block(index):
        try:
            if index:
                entered[index - 1].wait(10)
            with cache_positions(layer) as cache:
                caches[index] = cache
                output(layer, x)
                entered[index].set()
                may_close[index].wait(10)
        except Exception as error:  # reported below
            errors.append(error)
        finally:
            closed[index].set()

    threads = [threading.Thread(target=block, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    entered[-1].wait(10)
    seen = []
    for position, index in enumerate(close_order):
        may_close[index].set()
        closed[index].wait(10)
        still_open = [caches[i] for i in close_order[position + 1:]]
        seen.append((layer.phi.position_cache, still_open))
    for thread in threads:
        thread.join(10)
    assert not errors
    return caches, seen


@pytest.mark.parametrize('close_order', [(0, 1), (1, 0), *itertools.permutations(range(3))],
                         ids=lambda order: 'close ' + '-'.join('ABC'[i] for i in order))
def test_overlapping_blocks_close_in_any_order_from_threads(close_order):
    """Blocks opened in threads A, B(, C) on one model and closed in every order: while blocks are
    open the newest of them serves; after the last closes nothing does, and a ``.data`` write (which
    no version counter sees) is computed afresh."""
    layer, x = peripheral_layer(), tokens()
    caches, seen = _blocks_closing_in_order(layer, x, list(close_order))
    newest_open = [max(still_open, key=caches.index) if still_open else None for _, still_open in seen]
    assert [serving for serving, _ in seen] == newest_open
    assert layer.phi.position_cache is None and all(len(cache) == 0 for cache in caches)
    with torch.no_grad():
        layer.phi.norm2_bias.data.add_(1.0)
    assert_fresh(layer, x)
