# ImageNet-1k with the DeiT recipe's data side (PerViT Table A6): RandAugment m9 mstd0.5,
# random erasing 0.25, repeated augmentation; evaluation resize 256 -> centre crop 224.
# Mixup 0.8 / CutMix 1.0 are batch augments, set in the model's train_cfg (_base_/pervit_classifier.py).
# Data: data/imagenet in mmpretrain's layout (train/<wnid>/*.JPEG, val/...; see docs/openmmlab.md).
dataset_type = 'CheckedImageNet'
data_root = 'data/imagenet'
data_preprocessor = dict(
    num_classes=1000,
    mean=[123.675, 116.28, 103.53],
    std=[58.395, 57.12, 57.375],
    to_rgb=True,
)
bgr_mean = data_preprocessor['mean'][::-1]
bgr_std = data_preprocessor['std'][::-1]

train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='RandomResizedCrop', scale=224, backend='pillow', interpolation='bicubic'),
    dict(type='RandomFlip', prob=0.5, direction='horizontal'),
    dict(type='RandAugment', policies='timm_increasing', num_policies=2, total_level=10,
         magnitude_level=9, magnitude_std=0.5,
         hparams=dict(pad_val=[round(x) for x in bgr_mean], interpolation='bicubic')),
    dict(type='RandomErasing', erase_prob=0.25, mode='rand', min_area_ratio=0.02,
         max_area_ratio=1 / 3, fill_color=bgr_mean, fill_std=bgr_std),
    dict(type='PackInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='ResizeEdge', scale=256, edge='short', backend='pillow', interpolation='bicubic'),
    dict(type='CenterCrop', crop_size=224),
    dict(type='PackInputs'),
]

# 8 GPUs x 128 = 1024, the paper's batch.
train_dataloader = dict(
    batch_size=128,
    num_workers=8,
    persistent_workers=True,
    dataset=dict(type=dataset_type, data_root=data_root, split='train', pipeline=train_pipeline),
    sampler=dict(type='RepeatAugSampler', shuffle=True),
)
val_dataloader = dict(
    batch_size=128,
    num_workers=8,
    persistent_workers=True,
    dataset=dict(type=dataset_type, data_root=data_root, split='val', pipeline=test_pipeline),
    sampler=dict(type='DefaultSampler', shuffle=False),
)
val_evaluator = dict(type='Accuracy', topk=(1, 5))
test_dataloader = val_dataloader
test_evaluator = val_evaluator
