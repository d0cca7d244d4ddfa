# The embedded set and the budget every *_shapes.py config shares, so that they compare: data,
# recipe, schedule and seed are the same, only the model differs (tools/compare_phis.py).
# PositionalShapes is generated on first use: the class is which of two shapes is on the left
# (6 classes, chance 16.7%; see docs/openmmlab.md). No horizontal flips: they would swap the classes.
_base_ = ['./default_runtime.py']

img_size = 64
num_classes = 6
data_preprocessor = dict(num_classes=num_classes, mean=[127.5] * 3, std=[64.0] * 3, to_rgb=False)

train_dataloader = dict(
    batch_size=64,
    num_workers=0,
    dataset=dict(type='PositionalShapes', split='train', num_images=6000, img_size=img_size,
                 pipeline=[dict(type='RandomFlip', prob=0.5, direction='vertical'), dict(type='PackInputs')]),
    sampler=dict(type='DefaultSampler', shuffle=True),
)
val_dataloader = dict(
    batch_size=128,
    num_workers=0,
    dataset=dict(type='PositionalShapes', split='val', num_images=1200, img_size=img_size,
                 pipeline=[dict(type='PackInputs')]),
    sampler=dict(type='DefaultSampler', shuffle=False),
)
val_evaluator = dict(type='Accuracy', topk=(1,))
test_dataloader = val_dataloader
test_evaluator = val_evaluator

max_epochs = 10
optim_wrapper = dict(
    optimizer=dict(type='AdamW', lr=3e-4, weight_decay=0.05),
    constructor='ParamwiseSummaryOptimWrapperConstructor',  # paramwise_cfg summarised in the log
    paramwise_cfg=dict(norm_decay_mult=0.0, bias_decay_mult=0.0, flat_decay_mult=0.0),
)
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-2, by_epoch=True, end=1, convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=1e-5, by_epoch=True, begin=1, end=max_epochs,
         convert_to_iter_based=True),
]
train_cfg = dict(by_epoch=True, max_epochs=max_epochs, val_interval=1)
val_cfg = dict()
test_cfg = dict()
auto_scale_lr = dict(base_batch_size=64)

default_hooks = dict(logger=dict(interval=20), checkpoint=dict(save_best='accuracy/top1', rule='greater'))
