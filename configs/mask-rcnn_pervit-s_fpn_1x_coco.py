# Mask R-CNN with a PerViT-S backbone on COCO 2017: the PerViT-T config with the Small backbone
# (8 heads, 464 output channels) and its ImageNet checkpoint; stochastic depth 0.2.
_base_ = ['./mask-rcnn_pervit-t_fpn_1x_coco.py']

pretrained = 'checkpoints/pervit_small.pth'
model = dict(
    backbone=dict(arch='small', drop_path_rate=0.2, init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    neck=dict(in_channels=464),
)
