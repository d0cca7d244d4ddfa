# mmdet's Mask R-CNN Swin-T FPN 1x on COCO 2017 (its swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py: AdamW
# 1e-4, 12 epochs, batch 16 on 8 GPUs) with PerViT's peripheral attention swapped into every window
# attention of the backbone (PosattnSwappedBackbone), Swin's relative position bias kept beside it.
# The backbone starts from the ImageNet Swin-T release; each layer's Φp from its own initialisation.
# Not run here: no mAP is claimed for it.
_base_ = ['mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py']

custom_imports = dict(imports=['posattn_openmmlab', 'posattn_openmmlab.detection'], allow_failed_imports=False)
# Strict checkpoint loading, resume from the newest complete checkpoint, one training per work_dir,
# exact resume (integrations/openmmlab/runner.py), checkpoints removed only once the next is complete.
runner_type = 'PosattnRunner'
partial_load = False  # True: load the weights of a checkpoint that fit, log the others (--partial-load)
default_hooks = dict(checkpoint=dict(type='SafeCheckpointHook'))

# The Swin-T ImageNet-1k release, swin_tiny_patch4_window7_224.pth (the file mmdet's config
# downloads; mmdet converts its names, convert_weights=True). Put it here or pass
# --cfg-options model.backbone.backbone.init_cfg.checkpoint=PATH.
pretrained = 'checkpoints/swin_tiny_patch4_window7_224.pth'
model = dict(
    backbone=dict(
        _delete_=True,
        type='PosattnSwappedBackbone',
        backbone=dict(_base_.model.backbone, type='mmdet.SwinTransformer',
                      init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
        phi='peripheral'),
)

train_dataloader = dict(dataset=dict(type='CheckedCocoDataset'))
val_dataloader = dict(dataset=dict(type='CheckedCocoDataset'))
test_dataloader = val_dataloader
