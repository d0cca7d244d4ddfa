"""tools/test.py --img-size: a checkpoint evaluated at another input size without fine-tuning.

The embedded set drawn at another size (the same scenes, shapes scaled with the image); the
ImageNet test pipelines rewritten to DeiT's evaluation at that size (pure functions on the loaded
configs); the refusals; and, for each model family of the classification configs (a ViT with a
learned absolute embedding, one without, PerViT, a swapped mmpretrain ViT), a checkpoint trained at
64 x 64 evaluated at 32, 96 and 128 through the tool, with what the model saw recorded by a hook
(slow: tools/train.py in a subprocess)."""
import json
import sys

import numpy as np
import pytest
import torch

from conftest import require_openmmlab

require_openmmlab()  # before the OpenMMLab imports

from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper
from mmengine.registry import HOOKS
from mmpretrain.registry import MODELS, TRANSFORMS

import posattn._memory
from conftest import REPO, load_test_tool, run_tool
from posattn.attention import LogitsProbe
import posattn_openmmlab.evaluation as evaluation
import posattn_openmmlab.sizes as sizes
from posattn_openmmlab.datasets import PositionalShapes
from posattn_openmmlab.shapes_dataset import SCENE_SIZE, pixel_centres, render_shapes

TRAINED_AT = 64
SIZES = (32, 96, 128)
PATCH = 16  # every family's tokens: one per 16 x 16 pixels
TEST_IMAGES = 12
NUM_ATTENTION_LAYERS = 12  # in every family here
IMAGENET_CONFIGS = ('deit_t_none_imagenet.py', 'deit_t_peg_imagenet.py', 'pervit_t_imagenet.py',
                    'swap/deit-s_peripheral_imagenet.py', 'ablations/pervit-m_transfer-cifar10.py',
                    'ablations/pervit-m_transfer-inat19.py')
# config: --cfg-options its training needs (the swap config's checkpoints to start from: none, from scratch)
FAMILIES = {
    'deit_t_none_shapes.py': (),  # posattn's ViT, learned absolute embedding resampled to the grid
    'deit_t_peg_shapes.py': (),  # no absolute embedding: CPVT's PEG
    'pervit_t_shapes.py': (),
    'swap/deit-t_finetune-peripheral_shapes.py': ('model.backbone.backbone.init_cfg=None', 'model.head.init_cfg=None'),
}
WITH_PHI_BIAS = ('pervit_t_shapes.py', 'swap/deit-t_finetune-peripheral_shapes.py')  # peripheral Φp in every layer
# A few iterations on a few images: these check the mechanics, not the accuracy.
SHORT_TRAINING = ('train_dataloader.dataset.num_images=8', 'train_dataloader.batch_size=8', 'train_cfg.max_epochs=2')
SHORT_TEST = (f'test_dataloader.dataset.num_images={TEST_IMAGES}', f'test_dataloader.batch_size={TEST_IMAGES}')


tool = load_test_tool()


def config(name):
    return Config.fromfile(REPO / 'configs' / name)


# ---------------------------------------------------------------- the embedded set at other sizes


def shape_pixels(image):
    """Mask (H, W) of an image's shape pixels: every channel >= 130 (shape colours are drawn in
    130-255; the background in 0-90 with noise of std 12, 3.3 std below)."""
    return (image >= 130).all(axis=-1)


def centroid_and_area(image):
    """The shape pixels' centroid (row, column) in the scene frame's pixels, and their share of the image."""
    mask = shape_pixels(image)
    centres = pixel_centres(image.shape[0])
    rows, cols = np.nonzero(mask)
    return np.array([centres[rows].mean(), centres[cols].mean()]), mask.mean()


def test_the_embedded_set_at_three_times_the_frame_holds_the_frames_pixels():
    """At 192 x 192, pixels 1, 4, 7, ... are centred on the 64-pixel frame's own pixels: there the
    shapes are those of the 64 x 64 rendering, pixel for pixel and colour for colour; only the
    background noise is drawn afresh."""
    reference, labels = render_shapes(24, img_size=SCENE_SIZE, seed=1)
    images, same_labels = render_shapes(24, img_size=3 * SCENE_SIZE, seed=1)
    sampled = images[:, 1::3, 1::3]
    shapes = np.stack([shape_pixels(image) for image in reference])
    assert np.array_equal(labels, same_labels) and shapes.any(axis=(1, 2)).all()
    assert np.array_equal(np.stack([shape_pixels(image) for image in sampled]), shapes)
    assert np.array_equal(sampled[shapes], reference[shapes])
    assert (sampled[~shapes] != reference[~shapes]).mean() > 0.9


