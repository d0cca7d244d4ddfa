"""torch.func: the layer works under grad and vmap (model ensembles) with every Φp whose terms are
plain tensor operations, and the peripheral Φp refuses with a message that says what to use."""
import pytest
import torch
from torch.func import functional_call, grad, stack_module_state, vmap

from posattn import Attention, list_phis

X = torch.randn(2, 13, 16, generator=torch.Generator().manual_seed(0))
GRID = (3, 4)


def layer(phi, seed=0, **cfg):
    torch.manual_seed(seed)
    built = Attention(16, 2, phi=phi, phi_cfg=cfg, num_prefix_tokens=1).eval()
    for p in built.parameters():  # iRPE's tables start at zero: make every term count
        torch.nn.init.normal_(p, std=0.2)
    return built


# Every Φp but the peripheral one, with the options that change which terms it has
TRANSFORMABLE = ([(name, {}) for name in list_phis() if name not in ('peripheral', 'irpe')]
                 + [('irpe', dict(mode='ctx', on='qkv')), ('irpe', dict(mode='bias', on='qk')),
                    ('rope', dict(frequencies='mixed'))])


@pytest.mark.parametrize('phi,cfg', TRANSFORMABLE)
def test_grad_matches_autograd(phi, cfg):
    model = layer(phi, **cfg)
    params = dict(model.named_parameters())
    found = grad(lambda p: functional_call(model, p, (X, GRID)).square().sum())(params)
    model(X, GRID).square().sum().backward()
    for name, p in params.items():
        torch.testing.assert_close(found[name], p.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('phi,cfg', TRANSFORMABLE)
def test_vmap_over_an_ensemble_matches_a_loop(phi, cfg):
    models = [layer(phi, seed, **cfg) for seed in range(3)]
    params, buffers = stack_module_state(models)
    base = layer(phi, **cfg).to('meta')
    found = vmap(lambda p, b: functional_call(base, (p, b), (X, GRID)))(params, buffers)
    with torch.no_grad():
        expected = torch.stack([m(X, GRID) for m in models])
    torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-6)


def test_the_peripheral_phi_refuses_and_says_what_to_use():
    model = layer('peripheral')
    params = dict(model.named_parameters())
    with pytest.raises(RuntimeError, match=r'torch.func transforms .* cannot run the peripheral Φp.*'
                                           r'torch.autograd.grad.*one after another'):
        grad(lambda p: functional_call(model, p, (X, GRID)).sum())(params)
