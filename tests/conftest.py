"""Shared test helpers: the ../shared folder beside the checkout, seeded determinism, the tools'
folder on the import path, random peripheral Φp weights, and running the repository's tools in a
subprocess."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / 'shared'
FIXTURES = SHARED / 'fixtures'
# The tools are scripts, not a package: the tests import their functions from here (appended, so
# that tools/test.py never shadows the standard library's test package).
if str(REPO / 'tools') not in sys.path:
    sys.path.append(str(REPO / 'tools'))


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
    yield


def load_fixture(name):
    """A reference file of ../shared/fixtures; skips where ../shared is absent (a user's clone)."""
    path = FIXTURES / name
    if not path.exists():
        pytest.skip(f'{path} is absent: the reference fixtures live in ../shared beside the checkout')
    return torch.load(path, weights_only=True)


def weights_recipe():
    """The fixture README's `weights_recipe` module that rebuilds the release weights."""
    if not (FIXTURES / 'weights_recipe.py').exists():
        pytest.skip(f'{FIXTURES} is absent: the reference fixtures live in ../shared beside the checkout')
    if str(FIXTURES) not in sys.path:
        sys.path.insert(0, str(FIXTURES))
    import weights_recipe as recipe
    return recipe


# (scale, shift) of the random peripheral Φp parameters, in PeripheralPhi.weights() order: w, its
# bias, PP1, its bias, IN1 weight and bias, PP2, its bias, IN2 weight and bias. The dead biases are
# random too: they must not matter.
_PERIPHERAL_RANDOM = ((0.5, 0.0), (0.5, 0.0), (1 / 12, 0.0), (0.1, 0.0), (0.1, 1.0), (0.1, 0.0),
                      (1 / 12, 0.0), (0.1, 0.0), (0.5, 1.0), (1.5, 0.0))


def randomise_peripheral(phi, seed):
    """Fill a PeripheralPhi's parameters with seeded random values (drawn in float64); returns it."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param, (scale, shift) in zip(phi.weights(), _PERIPHERAL_RANDOM):
            param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64) * scale + shift)
    return phi


def gradcheck_layer(layer, x, hw):
    """torch.autograd.gradcheck of ``layer(x, hw)`` in the input and every parameter (float64)."""
    names = [n for n, _ in layer.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_() for _, p in layer.named_parameters())

    def run(x, *values):
        return torch.func.functional_call(layer, dict(zip(names, values)), (x, hw))
    return torch.autograd.gradcheck(run, (x.requires_grad_(), *params), fast_mode=True)


def run_tool(*command, timeout, env=None):
    """Run ``command`` from the repository root (e.g. ``sys.executable, 'tools/train.py', ...``) and
    return its stdout + stderr; a non-zero exit fails the test with the tail of both."""
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                            env=dict(os.environ, **(env or {})))
    assert result.returncode == 0, f'{" ".join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}'
    return result.stdout + result.stderr
