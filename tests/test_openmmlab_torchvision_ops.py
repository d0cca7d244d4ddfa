"""mmcv's NMS and RoIAlign routed to torchvision (the GPU path of an mmcv without CUDA kernels),
checked on CPU: nothing is routed until asked, a routing for a block gives mmcv's functions back,
routing CPU tensors must give what mmcv's own CPU kernels give, and Mask R-CNN must train and
predict with every other mmcv kernel unavailable."""
import pytest
import torch

from conftest import require_openmmlab

require_openmmlab()  # before the OpenMMLab imports

import mmcv._ext as ext
from mmcv.ops import RoIAlign, nms, roi_align

from posattn_openmmlab import torchvision_ops
from posattn_openmmlab.torchvision_ops import (mmcv_has_cuda_kernels, mmcv_ops_routed, route_mmcv_ops_to_torchvision,
                                               unroute_mmcv_ops)
from conftest import REPO


ROUTED = ('nms', 'roi_align_forward', 'roi_align_backward')


@pytest.fixture
def cpu_routed():
    """CPU tensors go to torchvision for the test; afterwards nothing is routed."""
    route_mmcv_ops_to_torchvision(('cpu',))
    yield
    unroute_mmcv_ops()


def random_boxes(n, size=100.0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=generator) * size
    wh = torch.rand(n, 2, generator=generator) * size / 3 + 1
    return torch.cat([xy, xy + wh], 1), torch.randperm(n, generator=generator).float() / n  # distinct scores


def test_nothing_is_routed_until_asked_and_the_default_follows_how_mmcv_was_built():
    import posattn_openmmlab.detection  # noqa: F401
    assert not torchvision_ops._ORIGINALS and all(getattr(ext, name).__module__ == 'mmcv._ext' for name in ROUTED)
    expected = frozenset() if mmcv_has_cuda_kernels() else frozenset({'cuda'})
    try:
        assert route_mmcv_ops_to_torchvision() == expected
        assert set(torchvision_ops._ORIGINALS) == (set(ROUTED) if expected else set())
    finally:
        unroute_mmcv_ops()


def test_routing_for_a_block_gives_back_what_was_there():
    before = {name: getattr(ext, name) for name in ROUTED}
    with mmcv_ops_routed(('cpu',)) as devices:
        assert devices == {'cpu'} and all(getattr(ext, name) is not before[name] for name in ROUTED)
    assert {name: getattr(ext, name) for name in ROUTED} == before
    route_mmcv_ops_to_torchvision(('cuda',))  # a routing of the user's own, kept through the block
    try:
        routed = {name: getattr(ext, name) for name in ROUTED}
        with mmcv_ops_routed(('cpu',)):
            assert ext.nms is not routed['nms']
        assert {name: getattr(ext, name) for name in ROUTED} == routed
        with mmcv_ops_routed(()):  # nothing to route: nothing touched
            assert ext.nms is routed['nms']
    finally:
        unroute_mmcv_ops()
    assert {name: getattr(ext, name) for name in ROUTED} == before


def test_routed_nms_keeps_the_same_boxes(cpu_routed):
    boxes, scores = random_boxes(300)
    routed, routed_inds = nms(boxes, scores, 0.5)
    unroute_mmcv_ops()
    expected, expected_inds = nms(boxes, scores, 0.5)
    assert 20 < len(expected_inds) < 300
    torch.testing.assert_close(routed_inds, expected_inds, rtol=0, atol=0)
    torch.testing.assert_close(routed, expected, rtol=0, atol=0)


