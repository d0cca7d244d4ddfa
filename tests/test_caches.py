"""Caches are never stale and never poisoned: the eval-mode Φp bias under every way a parameter can
change, and the grid constants under inference_mode and torch.export.

Every cached result is compared with a freshly built layer or model holding the same weights.
"""
import copy

import pytest
import torch

import posattn
from posattn import Attention
from posattn._cache import ParameterValueCache
from posattn.phi.irpe import bucket_ids
from posattn.phi.peripheral_kernel import _grid_moments

GRID = (4, 5)


def peripheral_layer(seed=0):
    torch.manual_seed(seed)
    return Attention(32, 4, phi='peripheral', num_prefix_tokens=1).eval()


def tokens(seed=1):
    return torch.randn(2, 1 + GRID[0] * GRID[1], 32, generator=torch.Generator().manual_seed(seed))


def fresh_output(layer, x):
    """The output of a newly built layer with ``layer``'s current weights (nothing cached)."""
    fresh = Attention(32, 4, phi='peripheral', num_prefix_tokens=1).to(layer.qkv.weight.dtype).eval()
    fresh.load_state_dict(copy.deepcopy(layer.state_dict()))
    with torch.no_grad():
        return fresh(x.to(layer.qkv.weight.dtype), GRID)


def cached_output(layer, x):
    with torch.no_grad():
        return layer(x, GRID)


def assert_fresh(layer, x):
    """The layer (its cache warm) gives what a fresh layer with its weights gives, bit for bit."""
    out = cached_output(layer, x)
    assert torch.equal(out, fresh_output(layer, x))
    return out


def warm(layer, x):
    before = cached_output(layer, x)
    assert len(layer.phi._cache) == 1
    return before


def random_gradients(layer):
    for p in layer.parameters():
        p.grad = torch.randn_like(p)


def test_data_write_is_seen():
    layer, x = peripheral_layer(), tokens()
    before = warm(layer, x)
    layer.phi.norm2_bias.data.add_(3.0)
    after = assert_fresh(layer, x)
    assert not torch.equal(after, before)


@pytest.mark.parametrize('optimiser', [
    lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True),
    lambda ps: torch.optim.Adam(ps, lr=0.1, fused=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True),
    lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=True),
], ids=['fused-adamw', 'fused-adam', 'fused-sgd', 'foreach-adamw'])
def test_optimiser_steps_are_seen(optimiser):
    layer, x = peripheral_layer(), tokens()
    step = optimiser(list(layer.parameters()))
    before = warm(layer, x)
    for _ in range(2):
        random_gradients(layer)
        step.step()
        assert not torch.equal(assert_fresh(layer, x), before)


def test_reassigned_data_is_seen_even_at_a_reused_address():
    layer, x = peripheral_layer(), tokens()
    warm(layer, x)
    for step in range(40):  # a new tensor of the same size often reuses the freed block
        layer.phi.norm2_bias.data = layer.phi.norm2_bias.data + 0.05
        assert_fresh(layer, x)


def test_load_state_dict_with_assign_is_seen():
    layer, x = peripheral_layer(0), tokens()
    before = warm(layer, x)
    layer.load_state_dict(peripheral_layer(3).state_dict(), assign=True)
    assert not torch.equal(assert_fresh(layer, x), before)


def test_dtype_moves_are_seen():
    layer, x = peripheral_layer(), tokens()
    warm(layer, x)
    layer.double()
    out64 = assert_fresh(layer, x.double())
    assert out64.dtype == torch.float64
    with torch.no_grad():
        layer.phi.norm2_bias.add_(0.5)
    layer.float()
    assert_fresh(layer, x)


def test_requires_grad_changes_and_no_grad_writes_are_seen():
    layer, x = peripheral_layer(), tokens()
    layer.phi.requires_grad_(False)
    with torch.enable_grad():
        frozen = layer(x, GRID)  # eval, Φp frozen: cached although autograd is on
    assert len(layer.phi._cache) == 1 and frozen.requires_grad
    layer.phi.requires_grad_(True)
    layer(x, GRID).sum().backward()  # not cached: the bias needs its gradient
    assert layer.phi.norm2_weight.grad is not None
    with torch.no_grad():
        layer.phi.norm1_weight.mul_(1.5)
    layer.phi.requires_grad_(False)
    assert_fresh(layer, x)


def test_ema_model_kept_in_eval_follows_its_updates():
    averaging = pytest.importorskip('mmengine.model').ExponentialMovingAverage
    layer, x = peripheral_layer(), tokens()
    layer.train()
    ema = averaging(layer, momentum=0.5)
    ema.eval()
    step = torch.optim.AdamW(layer.parameters(), lr=0.1)
    with torch.no_grad():
        ema(x, GRID)
    for _ in range(3):
        layer(x, GRID).square().sum().backward()
        step.step()
        step.zero_grad()
        ema.update_parameters(layer)
        with torch.no_grad():
            averaged = ema(x, GRID)
        assert torch.equal(averaged, fresh_output(ema.module, x))


def test_cache_keeps_a_snapshot_not_a_view():
    cache = ParameterValueCache(2)
    weight = torch.ones(3)
    first = cache.get('key', [weight], lambda: weight.sum().clone())
    weight.add_(1.0)  # in place, same storage and shape
    second = cache.get('key', [weight], lambda: weight.sum().clone())
    assert first.item() == 3.0 and second.item() == 6.0


def test_pickled_and_copied_layers_start_with_an_empty_cache():
    layer, x = peripheral_layer(), tokens()
    warm(layer, x)
    assert len(copy.deepcopy(layer).phi._cache) == 0
    restored = torch.load(_saved(layer), weights_only=False)
    assert len(restored.phi._cache) == 0
    assert torch.equal(cached_output(restored, x), cached_output(layer, x))


def _saved(module):
    import io
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return buffer


@pytest.mark.parametrize('name,kwargs', [('pervit_tiny', {}),
                                         ('vit_tiny', dict(phi='irpe', phi_cfg=dict(mode='ctx', on='qkv')))])
def test_inference_mode_does_not_poison_later_training(name, kwargs):
    torch.manual_seed(0)
    first = posattn.create_model(name, **kwargs).eval()
    with torch.inference_mode():
        first(torch.randn(1, 3, 64, 64))
    second = posattn.create_model(name, **kwargs)
    second(torch.randn(2, 3, 64, 64)).sum().backward()  # grid constants made under inference_mode would fail here
    assert all(p.grad is not None for n, p in second.named_parameters() if 'phi' in n and 'bias' not in n)
    with torch.no_grad():
        first(torch.randn(1, 3, 64, 64))  # and an inference-made cache entry does not break a no_grad call


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
