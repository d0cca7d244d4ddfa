"""biased_attention: values and gradients of q, k, v and the bias against float64 formulas, on the
``--device`` of the run (conftest.py) where marked by the ``device`` fixture."""
import pytest
import torch

from posattn import functional
from posattn.functional import attention_probs, biased_attention

from conftest import leaves_on


def naive(q, k, v, bias):
    scores = torch.einsum('bhqd,bhkd->bhqk', q, k) / q.shape[-1] ** 0.5 + bias
    weights = torch.exp(scores - scores.max(-1, keepdim=True).values)
    return torch.einsum('bhqk,bhkd->bhqd', weights / weights.sum(-1, keepdim=True), v)


def qkv(batch=3, heads=2, tokens=7, dim=4, dtype=torch.float64):
    return [torch.randn(batch, heads, tokens, dim, dtype=dtype, requires_grad=True) for _ in range(3)]


BIAS_SHAPES = [(1, 2, 7, 7), (3, 2, 7, 7), (3, 1, 7, 7), (2, 7, 7), (7, 7)]


@pytest.mark.parametrize('bias_shape', BIAS_SHAPES)
def test_values_and_gradients_match_naive(bias_shape, device):
    """On the device (the CPU kernel, or SDPA with the bias as ``attn_mask`` on CUDA), against the
    naive formula on the CPU."""
    q, k, v = qkv()
    bias = torch.randn(bias_shape, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(3, 2, 7, 4, dtype=torch.float64)
    inputs = leaves_on(device, q, k, v, bias)
    out = biased_attention(*inputs)
    grads = torch.autograd.grad((out * upstream.to(device)).sum(), inputs)
    expected = naive(q, k, v, bias)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), (q, k, v, bias))
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-10, atol=1e-12)
    for got, want in zip(grads, expected_grads):
        assert got.shape == want.shape
        torch.testing.assert_close(got.cpu(), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize('bias_shape', [(1, 2, 5, 5), (2, 2, 5, 5)])
def test_gradcheck(bias_shape, device):
    q, k, v = qkv(batch=2, tokens=5, dim=3)
    bias = torch.randn(bias_shape, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(biased_attention, tuple(leaves_on(device, q, k, v, bias)))


@pytest.mark.parametrize('block_elements,tile_rows', [(25, 5), (60, 5), (200, 5), (10, 2), (4, 1)])
@pytest.mark.parametrize('bias_shape', [(1, 3, 5, 5), (3, 1, 5, 5), (1, 1, 1, 5)])
def test_tiled_backward_covers_every_tile(monkeypatch, block_elements, tile_rows, bias_shape):
    """Tiles of one head, of part of the heads, of a few batch items, and of a few query rows."""
    monkeypatch.setattr(functional, '_BLOCK_ELEMENTS', block_elements)
    monkeypatch.setattr(functional, '_TILE_ROWS', tile_rows)
    q, k, v = qkv(batch=3, heads=3, tokens=5)
    bias = torch.randn(bias_shape, dtype=torch.float64, requires_grad=True)
    grads = torch.autograd.grad(biased_attention(q, k, v, bias).square().sum(), (q, k, v, bias))
    expected = torch.autograd.grad(naive(q, k, v, bias).square().sum(), (q, k, v, bias))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_batch_free_bias_gradient_is_the_batch_sum(device):
    q, k, v = leaves_on(device, *qkv())
    (shared,) = leaves_on(device, torch.randn(1, 2, 7, 7, dtype=torch.float64))
    per_sample = shared.detach().expand(3, 2, 7, 7).clone().requires_grad_()
    biased_attention(q, k, v, shared).sum().backward()
    biased_attention(q, k, v, per_sample).sum().backward()
    torch.testing.assert_close(shared.grad, per_sample.grad.sum(0, keepdim=True), rtol=1e-10, atol=1e-12)


def test_no_bias_and_frozen_bias_are_plain_attention():
    q, k, v = qkv(dtype=torch.float32)
    zeros = torch.zeros(7, 7)
    torch.testing.assert_close(biased_attention(q, k, v), naive(q, k, v, zeros))
    frozen = torch.randn(1, 2, 7, 7)
    torch.testing.assert_close(biased_attention(q, k, v, frozen), naive(q, k, v, frozen))


def test_attention_probs_rows_sum_to_one():
    q, k, _ = qkv()
    bias = torch.randn(1, 2, 7, 7, dtype=torch.float64)
    probs = attention_probs(q, k, bias)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, 2, 7, dtype=torch.float64))
    torch.testing.assert_close(probs @ torch.eye(7, dtype=torch.float64), probs)


def test_bias_with_too_many_dims_is_refused():
    q, k, v = qkv()
    with pytest.raises(ValueError, match='at most 4 dims'):
        biased_attention(q, k, v, torch.zeros(1, 1, 2, 7, 7, dtype=torch.float64))
