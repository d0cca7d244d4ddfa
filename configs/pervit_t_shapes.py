# The embedded default: PerViT-T on PositionalShapes (configs/_base_/shapes.py), 10 epochs (its time
# on 2 CPU cores: docs/performance.md, "Setup times"). At 64 x 64 the token grid is 4 x 4.
_base_ = ['./_base_/classifier.py', './_base_/shapes.py']

model = dict(
    backbone=dict(type='PosattnPerViT', arch='tiny', out_indices=-1),
    neck=dict(type='GlobalAveragePooling'),
    head=dict(num_classes={{_base_.num_classes}}, in_channels=280),
)
