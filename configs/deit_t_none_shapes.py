# PerViT Table 2's rows on the embedded set, for tools/compare_phis.py: DeiT-T (192 channels, 3
# heads, 12 blocks, patch 16: a 4 x 4 grid at 64 x 64, as PerViT-T's) with plain attention and a
# learned absolute position embedding, class-token head. Budget as every *_shapes.py config.
_base_ = ['./_base_/classifier.py', './_base_/shapes.py']

model = dict(
    backbone=dict(type='PosattnViT', arch='tiny', img_size={{_base_.img_size}}, out_type='cls_token', phi='none'),
    neck=None,
    head=dict(num_classes={{_base_.num_classes}}, in_channels=192),
)
