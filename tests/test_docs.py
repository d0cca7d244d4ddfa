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


def swap_opening_block(library):
    """The block of docs/swap.md's opening (before its first section) that uses `library`."""
    opening = (DOCS / 'swap.md').read_text().split('\n## ')[0]
    blocks = re.findall(r'```python\n(.*?)```', opening, flags=re.S)
    assert len(blocks) == 3, 'swap.md opens with one block each for timm, transformers and OpenMMLab'
    (block,) = [b for b in blocks if library in b]
    return block


def swapped_phis(model):
    from posattn.swap import SwappedAttention
    return [m.phi.phi_name for m in model.modules() if isinstance(m, SwappedAttention)]


def test_swap_opening_timm_block():
    """timm's block as written: every layer gets the Φp, and with the tokens pooled each Φp trains
    (no UnreachedPhiWarning), while the swap says it added parameters."""
    import warnings

    from posattn.swap import AddedParametersWarning
    from posattn.unreached import UnreachedPhiWarning
    pytest.importorskip('timm')
    namespace = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        exec(compile(swap_opening_block("timm.create_model("), 'docs/swap.md', 'exec'), namespace)
    kinds = {type(w.message) for w in caught}
    assert AddedParametersWarning in kinds and UnreachedPhiWarning not in kinds
    model = namespace['model']
    assert swapped_phis(model) == ['peripheral'] * 12
    logits = model(torch.randn(1, 3, 224, 224))
    logits.sum().backward()
    assert logits.shape == (1, 1000) and all(p.grad is not None for p in model.blocks[-1].attn.phi.parameters())


def test_swap_opening_transformers_block(tmp_path, monkeypatch):
    """transformers' block as written: the swap, then save_pretrained and posattn.swap.from_pretrained
    give back the swapped model, outputs and all."""
    pytest.importorskip('transformers', minversion='5')
    lines = swap_opening_block('transformers.').strip().splitlines()
    assert 'from_pretrained' in lines[-1]
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile('\n'.join(lines[:-1]), 'docs/swap.md', 'exec'), namespace)
    swapped = namespace['model'].eval()
    assert swapped_phis(swapped) == ['rope'] * 2
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = swapped(pixel_values=x).logits
    exec(compile(lines[-1], 'docs/swap.md', 'exec'), namespace)
    reloaded = namespace['model'].eval()
    assert reloaded is not swapped and swapped_phis(reloaded) == ['rope'] * 2
    with torch.no_grad():
        torch.testing.assert_close(reloaded(pixel_values=x).logits, expected, rtol=0, atol=0)


@needs_openmmlab
def test_swap_opening_openmmlab_config(tmp_path):
    """OpenMMLab's block, as a config file: mmpretrain's DeiT-T classifier with the swapped backbone
    builds, initialises (its init_cfg no longer re-initialising the backbone) and classifies."""
    import posattn_openmmlab  # noqa: F401  (registers the backbone, as the config's custom_imports do)
    from mmengine.config import Config
    from mmpretrain.registry import MODELS
    path = tmp_path / 'deit-t_peripheral.py'
    path.write_text(swap_opening_block('_base_'))
    cfg = Config.fromfile(str(path))
    assert cfg.model.backbone.type == 'PosattnSwappedBackbone' and 'arch' not in cfg.model.backbone
    model = MODELS.build(cfg.model)
    model.init_weights()
    assert swapped_phis(model) == ['peripheral'] * 12
    with torch.no_grad():
        assert model(torch.randn(1, 3, 224, 224), mode='tensor').shape == (1, 1000)


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


@pytest.mark.parametrize('page', ['phi.md', 'models.md', 'swap.md', 'export.md', 'gpu.md'])
def test_links_between_pages_resolve(page):
    links = re.findall(r'\]\(([\w-]+\.md)\)', (DOCS / page).read_text())
    assert [link for link in links if not (DOCS / link).is_file()] == []
