# UPerNet (mmseg's R-50 model) with PerViT-T as the backbone (windowed peripheral attention with
# global blocks: pervit_dense_backbone.py) and ViTDet's simple feature pyramid (strides 4, 8, 16,
# 32) from its one stride-16 map in place of ResNet's stages.
_base_ = ['mmseg::_base_/models/upernet_r50.py', './pervit_dense_backbone.py']

custom_imports = dict(imports=['posattn_openmmlab', 'posattn_openmmlab.segmentation'],
                      allow_failed_imports=False)
# Strict checkpoint loading, resume from the newest complete checkpoint, one training per
# work_dir, exact resume (integrations/openmmlab/runner.py). Configs built on this one also set
# default_hooks.checkpoint.type='SafeCheckpointHook' (mmseg's schedule files name
# CheckpointHook, and mmengine does not let two bases set the same key).
runner_type = 'PosattnRunner'
partial_load = False  # True: load the weights of a checkpoint that fit, log the others (--partial-load)

channels = 256
model = dict(
    pretrained=None,
    backbone=dict(_delete_=True, **_base_.pervit_backbone),
    neck=dict(type='PosattnSimpleFPN', in_channels=280, out_channels=channels, num_outs=4),
    decode_head=dict(in_channels=[channels] * 4, in_index=[0, 1, 2, 3]),
    # the auxiliary FCN head reads the stride-16 level, the backbone's own resolution
    auxiliary_head=dict(in_channels=channels, in_index=2),
)
