# Mask R-CNN (mmdet's R-50-FPN model) with PerViT-T as the backbone (windowed peripheral attention
# with global blocks: pervit_dense_backbone.py) and ViTDet's simple feature pyramid from its one
# stride-16 map to strides 4-64 in place of the FPN.
_base_ = ['mmdet::_base_/models/mask-rcnn_r50_fpn.py', './pervit_dense_backbone.py']

custom_imports = dict(imports=['posattn_openmmlab', 'posattn_openmmlab.detection'],
                      allow_failed_imports=False)
# Strict checkpoint loading, resume from the newest complete checkpoint, one training per
# work_dir, exact resume (integrations/openmmlab/runner.py). Configs built on this one also set
# default_hooks.checkpoint.type='SafeCheckpointHook' (mmdet's default_runtime.py names
# CheckpointHook, and mmengine does not let two bases set the same key).
runner_type = 'PosattnRunner'
partial_load = False  # True: load the weights of a checkpoint that fit, log the others (--partial-load)

model = dict(
    backbone=dict(_delete_=True, **_base_.pervit_backbone),
    neck=dict(_delete_=True, type='PosattnSimpleFPN', in_channels=280, out_channels=256, num_outs=5),
)