@pytest.mark.parametrize('size', SIZES)
def test_the_embedded_set_draws_the_same_scenes_at_another_size(size):
    """The same seed gives the same labels and the same shapes in the same places, scaled with the
    image: the shape pixels' centroid (in the 64-pixel frame) within a pixel of the coarser of the
    two renderings from the 64 x 64 one's (another scene's is 13 frame pixels away on average), their
    share of the image within 10%; the background noise is drawn at that size, pixel by pixel."""
    reference, labels = render_shapes(24, img_size=SCENE_SIZE, seed=1)
    images, same_labels = render_shapes(24, img_size=size, seed=1)
    assert images.shape == (24, size, size, 3) and np.array_equal(labels, same_labels)
    coarsest_pixel = max(1.0, SCENE_SIZE / size)  # in frame pixels
    for index, (image, at_default) in enumerate(zip(images, reference)):
        (centroid, area), (expected_centroid, expected_area) = centroid_and_area(image), centroid_and_area(at_default)
        assert np.abs(centroid - expected_centroid).max() < coarsest_pixel, index
        assert abs(area - expected_area) < 0.1 * expected_area, index
    assert 10 < np.median(np.abs(neighbour_differences(images))) < 13  # N(0, 2 x 12^2): median |d| 11.4


def neighbour_differences(images):
    """Channel 0's differences between horizontally adjacent background pixels, in the images whose
    background is bright enough (median above 45) that its noise is not clipped at 0."""
    differences = []
    for image in images.astype(float):
        background = ~shape_pixels(image)
        if np.median(image[..., 0][background]) > 45:
            both = background[:, 1:] & background[:, :-1]
            differences.append(np.diff(image[..., 0], axis=1)[both])
    return np.concatenate(differences)


def test_the_frame_renders_at_its_own_pixels_and_small_sizes_are_refused():
    assert np.array_equal(pixel_centres(SCENE_SIZE), np.arange(SCENE_SIZE, dtype=np.float32))
    np.testing.assert_allclose(pixel_centres(2 * SCENE_SIZE)[:3], [-0.25, 0.25, 0.75])
    with pytest.raises(ValueError, match='img_size 31 is too small to place two shapes side by side; use >= 32'):
        render_shapes(1, img_size=31)


# ---------------------------------------------------------------- the config rewrites (no data)


@pytest.mark.parametrize('name', IMAGENET_CONFIGS)
def test_an_imagenet_test_pipeline_is_rewritten_to_deits_evaluation_at_that_size(name):
    """DeiT's and CPVT's evaluation at 384: short edge floor(384 / 0.875) = 438, centre crop 384,
    bicubic; the other transforms, and the validation pipeline, as they were."""
    cfg = config(name)
    original = cfg.test_dataloader.dataset.pipeline
    assert sizes.config_test_size(cfg) == (224, 224)
    change = sizes.set_test_size(cfg, (384, 384))
    pipeline = cfg.test_dataloader.dataset.pipeline
    resize, crop = sizes.resize_crop_indices(pipeline)
    assert pipeline[resize].scale == 438 == int(384 / 0.875) and pipeline[resize].interpolation == 'bicubic'
    assert pipeline[crop].crop_size == 384 and sizes.config_test_size(cfg) == (384, 384)
    assert [t for i, t in enumerate(pipeline) if i not in (resize, crop)] == \
        [t for i, t in enumerate(original) if i not in (resize, crop)]
    assert cfg.val_dataloader.dataset.pipeline == original
    assert change == ("the test pipeline's ResizeEdge to a short edge of 438 (the config's: 256), bicubic, and its "
                      "CenterCrop to 384 x 384 (the config's: 224 x 224)")


def test_the_rewrite_keeps_the_config_at_its_own_size_and_keeps_its_crop_ratio():
    pipeline = config('deit_t_none_imagenet.py').test_dataloader.dataset.pipeline
    assert sizes.resized_pipeline(pipeline, (224, 224)) == pipeline  # 256 -> 224 already, bicubic
    wider = [dict(t, scale=288) if t['type'] == 'ResizeEdge' else t for t in pipeline]  # crop ratio 224 / 288
    resize, crop = sizes.resize_crop_indices(wider)
    rewritten = sizes.resized_pipeline(wider, (112, 112))
    assert (rewritten[resize]['scale'], rewritten[crop]['crop_size']) == (144, 112)
    assert wider[resize]['scale'] == 288  # the argument is left as it was


