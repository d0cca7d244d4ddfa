# UPerNet with a PerViT-T backbone, trained from scratch on the embedded shapes set: 128 x 192
# images of 2-5 circles, squares and triangles with per-pixel labels (0 background, 1-3 shapes),
# written to data/shapes_dense on first use (integrations/openmmlab/dense_shapes_dataset.py) and shared with
# mask-rcnn_pervit-t_shapes.py. Evaluated with mmseg's IoUMetric. Minutes on 2 CPU cores (docs/detection-segmentation.md);
# the model is the one of upernet_pervit-t_512x512_160k_ade20k.py with narrower heads.
_base_ = ['./_base_/upernet_pervit.py', 'mmseg::_base_/default_runtime.py']

data_root = 'data/shapes_dense/'
shapes = dict(img_size=(128, 192), sizes=dict(train=1000, val=200), seed=0)
num_classes = 4  # background and three shapes

# The backbone of the ADE20K config; heads at 128 channels and plain BN (one process, no SyncBN)
# so that training fits 2 CPU cores.
channels = 128
norm_cfg = dict(type='BN', requires_grad=True)
model = dict(
    data_preprocessor=dict(size_divisor=32),  # mmseg pads training batches to a size or a multiple
    neck=dict(out_channels=channels),
    decode_head=dict(in_channels=[channels] * 4, channels=channels, num_classes=num_classes, norm_cfg=norm_cfg),
    auxiliary_head=dict(in_channels=channels, channels=64, num_classes=num_classes, norm_cfg=norm_cfg),
)

train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', reduce_zero_label=False),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackSegInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', reduce_zero_label=False),
    dict(type='PackSegInputs'),
]
train_dataloader = dict(
    batch_size=8,
    num_workers=0,
    sampler=dict(type='InfiniteSampler', shuffle=True),
    dataset=dict(type='ShapesSegDataset', data_root=data_root, **shapes,
                 data_prefix=dict(img_path='images/train', seg_map_path='masks/train'), pipeline=train_pipeline),
)
val_dataloader = dict(
    batch_size=8,
    num_workers=0,
    sampler=dict(type='DefaultSampler', shuffle=False),
    dataset=dict(type='ShapesSegDataset', data_root=data_root, **shapes,
                 data_prefix=dict(img_path='images/val', seg_map_path='masks/val'), pipeline=test_pipeline),
)
test_dataloader = val_dataloader
val_evaluator = dict(type='IoUMetric', iou_metrics=['mIoU'])
test_evaluator = val_evaluator

max_iters = 600
train_cfg = dict(type='IterBasedTrainLoop', max_iters=max_iters, val_interval=300)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=5e-4, betas=(0.9, 0.999), weight_decay=0.05),
    constructor='ParamwiseSummaryOptimWrapperConstructor',  # paramwise_cfg summarised in the log
    paramwise_cfg=dict(norm_decay_mult=0.0, bias_decay_mult=0.0, flat_decay_mult=0.0),
)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=50),
    dict(type='CosineAnnealingLR', eta_min=1e-6, by_epoch=False, begin=50, end=max_iters),
]
default_hooks = dict(  # mmseg keeps its hooks in the schedule files, which this config does not use
    timer=dict(type='IterTimerHook'),
    logger=dict(type='LoggerHook', interval=20, log_metric_by_epoch=False),
    param_scheduler=dict(type='ParamSchedulerHook'),
    checkpoint=dict(type='SafeCheckpointHook', by_epoch=False, interval=300, max_keep_ckpts=2, save_best='mIoU',
                    rule='greater'),
    sampler_seed=dict(type='DistSamplerSeedHook'),
    visualization=dict(type='SegVisualizationHook'),
)
env_cfg = dict(cudnn_benchmark=False, dist_cfg=dict(backend='gloo'))
auto_scale_lr = dict(base_batch_size=8)
