"""Recipes for your own images (configs/your_data): recipe=position keeps every pixel where it was;
linked settings name a pipeline's transforms by their type, so that img_size sizes each recipe's; and
tools/test.py --img-size sizes any test pipeline whose sizes are linked to img_size, so that no
refusal sends a user in a circle. The documented commands, on a folder whose labels are left and
right, train, test and analyse models above chance (slow)."""
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, require_openmmlab

require_openmmlab()  # before the OpenMMLab imports

from mmengine.config import Config  # noqa: E402

from posattn_openmmlab.linked_settings import merge_options  # noqa: E402
from posattn_openmmlab.sizes import set_test_size  # noqa: E402

CONFIGS = REPO / 'configs' / 'your_data'
MODELS = ('deit_t_image_folder.py', 'pervit_t_image_folder.py')


def loaded(name, **options):
    cfg = Config.fromfile(CONFIGS / name)
    merge_options(cfg, options)
    return cfg


def transforms(cfg, loader):
    return [transform['type'] for transform in cfg[loader].dataset.pipeline]


@pytest.mark.parametrize('name', MODELS)
def test_the_position_recipe_keeps_every_pixel_where_it_was(name):
    """No crop, no flip, no Mixup or CutMix; every image resized to img_size x img_size, train and
    test alike; its lr and schedule; the other settings as given, on top."""
    imagenet = loaded(name, img_size=64)
    assert 'RandomFlip' in transforms(imagenet, 'train_dataloader') and imagenet.model.train_cfg.augments
    cfg = loaded(name, recipe='position', img_size=64, num_classes=3)
    for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        assert transforms(cfg, loader) == ['LoadImageFromFile', 'Resize', 'PackInputs'], loader
        assert cfg[loader].dataset.pipeline[1].scale == 64 and cfg[loader].dataset.pipeline[1].keep_ratio is False
    assert cfg.model.train_cfg is None and cfg.model.backbone.drop_path_rate == 0.0
    assert (cfg.optim_wrapper.optimizer.lr, cfg.train_dataloader.batch_size, cfg.train_cfg.max_epochs) == (1e-3, 32, 30)
    assert cfg.param_scheduler[0].end == cfg.param_scheduler[1].begin == 2  # its warm-up, through warmup_epochs
    assert cfg.model.head.num_classes == 3
    shorter = loaded(name, recipe='position', **{'train_cfg.max_epochs': 5})  # the user's options come last
    assert shorter.train_cfg.max_epochs == 5


def test_a_config_that_sets_the_recipe_itself_and_its_saved_copy_train_alike(tmp_path):
    """recipe='position' in a config of one's own that inherits ours; the copy a training saves in its
    work dir reads back to the same config."""
    mine = tmp_path / 'mine.py'
    mine.write_text(f"_base_ = '{CONFIGS / 'deit_t_image_folder.py'}'\nrecipe = 'position'\nimg_size = 48\n")
    cfg = Config.fromfile(mine)
    merge_options(cfg, {})
    assert transforms(cfg, 'train_dataloader') == ['LoadImageFromFile', 'Resize', 'PackInputs']
    assert cfg.train_dataloader.dataset.pipeline[1].scale == 48 and cfg.model.backbone.img_size == 48
    cfg.dump(tmp_path / 'saved.py')
    saved = Config.fromfile(tmp_path / 'saved.py')
    merge_options(saved, {})
    assert saved.to_dict() == cfg.to_dict()
    # what was set on top of the recipe stays in the saved copy (a study's run: its --epochs, its batch)
    cfg = loaded('deit_t_image_folder.py', recipe='position', warmup_epochs=1,
                 **{'train_cfg.max_epochs': 4, 'train_dataloader.batch_size': 6})
    cfg.dump(tmp_path / 'run.py')
    saved = Config.fromfile(tmp_path / 'run.py')
    merge_options(saved, {})
    assert (saved.train_cfg.max_epochs, saved.train_dataloader.batch_size, saved.param_scheduler[0].end) == (4, 6, 1)
    assert saved.to_dict() == cfg.to_dict()


def test_an_unknown_recipe_names_the_recipes():
    with pytest.raises(ValueError, match=r"recipe='positions' is none of the config's recipes \('imagenet', "
                                         r"'position'\)"):
        loaded('deit_t_image_folder.py', recipe='positions')


