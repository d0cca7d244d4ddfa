# Mask R-CNN with a PerViT-T backbone on COCO 2017 (data/coco), 1x schedule (12 epochs), batch 16
# (8 GPUs x 2): AdamW 1e-4, weight decay 0.05, 1,000 warmup iterations, lr x0.1 after epochs 8 and 11
# (the Swin-T Mask R-CNN 1x recipe of mmdet). The backbone starts from an ImageNet checkpoint:
# the PerViT release's pervit_tiny.pth or one trained with configs/pervit_t_imagenet.py.
_base_ = [
    './_base_/mask_rcnn_pervit.py',
    'mmdet::_base_/datasets/coco_instance.py',
    'mmdet::_base_/schedules/schedule_1x.py',
    'mmdet::_base_/default_runtime.py',
]

pretrained = 'checkpoints/pervit_tiny.pth'
model = dict(backbone=dict(init_cfg=dict(type='Pretrained', checkpoint=pretrained)))

train_dataloader = dict(dataset=dict(type='CheckedCocoDataset'))
val_dataloader = dict(dataset=dict(type='CheckedCocoDataset'))
test_dataloader = val_dataloader

param_scheduler = [
    dict(type='LinearLR', start_factor=0.001, by_epoch=False, begin=0, end=1000),
    dict(type='MultiStepLR', begin=0, end=12, by_epoch=True, milestones=[8, 11], gamma=0.1),
]
# AdamW without weight decay on norms, biases and other 1-D parameters (PerViT's classification recipe).
optim_wrapper = dict(
    optimizer=dict(_delete_=True, type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=0.05),
    constructor='ParamwiseSummaryOptimWrapperConstructor',  # paramwise_cfg summarised in the log
    paramwise_cfg=dict(norm_decay_mult=0.0, bias_decay_mult=0.0, flat_decay_mult=0.0),
)
auto_scale_lr = dict(base_batch_size=16)
default_hooks = dict(checkpoint=dict(type='SafeCheckpointHook'))  # see _base_/mask_rcnn_pervit.py
