"""PositionalRelations, the harder embedded benchmark: its scenes (the class recomputed from the
targets' places, an oracle independent of how they were drawn), its rendering at the training
scale, at another scale (the same scenes) and on a larger canvas (the same pixel sizes), the
dataset, tools/test.py --extent, and the relations study (slow: a short run through
tools/compare_phis.py)."""
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import require_openmmlab

require_openmmlab()  # before the OpenMMLab imports

from mmengine.config import Config

from conftest import REPO, load_test_tool
from posattn_openmmlab.datasets import PositionalRelations
from posattn_openmmlab.relations_dataset import (CLASSES, DISTRACTOR_RADIUS, DISTRACTORS, TARGET_RADIUS,
                                                 TRAIN_CANVAS, draw_scenes, render_relations)
from posattn_openmmlab.shapes_dataset import SHAPES

CANVASES = (64, 96, 128)


def targets(scene):
    return [shape for shape in scene.shapes if not shape.outline]


@pytest.mark.parametrize('canvas', CANVASES)
def test_every_scene_is_of_its_class_by_the_targets_places(canvas):
    """Three filled targets, one of each shape; the class is (leftmost, topmost) by their centres,
    each ahead of the next by a margin; shapes keep their pixel sizes on every canvas; distractors
    are outlines that never touch a target's box."""
    scenes = draw_scenes(450, seed=3, canvas=canvas)
    for scene in scenes:
        found = targets(scene)
        assert sorted(shape.kind for shape in found) == list(range(len(SHAPES)))
        by_x, by_y = sorted(found, key=lambda s: s.cx), sorted(found, key=lambda s: s.cy)
        assert CLASSES[scene.label] == f'{SHAPES[by_x[0].kind]} leftmost, {SHAPES[by_y[0].kind]} topmost'
        assert by_x[1].cx - by_x[0].cx >= 3 and by_y[1].cy - by_y[0].cy >= 3
        assert all(TARGET_RADIUS[0] <= s.radius <= TARGET_RADIUS[1] for s in found)
        assert all(s.radius <= s.cy <= canvas - s.radius and s.radius <= s.cx <= canvas - s.radius for s in found)
        distractors = scene.shapes[3:]
        assert len(distractors) <= DISTRACTORS and all(s.outline for s in distractors)
        assert all(DISTRACTOR_RADIUS[0] <= d.radius <= DISTRACTOR_RADIUS[1] for d in distractors)
        for d in distractors:
            assert all(max(abs(d.cy - t.cy), abs(d.cx - t.cx)) >= d.radius + t.radius + 1 for t in found)
    labels = np.array([scene.label for scene in scenes])
    assert np.bincount(labels, minlength=len(CLASSES)).tolist() == [50] * len(CLASSES)
    assert np.mean([len(scene.shapes) > 3 for scene in scenes]) > 0.6  # most images show a distractor


def test_the_same_arguments_give_the_same_bytes_and_another_seed_other_images():
    images, labels = render_relations(40, seed=5)
    again, labels_again = render_relations(40, seed=5)
    assert images.dtype == np.uint8 and images.shape == (40, 64, 64, 3)
    assert np.array_equal(images, again) and np.array_equal(labels, labels_again)
    other, _ = render_relations(40, seed=6)
    assert not np.array_equal(images, other)
    assert np.bincount(render_relations(10, seed=0)[1], minlength=9).max() == 2  # balanced to within one


def centre_pixel(value: float, canvas: int, img_size: int) -> int:
    """The pixel of an img_size image whose centre is nearest frame coordinate ``value``."""
    return int(round((value + 0.5) * img_size / canvas - 0.5))


@pytest.mark.parametrize('canvas,img_size', [(64, 64), (64, 32), (64, 128), (128, 128)])
def test_each_target_is_drawn_where_its_scene_puts_it(canvas, img_size):
    """At the training scale, scaled (the same scenes: labels and colours at the same relative
    places) and on a larger canvas: the pixel at each target's centre has its colour."""
    scenes = draw_scenes(30, seed=2, canvas=canvas)
    images, labels = render_relations(30, img_size, seed=2, canvas=canvas)
    assert labels.tolist() == [scene.label for scene in scenes]
    for image, scene in zip(images, scenes):
        for shape in targets(scene):
            y, x = centre_pixel(shape.cy, canvas, img_size), centre_pixel(shape.cx, canvas, img_size)
            assert image[y, x].tolist() == np.clip(shape.colour, 0, 255).astype(np.uint8).tolist()