@pytest.mark.parametrize('size', [(384, 384), (320, 384), (96, 64)])
def test_the_rewritten_transforms_give_images_of_that_size(size):
    """The rewritten ResizeEdge and CenterCrop, built by mmpretrain, on a 375 x 500 image."""
    pipeline = sizes.resized_pipeline(config('deit_t_none_imagenet.py').test_dataloader.dataset.pipeline, size)
    resize, crop = sizes.resize_crop_indices(pipeline)
    image = np.random.default_rng(0).integers(0, 256, size=(375, 500, 3), dtype=np.uint8)
    results = dict(img=image, img_shape=image.shape[:2], ori_shape=image.shape[:2])
    for transform in (pipeline[resize], pipeline[crop]):
        results = TRANSFORMS.build(transform)(results)
    assert results['img'].shape == (*size, 3)


def test_the_embedded_set_is_generated_at_that_size():
    cfg = config('pervit_t_shapes.py')
    assert sizes.config_test_size(cfg) == (64, 64)
    change = sizes.set_test_size(cfg, (96, 96))
    assert cfg.test_dataloader.dataset.img_size == 96 and cfg.val_dataloader.dataset.img_size == 64
    assert sizes.config_test_size(cfg) == (96, 96)
    assert change == ("the PositionalShapes test split generated at 96 x 96 pixels (the config's: 64 x 64), "
                      "the same scenes")
    settings = {k: v for k, v in cfg.test_dataloader.dataset.items() if k != 'type'}
    dataset = PositionalShapes(**dict(settings, num_images=6))
    assert dataset.get_data_info(0)['img'].shape == (96, 96, 3)


def with_test_pipeline(*sizing):
    """The ImageNet DeiT-T config with a test pipeline of ``sizing`` transforms between loading and packing."""
    cfg = config('deit_t_none_imagenet.py')
    cfg.test_dataloader.dataset.pipeline = [dict(type='LoadImageFromFile'), *sizing, dict(type='PackInputs')]
    return cfg


def run_transforms(pipeline, image):
    """The transforms of ``pipeline`` between loading and packing, built by mmpretrain, on ``image``."""
    results = dict(img=image, img_shape=image.shape[:2], ori_shape=image.shape[:2])
    for transform in pipeline[1:-1]:
        results = TRANSFORMS.build(transform)(results)
    return results['img']


# (a test pipeline's one sizing transform, the (height, width) it gives); mmcv's Resize states (width,
# height), mmpretrain's RandomResizedCrop (height, width)
FIXED_SIZES = [(dict(type='Resize', scale=224), (224, 224)), (dict(type='Resize', scale=(48, 32)), (32, 48)),
               (dict(type='RandomResizedCrop', scale=(48, 32), backend='pillow'), (48, 32))]


@pytest.mark.parametrize('transform, size', FIXED_SIZES)
def test_a_pipeline_sized_by_one_resize_or_random_resized_crop_is_rewritten_to_that_size(transform, size):
    """The test size read from the pipeline, and the rewrite to 96 x 128 and to 64 x 64, are the sizes
    mmpretrain's transforms give a 375 x 500 image."""
    cfg = with_test_pipeline(transform)
    image = np.random.default_rng(0).integers(0, 256, size=(375, 500, 3), dtype=np.uint8)
    assert sizes.config_test_size(cfg) == size == run_transforms(cfg.test_dataloader.dataset.pipeline, image).shape[:2]
    for asked in ((96, 128), (64, 64)):
        rewritten = with_test_pipeline(transform)
        change = sizes.set_test_size(rewritten, asked)
        assert change == (f"the test pipeline's {transform['type']} to {asked[0]} x {asked[1]} (the config's: "
                          f"{size[0]} x {size[1]})")
        pipeline = rewritten.test_dataloader.dataset.pipeline
        assert sizes.config_test_size(rewritten) == asked == run_transforms(pipeline, image).shape[:2]
        assert {k: v for k, v in pipeline[1].items() if k != 'scale'} == \
            {k: v for k, v in transform.items() if k != 'scale'}  # its other settings as they were


