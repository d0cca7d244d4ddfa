# PerViT's transfer study (supplement Tab. A4): PerViT-M fine-tuned on CIFAR-10 from its ImageNet
# checkpoint (99.1% top-1), with DeiT's fine-tuning recipe for CIFAR as DeiT's authors give it
# (github.com/facebookresearch/deit/issues/45): 224 x 224 inputs (the 32 x 32 images upsampled),
# batch 768, SGD lr 0.01, weight decay 1e-4, 1000 epochs, no random erasing and no stochastic depth;
# the rest as on ImageNet (RandAugment, Mixup, CutMix, label smoothing, repeated augmentation, 5
# warm-up epochs from 1e-6, cosine decay).
# Data: mmpretrain's CIFAR10 (the python batches under data/cifar10); the ImageNet checkpoint under
# checkpoints/ (posattn's or the release's layout; the classifier is not loaded).
_base_ = ['../pervit_m_imagenet.py']

pretrained = 'checkpoints/pervit_medium.pth'
num_classes = 10
# CIFAR's arrays are RGB already (no LoadImageFromFile, no BGR -> RGB swap): ImageNet's statistics.
data_preprocessor = dict(num_classes=num_classes, mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375],
                         to_rgb=False)
train_pipeline = [
    dict(type='RandomResizedCrop', scale=224, backend='pillow', interpolation='bicubic'),
    dict(type='RandomFlip', prob=0.5, direction='horizontal'),
    dict(type='RandAugment', policies='timm_increasing', num_policies=2, total_level=10, magnitude_level=9,
         magnitude_std=0.5, hparams=dict(pad_val=[124, 116, 104], interpolation='bicubic')),
    dict(type='PackInputs'),
]
test_pipeline = [
    dict(type='ResizeEdge', scale=256, edge='short', backend='pillow', interpolation='bicubic'),
    dict(type='CenterCrop', crop_size=224),
    dict(type='PackInputs'),
]
model = dict(backbone=dict(drop_path_rate=0.0, init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
             head=dict(num_classes=num_classes))
# 8 GPUs x 96 = 768, DeiT's fine-tuning batch.
train_dataloader = dict(
    batch_size=96,
    dataset=dict(_delete_=True, type='CIFAR10', data_root='data/cifar10', split='train', pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=96,
    dataset=dict(_delete_=True, type='CIFAR10', data_root='data/cifar10', split='test', pipeline=test_pipeline))
test_dataloader = val_dataloader
optim_wrapper = dict(optimizer=dict(_delete_=True, type='SGD', lr=0.01, momentum=0.9, weight_decay=1e-4))
warmup_epochs = 5
max_epochs = 1000
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-6 / 0.01, by_epoch=True, end=warmup_epochs, convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=1e-5, by_epoch=True, begin=warmup_epochs, end=max_epochs,
         convert_to_iter_based=True),
]
train_cfg = dict(max_epochs=max_epochs)
auto_scale_lr = dict(base_batch_size=768)
