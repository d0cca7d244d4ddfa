# An mmpretrain ImageClassifier around PosattnPerViT: final map -> global average pooling ->
# Linear, as PerViT's own head; label smoothing 0.1; Mixup 0.8 / CutMix 1.0 (one per batch).
model = dict(
    type='ImageClassifier',
    backbone=dict(type='PosattnPerViT', arch='tiny', out_indices=-1, drop_path_rate=0.0),
    neck=dict(type='GlobalAveragePooling'),
    head=dict(
        type='LinearClsHead',
        num_classes=1000,
        in_channels=280,
        loss=dict(type='LabelSmoothLoss', label_smooth_val=0.1, mode='original'),
        init_cfg=dict(type='TruncNormal', layer='Linear', std=0.02),
    ),
    train_cfg=dict(augments=[dict(type='Mixup', alpha=0.8), dict(type='CutMix', alpha=1.0)]),
)
