# The model of deit-s_peripheral_imagenet.py on the embedded set (configs/_base_/shapes.py: 64 x 64
# images, a 4 x 4 token grid, the budget every *_shapes.py config shares), from scratch: DeiT-S with
# peripheral attention swapped in by PosattnSwappedBackbone.
_base_ = ['../_base_/classifier.py', '../_base_/shapes.py']

model = dict(
    backbone=dict(
        type='PosattnSwappedBackbone',
        backbone=dict(type='mmpretrain.VisionTransformer', arch='deit-small', img_size={{_base_.img_size}},
                      patch_size=16),
        phi='peripheral'),
    neck=None,
    head=dict(type='VisionTransformerClsHead', num_classes={{_base_.num_classes}}, in_channels=384),
)