@pytest.mark.parametrize('aligned,sampling_ratio', [(True, 0), (False, 0), (True, 2)])
def test_routed_roi_align_matches_mmcv_forward_and_backward(cpu_routed, aligned, sampling_ratio):
    torch.manual_seed(0)
    features = torch.randn(2, 8, 20, 30, dtype=torch.float64)
    boxes, _ = random_boxes(40, size=100.0)
    rois = torch.cat([torch.randint(0, 2, (40, 1)).double(), boxes.double()], 1)
    weights = torch.randn(40, 8, 7, 7, dtype=torch.float64)

    def run():
        x = features.clone().requires_grad_()
        out = RoIAlign((7, 7), spatial_scale=0.25, sampling_ratio=sampling_ratio, aligned=aligned)(x, rois)
        (out * weights).sum().backward()
        return out.detach(), x.grad

    routed_out, routed_grad = run()
    unroute_mmcv_ops()
    mmcv_out, mmcv_grad = run()
    assert mmcv_out.abs().sum() > 0 and mmcv_grad.abs().sum() > 0
    torch.testing.assert_close(routed_out, mmcv_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(routed_grad, mmcv_grad, rtol=1e-10, atol=1e-10)


def test_what_torchvision_lacks_is_a_clear_error(cpu_routed):
    features, rois = torch.randn(1, 2, 8, 8), torch.tensor([[0.0, 1.0, 1.0, 5.0, 5.0]])
    with pytest.raises(NotImplementedError, match="pool_mode='max' has no torchvision kernel"):
        roi_align(features, rois, (2, 2), 1.0, 0, 'max', True)
    boxes, scores = random_boxes(5)
    with pytest.raises(NotImplementedError, match='offset=1 has no torchvision kernel'):
        nms(boxes, scores, 0.5, offset=1)


@pytest.mark.slow
def test_mask_rcnn_trains_and_predicts_with_no_mmcv_kernel_but_the_routed_ones(monkeypatch):
    """The situation on a GPU with a CPU-ops mmcv, simulated on CPU: every mmcv kernel fails, the
    routed ones go to torchvision; losses and gradients match a run on mmcv's own kernels."""
    from mmdet.testing import demo_mm_inputs
    from mmengine.config import Config
    from mmengine.registry import DefaultScope
    from mmdet.registry import MODELS

    cfg = Config.fromfile(REPO / 'configs' / 'mask-rcnn_pervit-t_shapes.py')
    batch = demo_mm_inputs(batch_size=2, image_shapes=[(3, 128, 192)] * 2, num_items=[3, 2], num_classes=3,
                           with_mask=True)

    def step():
        torch.manual_seed(0)
        with DefaultScope.overwrite_default_scope('mmdet'):  # restored after: other tests build in mmpretrain's
            model = MODELS.build(cfg.model)
        data = model.data_preprocessor(batch, True)
        losses = model.loss(data['inputs'], data['data_samples'])
        total = sum(v for key, value in losses.items() if 'loss' in key
                    for v in (value if isinstance(value, list) else [value]))
        total.backward()
        model.eval()
        with torch.no_grad():
            predictions = model.predict(data['inputs'], data['data_samples'])
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        return {k: float(sum(v) if isinstance(v, list) else v) for k, v in losses.items()}, grads, predictions

    expected_losses, expected_grads, _ = step()

    def unavailable(name):
        def kernel(*args, **kwargs):
            raise RuntimeError(f'{name} is not compiled with GPU support')  # what mmcv says on CUDA
        return kernel
    for name in dir(ext):
        if not name.startswith(('_', 'get_')) and callable(getattr(ext, name)):  # kernels, not build info
            monkeypatch.setattr(ext, name, unavailable(name))
    route_mmcv_ops_to_torchvision(('cpu',))
    try:
        losses, grads, predictions = step()
    finally:
        unroute_mmcv_ops()  # back to the unavailable kernels, which monkeypatch then restores

    assert losses.keys() == expected_losses.keys()
    for key, value in losses.items():
        assert value == pytest.approx(expected_losses[key], rel=1e-4, abs=1e-6), key
    torch.testing.assert_close(grads, expected_grads, rtol=1e-3, atol=1e-5)
    assert len(predictions) == 2 and predictions[0].pred_instances.masks.shape[-2:] == (128, 192)
