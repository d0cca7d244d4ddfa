"""The code in the docs runs as written, and gives what the docs say it computes."""
import re
import textwrap
from pathlib import Path

import pytest
import torch

from posattn import TokenGrid
from posattn.phi import registry

from conftest import needs_openmmlab

DOCS = Path(__file__).resolve().parents[1] / 'docs'


def python_blocks(path):
    return re.findall(r'```python\n(.*?)```', path.read_text(), flags=re.S)


def test_adding_your_own_phi_example(monkeypatch):
    monkeypatch.setattr(registry, '_PHIS', dict(registry._PHIS))
    (example,) = [block for block in python_blocks(DOCS / 'phi.md') if 'register_phi' in block]
    namespace = {}
    exec(compile(example, 'docs/phi.md', 'exec'), namespace)
    out = namespace['out']
    assert out.shape == (2, 43, 64) and torch.isfinite(out).all()
    assert 'distance_slope' in registry.list_phis()
    bias = namespace['layer'].phi.logits_bias(torch.zeros(1, 4, 43, 16), None, TokenGrid(6, 7, 1))
    assert bias.shape == (1, 4, 43, 43) and bias[0, 0, 1, 2].item() == pytest.approx(-0.25)
    assert torch.all(bias[0, :, 0] == 0)


def test_position_cache_example():
    """The cached Φp gives the logits each call computes afresh, on the image it served."""
    import posattn
    (example,) = [block for block in python_blocks(DOCS / 'phi.md') if 'cache_positions' in block]
    model = posattn.create_model('pervit_tiny', num_classes=3)
    loader = [torch.randn(1, 3, 64, 64) for _ in range(2)]  # the second is served from the cache
    namespace = dict(posattn=posattn, model=model, loader=loader)
    with torch.no_grad():
        exec(compile(textwrap.dedent(example), 'docs/phi.md', 'exec'), namespace)
        uncached = model.eval()(loader[-1])
    assert namespace['logits'].shape == (1, 3)
    torch.testing.assert_close(namespace['logits'], uncached, rtol=1e-5, atol=1e-6)
    assert namespace['cache'].nbytes == 0 and all(
        phi.position_cache is None for phi in model.modules() if isinstance(phi, posattn.PositionalModule))


def test_native_resolution_example():
    """docs/models.md's block as written: a list of images gives each image's logits alone, the NaFlex
    batch gives the padded layout of the images' grids, and the shapes are those its comments give."""
    (example,) = [block for block in python_blocks(DOCS / 'models.md') if 'ImageLayout' in block]
    namespace = {}
    torch.manual_seed(0)
    with torch.no_grad():
        exec(compile(example, 'docs/models.md', 'exec'), namespace)
        model, images = namespace['model'].eval(), namespace['images']
        alone = torch.cat([model(image[None]) for image in images])
        torch.testing.assert_close(model(images), alone, rtol=0, atol=1e-5)
    layout = namespace['layout']
    assert [(grid.height, grid.width) for grid in layout.grids] == [
        (image.shape[1] // 16, image.shape[2] // 16) for image in images]
    assert namespace['logits'].shape == (3, 10) and namespace['x'].shape == (3, 141, 192)


def test_quickstart_example_runs():
    import subprocess
    import sys
    script = DOCS.parent / 'examples' / 'quickstart.py'
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f'Φp registered: {", ".join(registry.list_phis())}' in result.stdout
    assert 'layer 0: Φp from' in result.stdout


def swap_families():
    """The rows of docs/swap.md's table of families: (model, example, swapped, reason)."""
    rows = []
    for line in (DOCS / 'swap.md').read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip('|').split('|')]
        if len(cells) == 4 and cells[2] in ('yes', 'refused'):
            example = cells[1].strip('`')
            rows.append(pytest.param(example, cells[2] == 'yes', cells[3].replace('`', ''),
                                     id=cells[0].replace('`', ''),
                                     marks=[needs_openmmlab] if example.startswith('mm') else []))
    return rows


@pytest.mark.parametrize('example,swapped,reason', swap_families())
def test_swap_families_table(example, swapped, reason):
    """Each model of the table builds from its example; a supported one keeps its outputs with
    'none', a refused one raises an error that gives the table's reason."""
    import copy
    import importlib

    from conftest import _tensors, randomised
    from posattn.swap import swap_attention
    namespace = {'timm': pytest.importorskip('timm'), 'torchvision': pytest.importorskip('torchvision')}
    if example.startswith('mm'):
        importlib.import_module('posattn_openmmlab')  # adds the OpenMMLab families to swap_attention
        for name in ('mmpretrain.models', 'mmseg.models.backbones', 'mmdet.models.backbones'):
            importlib.import_module(name)  # the names the examples use
        namespace.update({name: importlib.import_module(name) for name in ('mmpretrain', 'mmseg', 'mmdet')})
    if example.startswith('transformers.'):
        namespace['transformers'] = pytest.importorskip('transformers', minversion='5')
    model = torch.nn.Sequential(eval(example, namespace))
    if not swapped:
        with pytest.raises((TypeError, ValueError)) as refusal:
            swap_attention(model, phi='peripheral')
        assert reason in str(refusal.value)
        return
    model = randomised(model)
    swapped_model = swap_attention(copy.deepcopy(model), phi='none')
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = _tensors(model(x)), _tensors(swapped_model(x))
    assert len(got) == len(expected)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_export_example_serves_sizes_it_was_not_traced_at(tmp_path, monkeypatch):
    """docs/export.md's block as written: the dynamic program gives the eager logits at 384 x 512."""
    (example,) = re.findall(r'```py\n(.*?)```', (DOCS / 'export.md').read_text(), flags=re.S)
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(example, 'docs/export.md', 'exec'), namespace)
    assert (tmp_path / 'pervit_tiny.pt2').is_file()
    images = torch.randn(1, 3, 384, 512, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = namespace['model'](images)
        got = namespace['exported'].module()(images)
    assert got.shape == (1, 1000)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('page', ['phi.md', 'models.md', 'swap.md', 'export.md'])
def test_links_between_pages_resolve(page):
    links = re.findall(r'\]\(([\w-]+\.md)\)', (DOCS / page).read_text())
    assert [link for link in links if not (DOCS / link).is_file()] == []
