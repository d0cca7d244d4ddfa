# mmseg's UPerNet with a ViT-B/16 backbone (its vit_vit-b16_mln_upernet_8xb2-160k_ade20k-512x512.py:
# multi-level neck, 512 x 512 crops, AdamW 6e-5, 160k iterations at batch 16 on 8 GPUs) with PerViT's
# peripheral attention swapped into every layer of the backbone (PosattnSwappedBackbone). The
# backbone starts from the ImageNet ViT-B/16 that mmseg's config names; each layer's Φp from its own
# initialisation. Not run here: no mIoU is claimed for it.
_base_ = ['mmseg::vit/vit_vit-b16_mln_upernet_8xb2-160k_ade20k-512x512.py']

custom_imports = dict(imports=['posattn_openmmlab', 'posattn_openmmlab.segmentation'], allow_failed_imports=False)
# Strict checkpoint loading, resume from the newest complete checkpoint, one training per work_dir,
# exact resume (integrations/openmmlab/runner.py), checkpoints removed only once the next is complete.
runner_type = 'PosattnRunner'
partial_load = False  # True: load the weights of a checkpoint that fit, log the others (--partial-load)
default_hooks = dict(checkpoint=dict(type='SafeCheckpointHook'))

# timm's ViT-B/16 (vit_base_patch16_224) converted to mmseg's names by mmseg's
# tools/model_converters/vit2mmseg.py: the file mmseg's config reads from pretrain/vit_base_patch16_224.pth
# (mmseg loads it non-strictly: a file in timm's names would load nothing, with a warning listing the keys).
# Put it here or pass --cfg-options model.backbone.backbone.init_cfg.checkpoint=PATH.
pretrained = 'checkpoints/vit_base_patch16_224.pth'
model = dict(
    pretrained=None,  # the checkpoint goes to the inner backbone, loaded before the swap
    backbone=dict(
        _delete_=True,
        type='PosattnSwappedBackbone',
        backbone=dict(_base_.model.backbone, type='mmseg.VisionTransformer',
                      init_cfg=dict(type='Pretrained', checkpoint=pretrained)),
        phi='peripheral'),
)

train_dataloader = dict(dataset=dict(type='CheckedADE20KDataset'))
val_dataloader = dict(dataset=dict(type='CheckedADE20KDataset'))
test_dataloader = val_dataloader