def test_what_cannot_be_rewritten_is_an_error_naming_the_keys_to_set():
    with pytest.raises(ValueError, match=r'PositionalShapes draws square images: give one side, --img-size 96; '
                                         r'got 96 x 128'):
        sizes.set_test_size(config('deit_t_none_shapes.py'), (96, 128))
    cfg = with_test_pipeline(dict(type='Resize', scale=224, keep_ratio=True))  # images of several sizes
    with pytest.raises(ValueError) as refusal:
        sizes.set_test_size(cfg, (384, 384))
    assert str(refusal.value) == (
        "--img-size cannot rewrite this config's test data, a CheckedImageNet whose pipeline is [LoadImageFromFile, "
        "Resize, PackInputs]: it rewrites PositionalShapes (img_size), test pipelines that resize the short edge "
        "(ResizeEdge) and crop the centre (CenterCrop), those whose one sizing transform is a Resize without "
        "keep_ratio or a RandomResizedCrop, and those whose sizing keys the config links to img_size (square "
        "sizes). Set the size by hand: --cfg-options test_dataloader.dataset.pipeline.1.scale=...")
    assert sizes.config_test_size(cfg) is None


def test_the_size_recorded_is_the_one_every_tested_image_had():
    """What --out records as img_size: the (height, width) of the images the loader gave, None where
    they differ."""
    tested = evaluation.TestedImageSizes()
    assert tested.size() is None  # nothing tested
    tested.after_test_iter(None, 0, dict(inputs=[torch.zeros(3, 32, 48, dtype=torch.uint8)] * 2))
    tested.after_test_iter(None, 1, dict(inputs=[torch.zeros(3, 32, 48, dtype=torch.uint8)]))
    assert tested.size() == (32, 48)
    tested.after_test_iter(None, 2, dict(inputs=[torch.zeros(3, 48, 48, dtype=torch.uint8)]))
    assert tested.size() is None


@pytest.mark.parametrize('name', ['mask-rcnn_pervit-t_shapes.py', 'upernet_pervit-t_shapes.py'])
def test_detectors_and_segmentors_are_refused_with_the_keys_to_set(name):
    with pytest.raises(ValueError) as refusal:
        sizes.set_test_size(config(name), (96, 96))
    message = str(refusal.value)
    assert message.startswith("--img-size evaluates classifiers (mmpretrain's ImageClassifier and the like); "
                              "this config's model is ")
    assert 'test_dataloader.dataset.img_size=...' in message  # the dense set's generated size
    if name.startswith('mask-rcnn'):
        assert 'test_dataloader.dataset.pipeline.1.scale=...' in message  # its Resize


def test_the_command_line_refuses_bad_sizes_and_unsupported_configs(capsys):
    assert tool.parse_args(['c.py', 'k.pth', '--img-size', '96']).img_size == (96, 96)
    assert tool.parse_args(['c.py', 'k.pth', '--img-size', '96', '128']).img_size == (96, 128)
    for bad in (['1', '2', '3'], ['0']):
        with pytest.raises(SystemExit):
            tool.parse_args(['c.py', 'k.pth', '--img-size', *bad])
        assert f'--img-size takes one side N or a height and a width H W, in pixels >= 1; got {" ".join(bad)}' in \
            capsys.readouterr().err
    with pytest.raises(SystemExit) as refusal:  # before a runner is built: no checkpoint read
        tool.main(['configs/mask-rcnn_pervit-t_shapes.py', 'missing.pth', '--img-size', '96'])
    assert str(refusal.value).startswith('tools/test.py configs/mask-rcnn_pervit-t_shapes.py: --img-size evaluates '
                                         'classifiers')
    with pytest.raises(SystemExit):
        tool.parse_args(['--help'])
    assert 'PositionalShapes is generated at N x N' in ' '.join(capsys.readouterr().out.split())


# ---------------------------------------------------------------- sizes that cannot fit


@pytest.fixture
def memory_available(monkeypatch):
    """Sets the memory posattn's checks read as available (in GiB): the refusals below do not depend
    on the machine."""
    def set_available(gib):
        monkeypatch.setattr(posattn._memory, 'available_bytes', lambda device: gib << 30)
    return set_available