def own_pipeline_config(tmp_path, name, pipeline, links=''):
    """A config of one's own whose test ``pipeline`` (its transforms' text) --img-size's own rules do not
    rewrite; ``links``: what it adds to img_size's linked keys."""
    path = tmp_path / f'{name}.py'
    path.write_text(f"""_base_ = '{CONFIGS / 'deit_t_image_folder.py'}'
test_pipeline = [dict(type='LoadImageFromFile'), {pipeline}, dict(type='PackInputs')]
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = dict(dataset=dict(pipeline=test_pipeline))
linked_keys = dict(img_size=[*_base_.linked_keys.img_size, {links}])
""")
    cfg = Config.fromfile(path)
    merge_options(cfg, {})
    return path, cfg


KEEPING_RATIO = "dict(type='Resize', scale=224, keep_ratio=True), dict(type='CenterCrop', crop_size=224)"
ANOTHER_CROP = "dict(type='ResizeEdge', scale=224), dict(type='RandomCrop', crop_size=224)"


def test_img_size_sizes_a_pipeline_of_ones_own_through_its_links_and_each_refusal_names_a_fix_that_works(tmp_path):
    """A resize that keeps the ratio then a centre crop, both linked by their types (as
    configs/_base_/image_folder.py links them): --img-size sets them. A crop linked to nothing: the
    refusal names it and how to link it, and once linked --img-size sets it."""
    path, cfg = own_pipeline_config(tmp_path, 'linked', KEEPING_RATIO)
    said = set_test_size(cfg, (96, 96))
    assert 'test_dataloader.dataset.pipeline.1.scale' in said and 'test_dataloader.dataset.pipeline.2.crop_size' in said
    assert cfg.test_dataloader.dataset.pipeline[1].scale == cfg.test_dataloader.dataset.pipeline[2].crop_size == 96
    assert cfg.model.backbone.img_size == 224  # the grid of the learned position embedding, as trained
    with pytest.raises(ValueError, match=r'take one side: --img-size 96; got 96 x 64'):
        set_test_size(Config.fromfile(path), (96, 64))
    with pytest.raises(ValueError) as error:  # a linked test key set by hand: the fix named is --img-size
        merge_options(Config.fromfile(path), {'test_dataloader.dataset.pipeline.1.scale': 96})
    assert 'to test at another size, tools/test.py --img-size N' in str(error.value)

    _, cfg = own_pipeline_config(tmp_path, 'crop', ANOTHER_CROP)
    with pytest.raises(ValueError, match=r"Link test_dataloader\.dataset\.pipeline\.RandomCrop\.crop_size to img_size "
                                         r"too \(the config's linked_keys\['img_size'\]\): then --img-size sets them"):
        set_test_size(cfg, (96, 96))
    _, cfg = own_pipeline_config(tmp_path, 'crop_linked', ANOTHER_CROP,
                                 "'test_dataloader.dataset.pipeline.RandomCrop.crop_size'")  # the fix named
    set_test_size(cfg, (96, 96))
    assert cfg.test_dataloader.dataset.pipeline[2].crop_size == 96


def draw_position_folder(root: Path, per_class=(60, 20), seed=0) -> Path:
    """Two classes by where a bright disc is, left or right: images of 40-72 px in either side,
    some grayscale, PNG and JPEG."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    for split, count in zip(('train', 'val'), per_class):
        for side in ('left', 'right'):
            (root / split / side).mkdir(parents=True)
            for index in range(count):
                height, width = (int(side) for side in rng.integers(40, 72, 2))
                image = rng.integers(0, 70, (height, width, 3)).astype(np.uint8)
                radius, half = max(3, min(height, width) // 8), width // 2
                cy, cx = rng.integers(radius, height - radius), rng.integers(radius, half - radius)
                cx += 0 if side == 'left' else half
                rows, cols = np.mgrid[:height, :width]
                image[(rows - cy) ** 2 + (cols - cx) ** 2 <= radius ** 2] = 230
                picture = Image.fromarray(image).convert('L' if index % 5 == 0 else 'RGB')
                picture.save(root / split / side / f'{index}.{"jpg" if index % 2 else "png"}')
    return root


def documented_commands():
    """The commands of docs/your-data.md's first block for labels that depend on position."""
    text = (REPO / 'docs' / 'your-data.md').read_text()
    block = re.search(r'```bash\n(python tools/train\.py [^`]*recipe=position[^`]*)```', text).group(1)
    return [shlex.split(line) for line in block.replace('\\\n', ' ').splitlines() if line.strip()]


