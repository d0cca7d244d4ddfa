# UPerNet with a PerViT-T backbone on ADE20K (data/ade/ADEChallengeData2016), 512 x 512 crops,
# 160k iterations at batch 16 (8 GPUs x 2): AdamW 6e-5, weight decay 0.01, 1,500 linear warmup
# iterations, then linear (poly, power 1) decay to 0 (mmseg's ViT/DeiT UPerNet recipe). The
# backbone starts from an ImageNet checkpoint: the PerViT release's pervit_tiny.pth or one trained
# with configs/pervit_t_imagenet.py.
_base_ = [
    './_base_/upernet_pervit.py',
    'mmseg::_base_/datasets/ade20k.py',
    'mmseg::_base_/default_runtime.py',
    'mmseg::_base_/schedules/schedule_160k.py',
]

pretrained = 'checkpoints/pervit_tiny.pth'
crop_size = (512, 512)
num_classes = 150
model = dict(
    data_preprocessor=dict(size=crop_size),
    backbone=dict(init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
    decode_head=dict(num_classes=num_classes),
    auxiliary_head=dict(num_classes=num_classes),
)

train_dataloader = dict(batch_size=2, dataset=dict(type='CheckedADE20KDataset'))
val_dataloader = dict(batch_size=1, dataset=dict(type='CheckedADE20KDataset'))
test_dataloader = val_dataloader

# AdamW without weight decay on norms, biases and other 1-D parameters (PerViT's classification recipe).
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=6e-5, betas=(0.9, 0.999), weight_decay=0.01),
    constructor='ParamwiseSummaryOptimWrapperConstructor',  # paramwise_cfg summarised in the log
    paramwise_cfg=dict(norm_decay_mult=0.0, bias_decay_mult=0.0, flat_decay_mult=0.0),
)
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-6, by_epoch=False, begin=0, end=1500),
    dict(type='PolyLR', eta_min=0.0, power=1.0, by_epoch=False, begin=1500, end=160000),
]
auto_scale_lr = dict(base_batch_size=16)
default_hooks = dict(checkpoint=dict(type='SafeCheckpointHook'))  # see _base_/upernet_pervit.py