def test_a_size_whose_test_images_cannot_fit_is_refused_before_the_data_are_made(memory_available, tmp_path):
    """--img-size 100000: a batch of 128 images is 128 x 3 x 100000^2 float32; refused before the
    embedded set is drawn at that size and before the checkpoint (absent here) is read."""
    memory_available(16)
    with pytest.raises(SystemExit) as refusal:
        tool.main(['configs/pervit_t_shapes.py', 'missing.pth', '--img-size', '100000', '--work-dir', str(tmp_path),
                   '--cfg-options', f'experiment_name=images_{tmp_path.name}'])
    needed = 128 * 3 * 100000 ** 2 * 4 / 2 ** 30
    assert str(refusal.value) == (
        f'tools/test.py configs/pervit_t_shapes.py: --img-size 100000 100000 cannot be tested here: a test batch of '
        f'128 images at 100000 x 100000 pixels (float32) needs at least {needed:.1f} GiB on cpu, which has 16.0 GiB '
        f'available: test at a smaller size. The config tests at 64 x 64')


def test_a_size_whose_attention_cannot_fit_is_refused_before_the_data_are_made(memory_available, tmp_path):
    """PerViT-T at 2048 x 2048, one image a batch: 128 x 128 = 16384 tokens, whose peripheral bias
    (4 heads, and its computation as large again) needs 2 x 4 x 16384^2 float32."""
    memory_available(4)
    with pytest.raises(SystemExit) as refusal:
        tool.main(['configs/pervit_t_shapes.py', 'missing.pth', '--img-size', '2048', '--work-dir', str(tmp_path),
                   '--cfg-options', 'test_dataloader.batch_size=1', f'experiment_name=attention_{tmp_path.name}'])
    needed = 2 * 4 * 16384 ** 2 * 4 / 2 ** 30
    message = str(refusal.value)
    assert message.startswith('tools/test.py configs/pervit_t_shapes.py: --img-size 2048 2048 cannot be tested '
                              'here: attention over 16384 tokens')
    assert f'in 4 heads needs at least {needed:.1f} GiB on cpu, which has 4.0 GiB available: ' in message
    assert message.endswith('. The config tests at 64 x 64')


def test_a_size_that_fits_passes_the_check_and_the_model_is_left_as_it_was(memory_available):
    memory_available(4)
    model = MODELS.build(config('pervit_t_shapes.py').model).train()
    probes = [module for module in model.modules() if isinstance(module, LogitsProbe)]
    for size in ((2048, 2048), (96, 128)):
        if size == (2048, 2048):
            with pytest.raises(MemoryError, match='attention over 16384 tokens'):
                evaluation.check_test_fits(model, size, batch_size=1)
        else:
            evaluation.check_test_fits(model, size, batch_size=128)
        assert model.training and len(probes) == 12 and not any(probe._forward_hooks for probe in probes)


# ---------------------------------------------------------------- each family through the tool


@HOOKS.register_module(force=True)
class SeenSizesHook(Hook):
    """Records what the model sees while it tests, saved to ``out``: the first batch's input at the
    backbone (B, 3, H, W), and for every attention layer's logits (posattn's LogitsProbe) the token
    grid, the number of tokens and the shape of the Φp's logits bias (None without one)."""

    def __init__(self, out):
        self.out = out
        self.inputs, self.logits = [], []

    def before_test(self, runner):
        model = runner.model.module if is_model_wrapper(runner.model) else runner.model
        model.backbone.register_forward_pre_hook(lambda module, args: self.inputs.append(args[0].detach().clone()))
        for module in model.modules():
            if isinstance(module, LogitsProbe):
                module.register_forward_hook(self.record_logits)

    def record_logits(self, module, args, output):
        q, _, bias, grid = args
        self.logits.append(dict(grid=(grid.height, grid.width, grid.num_prefix_tokens), tokens=q.shape[2],
                                bias=None if bias is None else tuple(bias.shape[-2:])))

    def after_test(self, runner):
        torch.save(dict(inputs=self.inputs, logits=self.logits), self.out)


class TrainedCheckpoints(dict):
    """config name -> a checkpoint of it trained at 64 x 64 by tools/train.py for two iterations,
    trained on first use."""

    def __init__(self, folder):
        super().__init__()
        self.folder = folder

    def __missing__(self, name):
        work_dir = self.folder / name.replace('/', '_')
        run_tool(sys.executable, 'tools/train.py', f'configs/{name}', '--work-dir', str(work_dir), '--no-validate',
                 '--cfg-options', *SHORT_TRAINING, *FAMILIES[name], timeout=300)
        self[name] = work_dir / 'epoch_2.pth'
        return self[name]


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    return TrainedCheckpoints(tmp_path_factory.mktemp('trained'))