def test_a_larger_canvas_keeps_the_pixels_per_shape_and_adds_tokens():
    """The extent test: shapes of the training scale's pixel sizes (target pixels per image alike),
    spread over the larger canvas."""
    def target_pixels(canvas):
        scenes = draw_scenes(200, seed=1, canvas=canvas)
        return np.mean([sum(shape.radius ** 2 for shape in targets(scene)) for scene in scenes]), scenes
    at_64, _ = target_pixels(64)
    at_128, scenes = target_pixels(128)
    assert at_128 == pytest.approx(at_64, rel=0.1)
    assert max(shape.cx for scene in scenes for shape in targets(scene)) > 100


def test_sizes_too_small_are_refused():
    with pytest.raises(ValueError, match='cannot hold three targets'):
        draw_scenes(2, canvas=16)
    with pytest.raises(ValueError, match='>= 8 pixels'):
        render_relations(2, img_size=4)


def test_the_dataset_generates_its_split_with_its_canvas():
    train = PositionalRelations(split='train', num_images=18, img_size=32)
    assert len(train) == 18 and train.metainfo['classes'] == CLASSES
    assert train[0]['img'].shape == (32, 32, 3) and train.canvas == TRAIN_CANVAS
    val = PositionalRelations(split='val', num_images=18, img_size=32)
    assert not np.array_equal(train[0]['img'], val[0]['img'])
    wide = PositionalRelations(split='val', num_images=18, img_size=96, canvas=96)
    assert wide[0]['img'].shape == (96, 96, 3)
    expected, labels = render_relations(18, 96, seed=1, canvas=96)
    assert np.array_equal(np.stack([wide[i]['img'] for i in range(18)]), expected)
    assert [wide[i]['gt_label'] for i in range(18)] == labels.tolist()


def relations_config():
    cfg = Config.fromfile(str(REPO / 'configs' / 'study' / 'deit-t-half_none_shapes.py'))
    data = Config.fromfile(str(REPO / 'configs' / '_base_' / 'relations.py'))
    cfg.test_dataloader = data.test_dataloader
    return cfg


def test_extent_and_scale_rewrite_the_relations_test_split():
    import posattn_openmmlab.sizes as tool
    cfg = relations_config()
    assert tool.config_test_size(cfg) == (64, 64)
    said = tool.set_test_extent(cfg, 128)
    dataset = cfg.test_dataloader.dataset
    assert (dataset.img_size, dataset.canvas) == (128, 128) and 'canvas of 128 x 128' in said
    cfg = relations_config()
    tool.set_test_size(cfg, (128, 128))
    assert cfg.test_dataloader.dataset.img_size == 128 and 'canvas' not in cfg.test_dataloader.dataset
    shapes = Config.fromfile(str(REPO / 'configs' / 'study' / 'deit-t-half_none_shapes.py'))
    with pytest.raises(ValueError, match='--extent draws PositionalRelations scenes.*PositionalShapes.*--img-size'):
        tool.set_test_extent(shapes, 128)
    with pytest.raises(ValueError, match='--extent 16: a canvas must be >= 26 pixels'):
        tool.set_test_extent(relations_config(), 16)


def test_the_command_line_takes_a_scale_or_an_extent(capsys):
    tool = load_test_tool()
    assert tool.parse_args(['c.py', 'ck.pth', '--extent', '96']).extent == 96
    for argv in (['--extent', '96', '--img-size', '96'], ['--extent', '0']):
        with pytest.raises(SystemExit):
            tool.parse_args(['c.py', 'ck.pth', *argv])
    assert 'not allowed with argument' in capsys.readouterr().err


def test_the_relations_study_has_every_registered_phi_clipped_on_the_relations_data():
    """The resolution study's rows, and the decomposed tables, which complete the registered Φp."""
    import posattn
    from posattn_openmmlab.study import STUDIES, load_study
    relations, resolution = load_study(STUDIES / 'relations.py'), load_study(STUDIES / 'resolution.py')
    assert [(row.name, row.path) for row in relations.rows.values() if row.name != 'decomposed_rpb'] == \
        [(row.name, row.path) for row in resolution.rows.values()]
    assert set(posattn.list_phis()) - {'none'} <= set(relations.rows)
    assert all(row.options == (('optim_wrapper.clip_grad.max_norm', 1.0),) for row in relations.rows.values())
    assert relations.data.resolve() == REPO / 'configs' / '_base_' / 'relations.py'
    assert relations.test_size_factors == (0.5, 1.0, 1.5, 2.0) and relations.test_extent_factors == (1.0, 1.5, 2.0)


