"""The setup itself: the mmcv build's pip steps resolve against the torch pins, without compiling.

``tools/build_mmcv.sh --dry-run`` runs the build's ``pip install`` with ``--dry-run`` in a fresh,
empty environment, so a requirement that conflicts with the pinned torch (torch 2.14.1 needs
setuptools >= 77.0.3) fails here in seconds instead of after a 20-45 minute build. They ask the
package index, so they are marked ``environment``: ``make test`` runs them, a plain ``pytest`` does not.
"""
import os
import subprocess
import venv

import pytest

from conftest import REPO

BUILD_SCRIPT = REPO / 'tools' / 'build_mmcv.sh'


@pytest.fixture(scope='module')
def empty_python(tmp_path_factory):
    """The interpreter of a new virtual environment that holds nothing but pip."""
    root = tmp_path_factory.mktemp('empty-env')
    venv.create(root, with_pip=True)
    return str(root / 'bin' / 'python')


def dry_run(python, torch_pins=None):
    env = dict(os.environ)
    if torch_pins is not None:
        env['TORCH_PINS'] = torch_pins
    return subprocess.run(['bash', str(BUILD_SCRIPT), '--dry-run', python, str(REPO / '.wheels' / 'unused')],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.slow
@pytest.mark.environment
def test_mmcv_build_requirements_resolve_with_the_torch_pins(empty_python):
    result = dry_run(empty_python)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert 'build requirements resolve with torch==2.14.1 torchvision==0.29.1' in result.stdout


@pytest.mark.slow
@pytest.mark.environment
def test_dry_run_fails_on_a_build_requirement_that_conflicts_with_torch(empty_python):
    # A build requirement that torch 2.14.1 rules out: setuptools < 70 (torch needs >= 77.0.3).
    result = dry_run(empty_python, torch_pins='torch==2.14.1 torchvision==0.29.1 setuptools<70')
    assert result.returncode != 0
    assert 'ResolutionImpossible' in result.stderr or 'conflicting dependencies' in result.stderr


def test_build_script_usage_error_names_its_arguments():
    result = subprocess.run(['bash', str(BUILD_SCRIPT)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert 'usage:' in result.stderr and 'PYTHON WHEEL_DIR' in result.stderr