def evaluate(name, checkpoint, tmp_path, *img_size):
    """tools/test.py on ``checkpoint`` in this process, with :class:`SeenSizesHook`: (metrics, the JSON
    written, what the model saw)."""
    label = '_'.join(map(str, img_size)) or 'config'
    seen, out = tmp_path / f'seen_{label}.pt', tmp_path / f'metrics_{label}.json'
    recording = tmp_path / f'recording_{label}.py'
    recording.write_text(f"_base_ = '{REPO / 'configs' / name}'\n"
                         f"custom_hooks = [dict(type='SeenSizesHook', out='{seen}')]\n"
                         f"experiment_name = 'resolution_{tmp_path.name}_{label}'\n")
    metrics = tool.main([str(recording), str(checkpoint), '--work-dir', str(tmp_path / label), '--out', str(out),
                         *(['--img-size', *map(str, img_size)] if img_size else []),
                         '--cfg-options', *SHORT_TEST, *FAMILIES[name]])
    return metrics, json.loads(out.read_text()), torch.load(seen, weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize('name', sorted(FAMILIES))
def test_a_checkpoint_trained_at_64_evaluates_at_other_sizes(name, trained, tmp_path):
    """At each size: finite metrics, the JSON records the size, the test split is generated at that
    size (the images the backbone gets are render_shapes' at that size, after the config's
    normalisation), and every attention layer attends over the grid of that size, its Φp bias (if
    any) computed for it."""
    checkpoint = trained[name]
    for size in SIZES:
        metrics, written, seen = evaluate(name, checkpoint, tmp_path, size)
        assert np.isfinite(metrics['accuracy/top1']) and 0 <= metrics['accuracy/top1'] <= 100
        assert written == dict(metrics, img_size=[size, size], extent=None)
        (inputs,) = seen['inputs']  # one batch
        images, _ = render_shapes(TEST_IMAGES, img_size=size, seed=PositionalShapes.SPLIT_SEEDS['val'])
        expected = torch.from_numpy(images).permute(0, 3, 1, 2).float()
        torch.testing.assert_close(inputs * 64.0 + 127.5, expected, rtol=0, atol=1e-3)  # the config's mean and std
        side = -(-size // PATCH)
        assert len(seen['logits']) == NUM_ATTENTION_LAYERS
        for layer in seen['logits']:
            height, width, prefix = layer['grid']
            tokens = prefix + side * side
            assert (height, width) == (side, side) and layer['tokens'] == tokens
            assert layer['bias'] in (None, (tokens, tokens))
        if name in WITH_PHI_BIAS:
            assert all(layer['bias'] is not None for layer in seen['logits'])


@pytest.mark.slow
def test_the_config_size_asked_for_is_the_config_evaluation(trained, tmp_path):
    """--img-size 64 on a 64 x 64 config gives the evaluation without it: the same images, the same metrics."""
    name = 'deit_t_none_shapes.py'
    checkpoint = trained[name]
    asked, asked_json, asked_seen = evaluate(name, checkpoint, tmp_path, TRAINED_AT)
    plain, plain_json, plain_seen = evaluate(name, checkpoint, tmp_path)
    assert asked == plain and asked_json == plain_json and plain_json['img_size'] == [TRAINED_AT, TRAINED_AT]
    assert torch.equal(asked_seen['inputs'][0], plain_seen['inputs'][0])


@pytest.mark.slow
def test_the_tool_prints_and_writes_the_size_it_evaluated_at(trained, tmp_path):
    name = 'deit_t_peg_shapes.py'
    checkpoint = trained[name]
    out = tmp_path / 'metrics.json'
    output = run_tool(sys.executable, 'tools/test.py', f'configs/{name}', str(checkpoint), '--img-size', '96',
                      '--work-dir', str(tmp_path), '--out', str(out), '--cfg-options', *SHORT_TEST, timeout=300)
    assert ("--img-size 96 96: the PositionalShapes test split generated at 96 x 96 pixels (the config's: "
            "64 x 64), the same scenes; the model as the config builds it, without fine-tuning") in output
    written = json.loads(out.read_text())
    assert written['img_size'] == [96, 96]
    assert (f"\nMetrics at 96 x 96 pixels, without fine-tuning (the config's test size: 64 x 64): "
            f"accuracy/top1: {written['accuracy/top1']:.4g}\n") in output