SMALL_MACHINE = ['train_dataloader.num_workers=0', 'train_dataloader.persistent_workers=False',
                 'val_dataloader.num_workers=0', 'val_dataloader.persistent_workers=False',
                 'test_dataloader.num_workers=0', 'test_dataloader.persistent_workers=False']


def run(command, cwd):
    result = subprocess.run([sys.executable, *command[1:]], cwd=cwd, capture_output=True, text=True, timeout=1200,
                            env={'OMP_NUM_THREADS': '1', 'PATH': '/usr/bin:/bin'})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def assert_analysed(output, out):
    """tools/analyze.py's measures of PerViT-T at 64 px (a 4 x 4 grid in each of its 12 layers) and its figures."""
    record = json.loads((out / 'metrics.json').read_text())
    assert record['num_images'] == 9 and len(record['layers']) == 12
    for layer in record['layers']:
        assert layer['grid'] == [4, 4]  # 64 / 16
        values = np.array(layer['nonlocality_position'], dtype=float)  # one per head
        assert values.size and np.isfinite(values).all() and (values >= 0).all()
    for name in ('position.png', 'samples.png', 'measures.png'):
        assert (out / name).read_bytes()[:4] == b'\x89PNG'
    assert f'wrote {out / "metrics.json"}' in output


@pytest.mark.slow
def test_the_documented_commands_learn_where_things_are_and_test_at_other_sizes(tmp_path):
    """docs/your-data.md's commands with recipe=position, on a left / right folder, a DeiT-T + RoPE and
    a PerViT-T well above chance, tested at 1x (the config's size, from the config the training saved)
    and 1.5x; the PerViT-T analysed by tools/analyze.py (a study with the recipe: test_your_data.py)."""
    draw_position_folder(tmp_path / 'data' / 'mydata')
    (tmp_path / 'configs').symlink_to(REPO / 'configs')
    (tmp_path / 'tools').symlink_to(REPO / 'tools')
    train, test = documented_commands()
    assert 'recipe=position' in train and test[-2:] == ['--img-size', '96']
    finals = {}
    for config in ('configs/your_data/deit_t_image_folder.py', 'configs/your_data/pervit_t_image_folder.py'):
        work_dir = tmp_path / Path(config).stem
        command = [part if part != 'work_dirs/where' else str(work_dir) for part in train
                   if not (config.endswith('pervit_t_image_folder.py') and part.startswith('phi='))]  # PerViT's own Φp
        command[2] = config
        output = run([*command, *SMALL_MACHINE], tmp_path)
        finals[config] = float(re.search(r'Last validation: accuracy/top1: ([\d.]+)', output).group(1))
        saved_config, checkpoint = work_dir / Path(config).name, work_dir / 'epoch_30.pth'
        assert 'Finished 30 epochs' in output and list(work_dir.glob('best_accuracy_top1_epoch_*.pth'))
        assert f'python tools/analyze.py {saved_config} ' in output  # the config with the command line's settings
        for size in ('64', '96') if 'pervit' in config else ('96',):  # 1x and 1.5x (1x once: the same path)
            tested = run([test[0], test[1], str(saved_config), str(checkpoint), '--img-size', size,
                          '--out', str(work_dir / f'top1_{size}.json'), '--work-dir', str(work_dir / f'test_{size}')],
                         tmp_path)
            assert f'Metrics at {size} x {size} pixels' in tested
            written = json.loads((work_dir / f'top1_{size}.json').read_text())
            assert 0 <= written['accuracy/top1'] <= 100 and written['img_size'] == [int(size)] * 2
        assert "(the config's test size: 64 x 64)" in tested  # the one at 96
    assert_analysed(run(['python', 'tools/analyze.py', str(saved_config), str(checkpoint), '--out',
                         str(tmp_path / 'analysis'), '--num-images', '9', '--show-images', '2'], tmp_path),
                    tmp_path / 'analysis')
    print(f'final top-1 with recipe=position: {finals}')
    assert all(top1 >= 80.0 for top1 in finals.values()), finals  # chance is 50
