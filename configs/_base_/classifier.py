# mmpretrain's ImageClassifier with the linear head every classification config here uses:
# label smoothing 0.1, truncated-normal init. Configs add the backbone, the neck, num_classes and
# in_channels.
model = dict(
    type='ImageClassifier',
    head=dict(
        type='LinearClsHead',
        loss=dict(type='LabelSmoothLoss', label_smooth_val=0.1, mode='original'),
        init_cfg=dict(type='TruncNormal', layer='Linear', std=0.02),
    ),
)
