"""posattn's OpenMMLab half beside a current Hugging Face transformers: installed into a folder of
its own for these tests (put first on PYTHONPATH of the tools' processes), it leaves the pinned
mmpretrain unable to import its multimodal models; with posattn_openmmlab imported first,
mmpretrain, mmdet and mmseg import, a short training runs and tools/test.py evaluates its
checkpoint."""
import os
import sys

import pytest

from conftest import REPO, require_openmmlab, run_tool

require_openmmlab()  # before the OpenMMLab imports

from posattn_openmmlab.mmpretrain_multimodal import missing_imports  # noqa: E402

TRANSFORMERS = ('transformers==5.18.0', 'tokenizers==0.23.2')  # a current release and its tokenizers
CONFIG = 'configs/pervit_t_shapes.py'
SHORT = ['train_cfg.max_epochs=1', 'train_dataloader.dataset.num_images=16', 'train_dataloader.batch_size=16',
         'val_dataloader.dataset.num_images=16']


@pytest.fixture(scope='module')
def with_transformers(tmp_path_factory):
    """The environment of a process that finds transformers (and only it and tokenizers) in a
    folder of its own, before the project's environment."""
    target = tmp_path_factory.mktemp('transformers')
    run_tool(sys.executable, '-m', 'pip', 'install', '--quiet', '--no-deps', '--target', str(target), *TRANSFORMERS,
             timeout=600)
    return dict(PYTHONPATH=os.pathsep.join(filter(None, [str(target), os.environ.get('PYTHONPATH')])))


def python(code, env, check=True):
    import subprocess
    result = subprocess.run([sys.executable, '-c', code], cwd=REPO, capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, **env))
    if check:
        assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.mark.slow
def test_mmpretrain_alone_fails_and_imports_after_posattn_openmmlab(with_transformers):
    """Without posattn the pinned mmpretrain cannot import its models (what users hit); after
    ``import posattn_openmmlab`` every toolbox imports, one warning names what transformers lacks,
    and a multimodal model is refused when built."""
    alone = python('import transformers, mmpretrain.models', with_transformers, check=False)
    assert alone.returncode != 0 and 'NoneType takes no arguments' in alone.stderr
    result = python(
        'import transformers, posattn_openmmlab, mmpretrain.models, mmdet.models, mmseg.models\n'
        'from mmpretrain.registry import MODELS\n'
        'from mmpretrain.utils import dependency\n'
        'assert dependency.WITH_MULTIMODAL  # mmpretrain\'s own flag as it set it\n'
        'try:\n'
        '    MODELS.build(dict(type="BlipCaption"))\n'
        'except ImportError as error:\n'
        '    print("refused:", error)\n'
        'print(transformers.__version__)', with_transformers)
    assert result.stdout.splitlines()[-1] == TRANSFORMERS[0].split('==')[1]
    assert 'refused: ' in result.stdout and 'multi-modal' in result.stdout  # mmpretrain's placeholder
    assert result.stderr.count("mmpretrain's multimodal models") == 1
    assert 'transformers.modeling_utils.find_pruneable_heads_and_indices' in result.stderr


@pytest.mark.slow
def test_train_and_test_run_beside_transformers(with_transformers, tmp_path):
    out = run_tool(sys.executable, 'tools/train.py', CONFIG, '--work-dir', str(tmp_path), '--cfg-options', *SHORT,
                   timeout=600, env=with_transformers)
    assert 'Finished 1 epoch' in out
    metrics = tmp_path / 'metrics.json'
    run_tool(sys.executable, 'tools/test.py', CONFIG, str(tmp_path / 'epoch_1.pth'), '--work-dir', str(tmp_path),
             '--out', str(metrics), '--cfg-options', *SHORT[1:], timeout=600, env=with_transformers)
    assert 'accuracy/top1' in metrics.read_text()


def test_missing_imports_reads_the_sources_without_running_them(tmp_path):
    """Names a source imports from a package that the installed package lacks, as (module, name,
    file); a submodule imported by name counts as present, relative imports and other packages are
    not read, and nothing is executed."""
    (tmp_path / 'a.py').write_text('raise SystemExit("not run")\n'
                                   'from posattn.grid import TokenGrid, NoSuchGrid\n'
                                   'from posattn import phi, no_such_module\n'
                                   'from .grid import Missing\n'
                                   'from torch import no_such_torch_name\n')
    (tmp_path / 'b.py').write_text('def f():\n    from posattn.no_such_package import x\n')
    (tmp_path / 'c.py').write_text('import os\n')
    assert missing_imports(sorted(tmp_path.glob('*.py')), 'posattn') == [
        ('posattn', 'no_such_module', 'a.py'), ('posattn.grid', 'NoSuchGrid', 'a.py'),
        ('posattn.no_such_package', 'x', 'b.py')]
