"""Shared test helpers: the ../shared folder beside the checkout, and seeded determinism."""
import sys
from pathlib import Path

import pytest
import torch

SHARED = Path(__file__).resolve().parents[1].parent / 'shared'
FIXTURES = SHARED / 'fixtures'


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
