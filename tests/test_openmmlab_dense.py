"""PosattnPerViT for detection and segmentation: windows and global blocks through the config,
with_cp, NCHW maps at mmdet's padded sizes, and the PosattnSimpleFPN neck in both toolboxes."""
import pytest
import torch

from conftest import require_openmmlab

require_openmmlab()  # before the OpenMMLab imports

from posattn_openmmlab import PosattnPerViT, PosattnSimpleFPN
from mmengine.registry import MODELS

SMALL = dict(embed_dims=(16, 24), depths=(1, 2), num_heads=2, stem_dims=(4, 4, 4, 8))  # stride 16


def test_nchw_maps_on_a_grid_that_mmdet_padding_gives():
    """800 x 1328 (mmdet pads 1333 to a multiple of 32) -> a 50 x 83 grid; windows of 14 pad it to 56 x 84."""
    backbone = MODELS.build(dict(type='PosattnPerViT', arch=SMALL, out_indices=(0, 2), window_size=14,
                                 global_blocks=(1,))).eval()
    assert [block.window_size for block in backbone.model.blocks] == [14, None, 14]
    with torch.no_grad():
        maps = backbone(torch.randn(1, 3, 800, 1328))
    assert [tuple(m.shape) for m in maps] == [(1, 24, 50, 83), (1, 24, 50, 83)]
    assert all(torch.isfinite(m).all() for m in maps)


def _gradients(backbone, images):
    maps = backbone(images)
    loss = sum((m * torch.linspace(-1, 1, m.numel()).view_as(m)).sum() for m in maps)
    loss.backward()
    return {n: p.grad.clone() for n, p in backbone.named_parameters() if p.grad is not None}


@pytest.mark.slow
def test_with_cp_forward_backward_at_320x480_gives_the_same_gradients():
    """PerViT-T, 14 x 14 windows on the 20 x 30 grid (padded to 28 x 42) and three global blocks."""
    cfg = dict(type='PosattnPerViT', arch='tiny', out_indices=(3, 11), window_size=14, global_blocks=(3, 7, 11),
               drop_path_rate=0.1, frozen_stages=1, norm_eval=True)
    plain = MODELS.build(cfg).train()
    checkpointed = MODELS.build(dict(cfg, with_cp=True)).train()
    checkpointed.load_state_dict(plain.state_dict())
    images = torch.randn(1, 3, 320, 480)
    torch.manual_seed(1)  # the same drop-path draws; checkpointing replays them in its recomputation
    expected = _gradients(plain, images)
    torch.manual_seed(1)
    got = _gradients(checkpointed, images)
    assert got.keys() == expected.keys() and not any(k.startswith(('stem.', 'model.stem.')) for k in got)
    assert not any(k.startswith('model.blocks.1.') for k in got)  # frozen stage 1
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert not checkpointed.model.stem.training  # frozen and norm_eval survive train()


def test_with_cp_is_off_at_eval_and_without_grad(monkeypatch):
    backbone = PosattnPerViT(arch=SMALL, out_indices=(2,), window_size=3, global_blocks=(2,), with_cp=True)
    calls = []
    original = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, 'checkpoint',
                        lambda *args, **kwargs: calls.append(kwargs['use_reentrant']) or original(*args, **kwargs))
    images = torch.randn(2, 3, 64, 80)
    backbone.train()(images)[0].sum().backward()
    assert calls == [False] * 3
    with torch.no_grad():
        backbone(images)
    backbone.eval()(images)
    assert len(calls) == 3


@pytest.mark.parametrize('registry_module', ['mmdet.registry', 'mmseg.registry'])
def test_simple_fpn_builds_in_both_toolboxes_with_strides_4_to_64(registry_module):
    registry = __import__(registry_module, fromlist=['MODELS']).MODELS
    assert 'PosattnSimpleFPN' not in registry.module_dict and registry.get('PosattnSimpleFPN') is PosattnSimpleFPN
    neck = registry.build(dict(type='PosattnSimpleFPN', in_channels=24, out_channels=8, num_outs=5))
    image = torch.randn(2, 3, 256, 208)
    backbone = PosattnPerViT(arch=SMALL, out_indices=(0, 2))
    maps = neck(backbone(image))  # uses the last backbone output, (2, 24, 16, 13)
    strides = [image.shape[-2] / m.shape[-2] for m in maps]
    assert strides == [4, 8, 16, 32, 64]
    assert [tuple(m.shape) for m in maps] == [(2, 8, 64, 52), (2, 8, 32, 26), (2, 8, 16, 13), (2, 8, 8, 7),
                                              (2, 8, 4, 4)]  # odd sides round up, as stride-2 convs do
    sum(m.sum() for m in maps).backward()
    assert all(p.grad is not None for p in neck.parameters())


