# mmpretrain's own DeiT-T (VisionTransformer, arch 'deit-tiny': 192 channels, 3 heads, 12 blocks,
# patch 16, a 4 x 4 grid at 64 x 64) with its learned position embedding, trained from scratch on
# the embedded set with the budget every *_shapes.py config shares. The starting point of the
# deit-t_finetune-*_shapes.py configs (tools/compare_phis.py --experiment swap).
_base_ = ['../_base_/classifier.py', '../_base_/shapes.py']

model = dict(
    backbone=dict(type='mmpretrain.VisionTransformer', arch='deit-tiny', img_size={{_base_.img_size}},
                  patch_size=16),
    neck=None,
    head=dict(type='VisionTransformerClsHead', num_classes={{_base_.num_classes}}, in_channels=192),
)
