# Mask R-CNN with a PerViT-T backbone, trained from scratch on the embedded shapes set: 128 x 192
# images of 2-5 circles, squares and triangles with boxes and masks, written to data/shapes_dense
# on first use (integrations/openmmlab/dense_shapes_dataset.py). Evaluated with mmdet's CocoMetric.
# Minutes on 2 CPU cores (docs/detection-segmentation.md); the model is the one of mask-rcnn_pervit-t_fpn_1x_coco.py.
_base_ = ['./_base_/mask_rcnn_pervit.py', 'mmdet::_base_/default_runtime.py']

data_root = 'data/shapes_dense/'
shapes = dict(img_size=(128, 192), sizes=dict(train=1000, val=200), seed=0)
num_classes = 3

# The backbone of the COCO config; heads at half width (128 channels, 512-wide box FCs) and 128
# sampled RoIs per image (a scene has at most 5 objects), so that training fits 2 CPU cores.
channels = 128
model = dict(
    neck=dict(out_channels=channels),
    rpn_head=dict(in_channels=channels, feat_channels=channels,
                  anchor_generator=dict(scales=[4])),  # anchors 16-256 px: the shapes are 26-56 px
    roi_head=dict(
        bbox_roi_extractor=dict(out_channels=channels),
        bbox_head=dict(in_channels=channels, fc_out_channels=512, num_classes=num_classes),
        mask_roi_extractor=dict(out_channels=channels),
        mask_head=dict(in_channels=channels, conv_out_channels=channels, num_classes=num_classes)),
    train_cfg=dict(rpn_proposal=dict(nms_pre=600, max_per_img=300), rcnn=dict(sampler=dict(num=128))),
    test_cfg=dict(rpn=dict(nms_pre=300, max_per_img=300), rcnn=dict(max_per_img=20)),
)

train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='Resize', scale=(192, 128), keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(192, 128), keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor')),
]
train_dataloader = dict(
    batch_size=4,
    num_workers=0,
    sampler=dict(type='InfiniteSampler', shuffle=True),
    dataset=dict(type='ShapesCocoDataset', data_root=data_root, **shapes,
                 ann_file='annotations/instances_train.json', data_prefix=dict(img='images/train/'),
                 filter_cfg=dict(filter_empty_gt=True), pipeline=train_pipeline),
)
val_dataloader = dict(
    batch_size=4,
    num_workers=0,
    drop_last=False,
    sampler=dict(type='DefaultSampler', shuffle=False),
    dataset=dict(type='ShapesCocoDataset', data_root=data_root, **shapes,
                 ann_file='annotations/instances_val.json', data_prefix=dict(img='images/val/'),
                 test_mode=True, pipeline=test_pipeline),
)
test_dataloader = val_dataloader
val_evaluator = dict(type='CocoMetric', ann_file=data_root + 'annotations/instances_val.json', metric=['bbox', 'segm'])
test_evaluator = val_evaluator

max_iters = 500
train_cfg = dict(type='IterBasedTrainLoop', max_iters=max_iters, val_interval=250)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')
optim_wrapper = dict(
    optimizer=dict(type='AdamW', lr=2e-4, betas=(0.9, 0.999), weight_decay=0.05),
    constructor='ParamwiseSummaryOptimWrapperConstructor',  # paramwise_cfg summarised in the log
    paramwise_cfg=dict(norm_decay_mult=0.0, bias_decay_mult=0.0, flat_decay_mult=0.0),
)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=100),
    dict(type='CosineAnnealingLR', eta_min=1e-6, by_epoch=False, begin=100, end=max_iters),
]
default_hooks = dict(
    logger=dict(interval=20),
    checkpoint=dict(type='SafeCheckpointHook', by_epoch=False, interval=250, max_keep_ckpts=2,
                    save_best='coco/bbox_mAP', rule='greater'),
)
log_processor = dict(by_epoch=False)
auto_scale_lr = dict(base_batch_size=4)
