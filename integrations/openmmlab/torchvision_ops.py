"""mmcv's compiled ops that mmdet's Mask R-CNN calls, routed to torchvision's kernels where mmcv has none.

An mmcv built without ``FORCE_CUDA`` (the shared 2.1.0 wheel, or a quick CPU-ops build on a GPU
machine) has CPU kernels only: on CUDA tensors its ops stop with "not compiled with GPU support".
Mask R-CNN needs three of them, and torchvision ships the same operations with CUDA kernels:

    mmcv._ext.nms                 -> torchvision.ops.nms                 (RPN and box NMS; offset 0)
    mmcv._ext.roi_align_forward   -> torchvision's roi_align             (RoI features, mask targets;
    mmcv._ext.roi_align_backward  -> torchvision's _roi_align_backward    average pooling)

:func:`route_mmcv_ops_to_torchvision` wraps those three functions of ``mmcv._ext`` (mmcv's Python
ops look them up at call time, so mmcv's ``RoIAlign``, ``roi_align`` and ``nms`` and everything in
mmdet built on them follow): tensors on the listed device types go to torchvision, all others to
mmcv's own kernels. By default it routes CUDA tensors when mmcv was compiled without CUDA and
does nothing otherwise. Both libraries define RoIAlign the same way (Mask R-CNN's, with
``aligned`` shifting by half a pixel and ``sampling_ratio=0`` adaptive), which the tests check on
CPU by routing CPU tensors and comparing with mmcv's kernels. UPerNet calls no mmcv op.

Nothing is routed unless asked: importing ``posattn_openmmlab`` leaves ``mmcv._ext`` as it is.
``PosattnRunner`` routes for the duration of its own runs (:func:`mmcv_ops_routed`; the config key
``mmcv_ops_to_torchvision``, by default :func:`devices_without_mmcv_kernels`); a script of your own
calls :func:`route_mmcv_ops_to_torchvision`, or uses :func:`mmcv_ops_routed` around its work.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Tuple

import torch
import torchvision  # noqa: F401  (registers torch.ops.torchvision)

from posattn._compat import roi_align_backward_op

from ._compat import mmcv_kernels

__all__ = ['mmcv_has_cuda_kernels', 'devices_without_mmcv_kernels', 'route_mmcv_ops_to_torchvision',
           'unroute_mmcv_ops', 'mmcv_ops_routed']

_AVERAGE_POOLING = 1  # mmcv's pool_mode code for 'avg' (0 is 'max', which torchvision lacks)
_ORIGINALS: Dict[str, Callable] = {}


def mmcv_has_cuda_kernels() -> bool:
    """Whether the installed mmcv was compiled with its CUDA kernels."""
    from mmcv.ops import get_compiling_cuda_version
    return get_compiling_cuda_version() != 'not available'


def devices_without_mmcv_kernels() -> frozenset:
    """``{'cuda'}`` when this process sees a GPU and mmcv was compiled without its CUDA kernels,
    else nothing (mmcv is not even imported without a GPU)."""
    if not torch.cuda.is_available() or mmcv_has_cuda_kernels():
        return frozenset()
    return frozenset({'cuda'})


def _nms(original: Callable, devices: frozenset) -> Callable:
    def nms(bboxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float, offset: int = 0) -> torch.Tensor:
        if bboxes.device.type not in devices:
            return original(bboxes, scores, iou_threshold=iou_threshold, offset=offset)
        if offset != 0:
            raise NotImplementedError(f'nms with offset={offset} has no torchvision kernel (only offset 0); '
                                      f'build mmcv with FORCE_CUDA=1 for it')
        return torch.ops.torchvision.nms(bboxes, scores, float(iou_threshold))
    return nms


def _average_pooling_options(options: Dict[str, Any]) -> Tuple[float, int, int, int, bool]:
    """torchvision's (spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned) from the
    keyword options mmcv passes its RoIAlign kernels."""
    if options['pool_mode'] != _AVERAGE_POOLING:
        raise NotImplementedError("RoIAlign with pool_mode='max' has no torchvision kernel; "
                                  "build mmcv with FORCE_CUDA=1 for it")
    return (float(options['spatial_scale']), int(options['aligned_height']), int(options['aligned_width']),
            int(options['sampling_ratio']), bool(options['aligned']))


def _roi_align_forward(original: Callable, devices: frozenset) -> Callable:
    def roi_align_forward(input, rois, output, argmax_y, argmax_x, **options):
        if input.device.type not in devices:
            return original(input, rois, output, argmax_y, argmax_x, **options)
        scale, height, width, sampling_ratio, aligned = _average_pooling_options(options)
        output.copy_(torch.ops.torchvision.roi_align(input, rois, scale, height, width, sampling_ratio, aligned))
    return roi_align_forward


def _roi_align_backward(original: Callable, devices: frozenset) -> Callable:
    def roi_align_backward(grad_output, rois, argmax_y, argmax_x, grad_input, **options):
        if grad_output.device.type not in devices:
            return original(grad_output, rois, argmax_y, argmax_x, grad_input, **options)
        scale, height, width, sampling_ratio, aligned = _average_pooling_options(options)
        grad_input.copy_(roi_align_backward_op()(
            grad_output, rois, scale, height, width, *grad_input.shape, sampling_ratio, aligned))
    return roi_align_backward


_WRAPPERS = {'nms': _nms, 'roi_align_forward': _roi_align_forward, 'roi_align_backward': _roi_align_backward}


def route_mmcv_ops_to_torchvision(devices: Optional[Iterable[str]] = None) -> frozenset:
    """Send mmcv's NMS and RoIAlign on tensors of ``devices`` (device types, e.g. ``('cuda',)``) to
    torchvision; default: ``('cuda',)`` when mmcv lacks CUDA kernels, else nothing. Replaces an
    earlier routing. Returns the device types routed."""
    ext = mmcv_kernels()
    if devices is None:
        devices = () if mmcv_has_cuda_kernels() else ('cuda',)
    devices = frozenset(devices)
    unroute_mmcv_ops()
    if devices:
        for name, wrap in _WRAPPERS.items():
            _ORIGINALS[name] = getattr(ext, name)
            setattr(ext, name, wrap(_ORIGINALS[name], devices))
    return devices


def unroute_mmcv_ops() -> None:
    """Give mmcv's own kernels back every op (no-op when nothing is routed)."""
    ext = mmcv_kernels()
    for name, original in _ORIGINALS.items():
        setattr(ext, name, original)
    _ORIGINALS.clear()


@contextmanager
def mmcv_ops_routed(devices: Iterable[str]) -> Iterator[frozenset]:
    """:func:`route_mmcv_ops_to_torchvision` for ``devices`` during the block; at its end
    ``mmcv._ext`` holds exactly the functions it held before (an earlier routing included). No
    devices: nothing is touched. The routing is the module's, so for the block's duration it
    applies to every thread of the process."""
    devices = frozenset(devices)
    if not devices:
        yield devices
        return
    ext = mmcv_kernels()
    before = {name: getattr(ext, name) for name in _WRAPPERS}
    originals = dict(_ORIGINALS)
    route_mmcv_ops_to_torchvision(devices)
    try:
        yield devices
    finally:
        for name, function in before.items():
            setattr(ext, name, function)
        _ORIGINALS.clear()
        _ORIGINALS.update(originals)
