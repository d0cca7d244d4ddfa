# PerViT's transfer study (supplement Tab. A4): PerViT-M fine-tuned on iNaturalist 2019 from its
# ImageNet checkpoint (78.5% top-1), with DeiT's fine-tuning recipe for iNaturalist as DeiT's
# authors give it (github.com/facebookresearch/deit/issues/105): batch 768, AdamW lr 7.5e-5 (at that
# batch), weight decay 0.05, 360 epochs, 5 warm-up epochs from 1e-6 then cosine, stochastic depth
# 0.1, random erasing 0.1; RandAugment, Mixup, CutMix, label smoothing and repeated augmentation as
# on ImageNet.
# Data: data/inat2019 in the published layout (INaturalist2019); the ImageNet checkpoint under
# checkpoints/ (posattn's or the release's layout; the classifier is not loaded).
_base_ = ['../pervit_m_imagenet.py']

pretrained = 'checkpoints/pervit_medium.pth'
num_classes = 1010
data_preprocessor = dict(num_classes=num_classes)
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='RandomResizedCrop', scale=224, backend='pillow', interpolation='bicubic'),
    dict(type='RandomFlip', prob=0.5, direction='horizontal'),
    dict(type='RandAugment', policies='timm_increasing', num_policies=2, total_level=10, magnitude_level=9,
         magnitude_std=0.5, hparams=dict(pad_val=[104, 116, 124], interpolation='bicubic')),
    dict(type='RandomErasing', erase_prob=0.1, mode='rand', min_area_ratio=0.02, max_area_ratio=1 / 3,
         fill_color=[103.53, 116.28, 123.675], fill_std=[57.375, 57.12, 58.395]),
    dict(type='PackInputs'),
]
model = dict(backbone=dict(drop_path_rate=0.1, init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
             head=dict(num_classes=num_classes))
# 8 GPUs x 96 = 768, DeiT's fine-tuning batch.
train_dataloader = dict(
    batch_size=96,
    dataset=dict(_delete_=True, type='INaturalist2019', data_root='data/inat2019', split='train',
                 pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=96,
    dataset=dict(_delete_=True, type='INaturalist2019', data_root='data/inat2019', split='val',
                 pipeline={{_base_.test_pipeline}}))
test_dataloader = val_dataloader
optim_wrapper = dict(optimizer=dict(lr=7.5e-5, weight_decay=0.05))
warmup_epochs = 5
max_epochs = 360
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-6 / 7.5e-5, by_epoch=True, end=warmup_epochs, convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=1e-5, by_epoch=True, begin=warmup_epochs, end=max_epochs,
         convert_to_iter_based=True),
]
train_cfg = dict(max_epochs=max_epochs)
auto_scale_lr = dict(base_batch_size=768)
