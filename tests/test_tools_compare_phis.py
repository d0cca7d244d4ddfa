"""tools/compare_phis.py with a reduced budget: every run trains through tools/train.py and the
table, JSON and plot come from their logs."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_compare_phis_trains_each_row_and_seed_and_tabulates(tmp_path):
    command = [sys.executable, 'tools/compare_phis.py', '--rows', 'deit_t_peg', 'pervit_t', '--seeds', '0', '1',
               '--epochs', '2', '--work-dir', str(tmp_path),
               '--cfg-options', 'train_dataloader.dataset.num_images=96', 'train_dataloader.batch_size=32',
               'val_dataloader.dataset.num_images=32', 'default_hooks.logger.interval=1']
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    record = json.loads((tmp_path / 'comparison.json').read_text())
    assert [(run['row'], run['seed']) for run in record['runs']] == [
        ('deit_t_peg', 0), ('deit_t_peg', 1), ('pervit_t', 0), ('pervit_t', 1)]
    for run in record['runs']:
        assert len(run['top1_per_epoch']) == 2 and all(0 <= top1 <= 100 for top1 in run['top1_per_epoch'])
        assert run['step_time_s'] > 0
        assert (tmp_path / run['row'] / f'seed{run["seed"]}' / 'epoch_2.pth').is_file()
    params = {line['row']: line['params_m'] for line in record['table']}
    assert params['pervit_t'] == pytest.approx(7.3, abs=0.1)   # PerViT-T with a 6-class head
    assert params['deit_t_peg'] == pytest.approx(5.5, abs=0.1)  # ViT-Tiny, no abs. embedding, 5 PEGs
    pervit = [run['top1_per_epoch'][-1] for run in record['runs'] if run['row'] == 'pervit_t']
    assert record['table'][1]['top1'] == pytest.approx(sum(pervit) / 2)

    table = (tmp_path / 'comparison.md').read_text()
    assert '| PerViT-T | `pervit_t_shapes.py` |' in table and '2 seeds' in table
    assert (tmp_path / 'comparison.png').read_bytes()[:4] == b'\x89PNG'
    assert 'val top-1 after 2 epochs' in result.stdout

    # the same settings again: the finished run is reused, not trained again
    again = subprocess.run(command[:3] + ['pervit_t'] + command[5:], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count('reusing') == 2 and 'Epoch(val)' not in again.stdout
    assert json.loads((tmp_path / 'comparison.json').read_text())['runs'] == record['runs'][2:]