def test_the_relations_ablations_are_the_ablation_rows_on_the_relations_data_sharing_row_a():
    """Its rows are the ablation study's on PositionalRelations; row (a) is the relations study's
    PerViT-T row, the same config and options, so a finished run of one is a finished run of the other."""
    from posattn_openmmlab.study import STUDIES, load_data, load_study, run_options
    from posattn_openmmlab.study.spec import config_digest, recorded_options, row_config, with_options
    study, ablations = load_study(STUDIES / 'relations_ablations.py'), load_study(STUDIES / 'ablations.py')
    relations = load_study(STUDIES / 'relations.py')
    assert [(row.name, row.label) for row in study.rows.values()] == \
        [(row.name, row.label) for row in ablations.rows.values()]
    assert [row.path for row in study.rows.values()][1:] == [row.path for row in ablations.rows.values()][1:]
    assert (study.rows['a'].path, study.rows['a'].options) == (relations.rows['pervit_t'].path,
                                                               relations.rows['pervit_t'].options)
    assert study.data == relations.data and study.analyse
    data = load_data(study.data)
    for name, row in study.rows.items():  # every row clipped: (a) by its options, the others by their configs
        config = with_options(row_config(row, data), run_options(row, 0, {}))
        assert config.optim_wrapper.clip_grad.max_norm == 1.0, name
        assert config.train_dataloader.dataset.type == 'PositionalRelations', name
    runs = [(recorded_options(run_options(row, 0, {})), config_digest(with_options(row_config(row, data),
                                                                                   run_options(row, 0, {}))))
            for row in (study.rows['a'], relations.rows['pervit_t'])]
    assert runs[0] == runs[1]


@pytest.mark.slow
def test_the_relations_study_tests_each_run_at_other_scales_and_extents(tmp_path):
    """tools/compare_phis.py --experiment relations on a short budget: each run tested at every scale
    and extent once; at 1x both are the validation split (the same images, the same top-1)."""
    command = [sys.executable, 'tools/compare_phis.py', '--experiment', 'relations', '--rows', 'none', '--no-timing',
               '--epochs', '2', '--work-dir', str(tmp_path), '--cfg-options', 'train_dataloader.dataset.num_images=64',
               'train_dataloader.batch_size=32', 'val_dataloader.dataset.num_images=36',
               'test_dataloader.dataset.num_images=36']
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (run,) = json.loads((tmp_path / 'comparison.json').read_text())['runs']
    assert list(run['top1_at']['size']) == ['32', '64', '96', '128']
    assert list(run['top1_at']['extent']) == ['64', '96', '128']
    final = run['top1_per_epoch'][-1]
    assert run['top1_at']['size']['64'] == pytest.approx(final) and run['top1_at']['extent']['64'] == pytest.approx(final)
    measured = json.loads((tmp_path / 'none' / 'seed0' / 'extent' / 'top1_at_128.json').read_text())
    assert measured['img_size'] == [128, 128]
    table = (tmp_path / 'comparison.md').read_text()
    assert 'test scenes of the training scale on a larger canvas' in table
    assert '| 1x: 64 px | 1.5x: 96 px | 2x: 128 px |' in table
    assert (tmp_path / 'extent.png').read_bytes()[:4] == b'\x89PNG'
    assert 'max_norm=1.0' in (tmp_path / 'none' / 'seed0' / 'config.py').read_text()  # clipped: the study's options

    # --report: the finished run tabulated again, the seed that never ran left out, nothing trained
    again = subprocess.run(command + ['--seeds', '0', '1', '--report'], cwd=REPO, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert 'Epoch(' not in again.stdout and not (tmp_path / 'none' / 'seed1').exists()
    assert 'seed1' in again.stdout and 'left out of the tables' in again.stdout
    assert json.loads((tmp_path / 'comparison.json').read_text())['runs'] == [run]
