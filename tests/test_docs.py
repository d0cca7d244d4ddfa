"""The code in the docs runs as written."""
import re
from pathlib import Path

import pytest
import torch

from posattn import TokenGrid
from posattn.phi import registry

DOCS = Path(__file__).resolve().parents[1] / 'docs'


def python_blocks(path):
    return re.findall(r'```python\n(.*?)```', path.read_text(), flags=re.S)


def test_adding_your_own_phi_example(monkeypatch):
    monkeypatch.setattr(registry, '_PHIS', dict(registry._PHIS))
    (example,) = python_blocks(DOCS / 'phi.md')
    namespace = {}
    exec(compile(example, 'docs/phi.md', 'exec'), namespace)
    out = namespace['out']
    assert out.shape == (2, 43, 64) and torch.isfinite(out).all()
    assert 'distance_slope' in registry.list_phis()
    bias = namespace['layer'].phi.logits_bias(torch.zeros(1, 4, 43, 16), None, TokenGrid(6, 7, 1))
    assert bias.shape == (1, 4, 43, 43) and bias[0, 0, 1, 2].item() == pytest.approx(-0.25)
    assert torch.all(bias[0, :, 0] == 0)


def test_readme_quick_start():
    (example,) = python_blocks(DOCS.parent / 'README.md')
    namespace = {}
    exec(compile(example, 'README.md', 'exec'), namespace)
    assert namespace['out'].shape == (8, 281, 128)


def test_quickstart_example_runs():
    import subprocess
    import sys
    script = DOCS.parent / 'examples' / 'quickstart.py'
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'Φp registered: irpe, none, peg, peripheral' in result.stdout
    assert 'layer 0: Φp from' in result.stdout
