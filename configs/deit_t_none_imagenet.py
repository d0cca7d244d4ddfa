# PerViT Table 2, row "DeiT-T": ViT-Tiny (192 channels, 3 heads, 12 blocks) with plain attention
# (Φp = none) and a learned absolute position embedding; DeiT's recipe (wd 0.05, warmup 5,
# stochastic depth 0.1), class-token head. Reported top-1: 72.2.
_base_ = [
    './_base_/classifier.py',
    './_base_/imagenet_deit.py',
    './_base_/schedule_deit_adamw.py',
    './_base_/default_runtime.py',
]
model = dict(
    backbone=dict(type='PosattnViT', arch='tiny', img_size=224, out_type='cls_token', drop_path_rate=0.1,
                  phi='none'),
    neck=None,
    head=dict(num_classes=1000, in_channels=192),
    train_cfg=dict(augments=[dict(type='Mixup', alpha=0.8), dict(type='CutMix', alpha=1.0)]),
)
optim_wrapper = dict(
    optimizer=dict(weight_decay=0.05),
    paramwise_cfg=dict(custom_keys={'.cls_token': dict(decay_mult=0.0), '.pos_embed': dict(decay_mult=0.0)}),
)
