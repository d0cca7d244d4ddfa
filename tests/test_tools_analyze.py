"""tools/analyze.py on the embedded config: metrics.json and the three figures, from the initialised
model and from a release-layout checkpoint; the figures' format and resolution."""
import json
import struct
import subprocess
import sys

import pytest
import torch

import posattn
from posattn import TokenGrid
from posattn.analysis import collect_attention_maps, measure_attention, nonlocality
from release_pervit import ReleasePerViT
from conftest import REPO as ROOT, require_openmmlab

require_openmmlab()  # every test runs tools/analyze.py or imports it

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
    assert first['grid'] == [4, 4] and len(first['nonlocality_position']) == 4
    assert first['regions'] == ['grid too small for regions (4x4)'] * 4 and first['regions_apply'] is False
    for name in ('position.png', 'samples.png', 'measures.png'):
        assert (tmp_path / name).read_bytes()[:4] == b'\x89PNG'
    assert f'wrote {tmp_path / "metrics.json"}' in stdout


def test_the_progress_counts_the_images_there_are(tmp_path):
    """Fewer validation images than --num-images asks: all of them, said, and the progress bar's total
    is their number."""
    stdout = analyze('--out', str(tmp_path), '--cfg-options', 'val_dataloader.dataset.num_images=4')
    assert 'the validation split holds 4 images: analysing all of them (--num-images 6)' in stdout
    assert '4/4' in stdout and '/6' not in stdout
    assert json.loads((tmp_path / 'metrics.json').read_text())['num_images'] == 4


def test_analyze_reads_a_release_checkpoint(tmp_path):
    weights = ReleasePerViT('tiny').state_dict()
    weights['blocks.0.attn.activation.gn2.weight'].fill_(7.0)  # a distinctive Φp in layer 0
    path = tmp_path / 'release.pth'
    torch.save({'model': weights}, path)
    stdout = analyze(str(path), '--out', str(tmp_path), '--format', 'pdf')
    record = json.loads((tmp_path / 'metrics.json').read_text())
    assert record['checkpoint'] == str(path)
    assert 'position.pdf, samples.pdf, measures.pdf' in stdout and not list(tmp_path.glob('*.png'))
    for name in ('position.pdf', 'samples.pdf', 'measures.pdf'):
        assert (tmp_path / name).read_bytes()[:5] == b'%PDF-'
    model = posattn.create_model('pervit_tiny', checkpoint=path)
    with torch.no_grad():
        expected = nonlocality(model.blocks[0].attn.phi.position_attention(4, 4, model.distance_embedding),
                               TokenGrid(4, 4))
    assert record['layers'][0]['nonlocality_position'] == pytest.approx(expected.tolist(), rel=1e-5)


def png_size(path):
    """(width, height) in pixels, from the PNG's IHDR chunk."""
    return struct.unpack('>II', path.read_bytes()[16:24])


def test_figures_follow_format_and_dpi(tmp_path):
    from analyze import write_figures
    model = posattn.create_model('pervit_tiny', num_classes=0)
    images = torch.randn(2, 3, 64, 64)
    maps, measures = collect_attention_maps(model, images), measure_attention(model, [images])
    names = {}
    for fmt, dpi in (('png', 40), ('png', 80), ('svg', 80)):
        (tmp_path / f'{fmt}{dpi}').mkdir()
        names[fmt, dpi] = write_figures(tmp_path / f'{fmt}{dpi}', images, maps, measures, None, fmt, dpi)
    assert names['svg', 80] == ['position.svg', 'samples.svg', 'measures.svg']
    for name in names['svg', 80]:
        head = (tmp_path / 'svg80' / name).read_bytes()[:400]
        assert head.startswith(b'<?xml') and b'<svg' in head
    for name in names['png', 80]:
        small, large = png_size(tmp_path / 'png40' / name), png_size(tmp_path / 'png80' / name)
        assert large == pytest.approx((2 * small[0], 2 * small[1]), rel=0.03), name  # text bounds round


@pytest.mark.parametrize('option,message', [(['--format', 'jpg'], "invalid choice: 'jpg'"),
                                            (['--dpi', '0'], 'must be a positive integer, got 0')])
def test_bad_figure_options_are_refused(option, message, capsys):
    from analyze import parse_args
    with pytest.raises(SystemExit):
        parse_args(['configs/pervit_t_shapes.py', *option])
    assert message in capsys.readouterr().err


def test_figures_are_titled_with_the_config_and_checkpoint_names():
    from analyze import figure_title
    assert figure_title('configs/pervit_t_shapes.py', 'work_dirs/pervit_t_shapes/best_accuracy_top1_epoch_9.pth') == \
        'pervit_t_shapes: best_accuracy_top1_epoch_9.pth'
    assert figure_title('configs/pervit_t_shapes.py', None) == 'pervit_t_shapes: initialised model (no checkpoint)'
