# PosattnPerViT in the classifier: final map -> global average pooling -> Linear, as PerViT's own
# head; Mixup 0.8 / CutMix 1.0 (one per batch), as in the paper's recipe.
_base_ = ['./classifier.py']
model = dict(
    backbone=dict(type='PosattnPerViT', arch='tiny', out_indices=-1, drop_path_rate=0.0),
    neck=dict(type='GlobalAveragePooling'),
    head=dict(num_classes=1000, in_channels=280),
    train_cfg=dict(augments=[dict(type='Mixup', alpha=0.8), dict(type='CutMix', alpha=1.0)]),
)