def test_simple_fpn_layer_norm_and_errors():
    neck = PosattnSimpleFPN(in_channels=12, out_channels=6).double()
    x = torch.randn(1, 12, 4, 6, dtype=torch.float64)
    maps = neck((x,))
    assert len(maps) == 4 and [m.shape[-2:] for m in maps] == [(16, 24), (8, 12), (4, 6), (2, 3)]
    normed = maps[2].permute(0, 2, 3, 1)  # LN over channels at every position, unit affine at init
    torch.testing.assert_close(normed.mean(-1), torch.zeros(1, 4, 6, dtype=torch.float64), atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match=r'expected a \(B, 12, h, w\) map at index -1 of the backbone outputs, '
                                         r'got shape \(1, 8, 4, 6\)'):
        neck((torch.randn(1, 8, 4, 6, dtype=torch.float64),))
    with pytest.raises(ValueError, match='num_outs must be at least 4'):
        PosattnSimpleFPN(in_channels=12, num_outs=3)


def test_simple_fpn_outputs_are_contiguous_for_mmcv_roi_align():
    """mmcv's CPU RoIAlign reads memory as contiguous NCHW: on the channels-last strides a
    LayerNorm over channels leaves it returns wrong values, so the neck's outputs must be
    contiguous (the detector learned nothing before this was fixed)."""
    from mmcv.ops import RoIAlign
    torch.manual_seed(0)
    neck = PosattnSimpleFPN(in_channels=12, out_channels=8, num_outs=5)
    maps = neck((torch.randn(1, 12, 4, 6),))
    assert all(m.is_contiguous() for m in maps)
    rois = torch.tensor([[0, 2.0, 3.0, 40.0, 30.0]])
    roi_align = RoIAlign((7, 7), spatial_scale=0.25, sampling_ratio=0, aligned=True)
    channels_last = maps[0].permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    assert not torch.allclose(roi_align(channels_last, rois), roi_align(maps[0], rois))  # the trap
    from torchvision.ops import roi_align as torchvision_roi_align  # an independent implementation
    expected = torchvision_roi_align(maps[0], rois, (7, 7), spatial_scale=0.25, sampling_ratio=0, aligned=True)
    torch.testing.assert_close(roi_align(maps[0], rois), expected, rtol=1e-5, atol=1e-5)


def test_dense_set_is_announced_once_and_readable_by_everyone_the_umask_allows(tmp_path):
    """Generating logs what and where; the folder gets a new folder's mode under the umask (0750 under
    umask 027), not a private temporary folder's 0700; a second call finds the set and says nothing."""
    import stat
    import subprocess
    import sys
    root = tmp_path / 'shapes_dense'
    code = ('import os\n'
            'os.umask(0o027)\n'
            'from posattn_openmmlab.dense_shapes_dataset import ensure_dense_shapes\n'
            'for _ in range(2):\n'
            f'    ensure_dense_shapes({str(root)!r}, img_size=(64, 96), sizes=dict(train=2, val=1), seed=3)\n')
    result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    announced = [line for line in (result.stdout + result.stderr).splitlines() if 'dense shapes' in line]
    assert len(announced) == 1, announced
    assert announced[0].endswith(f'Generating the dense shapes set in {root}: 2 train and 1 val images of 64 x 96 '
                                 '(seed 3), with COCO boxes and masks and label maps; later runs reuse it')
    assert stat.S_IMODE(root.stat().st_mode) == 0o750
    assert not list(tmp_path.glob('.shapes_dense-*'))  # the staging folder was renamed into place
