"""ViTDet's simple feature pyramid as a neck, registered once in mmengine's root ``MODELS``.

A columnar backbone (PerViT, ViT) has one stride-16 map; detectors and segmenters want a
pyramid. ViTDet (Li et al., "Exploring Plain Vision Transformer Backbones for Object Detection",
ECCV 2022, Sec. 3 and Fig. 2) builds it from that map alone, without lateral connections:

    1/4   deconv 2x2 s2 (C -> C/2) -> LN -> GELU -> deconv 2x2 s2 (C/2 -> C/4)
    1/8   deconv 2x2 s2 (C -> C/2)
    1/16  identity
    1/32  max-pool 2x2 s2
    each  conv 1x1 (-> out_channels) -> LN -> conv 3x3 -> LN      (LN over channels, per position)

and, for detectors that want more levels, max-pools the last output (kernel 1, stride 2; mmdet's
FPN and ViTDet's ``LastLevelMaxPool``). Neither installed toolbox ships this neck: mmdet keeps
ViTDet's ``SimpleFPN`` in its ``projects/`` folder, which the wheel does not install, and mmseg's
``Feature2Pyramid`` (BEiT's) rescales one input per level without projecting or normalising them.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from mmengine.model import BaseModule
from mmengine.registry import MODELS
from torch import nn

__all__ = ['PosattnSimpleFPN']

BASE_LEVELS = 4  # 1/4, 1/8, 1/16, 1/32 of the image from a 1/16 map


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of a (B, C, H, W) map, at every position (ViTDet's, eps 1e-6)."""

    def __init__(self, channels: int):
        super().__init__(channels, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


@MODELS.register_module()
class PosattnSimpleFPN(BaseModule):
    """ViTDet's simple feature pyramid: one stride-16 map -> maps at strides 4, 8, 16, 32 (and more).

    Args:
        in_channels: channels C of the backbone's stride-16 map (PerViT-T: 280).
        out_channels: channels of every output level.
        num_outs: output levels, at least 4; each one past the fourth halves the last (mmdet's
            Mask R-CNN wants 5, strides 4 to 64).
        in_index: which of the backbone's outputs is the stride-16 map (default: its last).
        init_cfg: mmengine init config.

    Input: the backbone's tuple of maps. Output: ``num_outs`` maps (B, out_channels, h_l, w_l),
    h_l = 4 h, 2 h, h, ceil(h / 2), ... for an h x w input map.
    """

    def __init__(self, in_channels: int, out_channels: int = 256, num_outs: int = BASE_LEVELS,
                 in_index: int = -1, init_cfg: Optional[Union[dict, list]] = None):
        super().__init__(init_cfg=init_cfg)
        if num_outs < BASE_LEVELS:
            raise ValueError(f'num_outs must be at least {BASE_LEVELS} (strides 4, 8, 16, 32), got {num_outs}')
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.num_outs = num_outs
        self.in_index = in_index
        half, quarter = in_channels // 2, in_channels // 4
        self.rescales = nn.ModuleList([
            nn.Sequential(nn.ConvTranspose2d(in_channels, half, 2, 2), LayerNorm2d(half), nn.GELU(),
                          nn.ConvTranspose2d(half, quarter, 2, 2)),
            nn.ConvTranspose2d(in_channels, half, 2, 2),
            nn.Identity(),
            nn.MaxPool2d(2, 2, ceil_mode=True),
        ])
        self.outputs = nn.ModuleList([
            nn.Sequential(nn.Conv2d(channels, out_channels, 1, bias=False), LayerNorm2d(out_channels),
                          nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False), LayerNorm2d(out_channels))
            for channels in (quarter, half, in_channels, in_channels)])

    def forward(self, inputs: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
        x = inputs[self.in_index]
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f'expected a (B, {self.in_channels}, h, w) map at index {self.in_index} of the '
                             f'backbone outputs, got shape {tuple(x.shape)}')
        # The last LayerNorm leaves channels-last strides; mmcv's CPU RoIAlign reads its input's
        # memory as contiguous NCHW and returns wrong values otherwise (tested), so make them so.
        outs = [output(rescale(x)).contiguous() for rescale, output in zip(self.rescales, self.outputs)]
        while len(outs) < self.num_outs:
            outs.append(F.max_pool2d(outs[-1], 1, stride=2))
        return tuple(outs)
