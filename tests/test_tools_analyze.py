"""tools/analyze.py on the embedded config: metrics.json and the three figures, from the initialised
model and from a release-layout checkpoint."""
import json
import subprocess
import sys

import pytest
import torch

import posattn
from posattn import TokenGrid
from posattn.analysis import nonlocality
from release_pervit import ReleasePerViT
from conftest import REPO as ROOT

pytestmark = pytest.mark.slow


def analyze(*args):
    result = subprocess.run([sys.executable, str(ROOT / 'tools' / 'analyze.py'), 'configs/pervit_t_shapes.py',
                             *args, '--num-images', '6', '--show-images', '2'],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_model_normalises_images_as_in_training():
    from analyze import build_model
    from mmengine.config import Config
    from mmengine.registry import init_default_scope

    init_default_scope('mmpretrain')
    cfg = Config.fromfile(ROOT / 'configs' / 'pervit_t_shapes.py')
    preprocessor = build_model(cfg, None).data_preprocessor
    assert preprocessor.mean.flatten().tolist() == cfg.data_preprocessor.mean
    assert preprocessor.std.flatten().tolist() == cfg.data_preprocessor.std


def test_analyze_writes_metrics_and_figures(tmp_path):
    stdout = analyze('--out', str(tmp_path))
    record = json.loads((tmp_path / 'metrics.json').read_text())
    assert record['num_images'] == 6 and record['checkpoint'] is None
    assert [layer['layer'] for layer in record['layers']] == [f'model.blocks.{i}.attn' for i in range(12)]
    first = record['layers'][0]
    assert first['grid'] == [4, 4] and len(first['nonlocality_position']) == 4 and len(first['regions']) == 4
    for name in ('position.png', 'samples.png', 'measures.png'):
        assert (tmp_path / name).read_bytes()[:4] == b'\x89PNG'
    assert f'wrote {tmp_path / "metrics.json"}' in stdout


def test_analyze_reads_a_release_checkpoint(tmp_path):
    weights = ReleasePerViT('tiny').state_dict()
    weights['blocks.0.attn.activation.gn2.weight'].fill_(7.0)  # a distinctive Φp in layer 0
    path = tmp_path / 'release.pth'
    torch.save({'model': weights}, path)
    analyze(str(path), '--out', str(tmp_path))
    record = json.loads((tmp_path / 'metrics.json').read_text())
    assert record['checkpoint'] == str(path)
    phi = posattn.create_model('pervit_tiny', checkpoint=path).blocks[0].attn.phi
    with torch.no_grad():
        expected = nonlocality(phi.position_attention(4, 4), TokenGrid(4, 4))
    assert record['layers'][0]['nonlocality_position'] == pytest.approx(expected.tolist(), rel=1e-5)
