# DeiT-S (mmpretrain's VisionTransformer, arch 'deit-small') fine-tuned on ImageNet-1k with PerViT's
# peripheral attention swapped into every layer (PosattnSwappedBackbone): the backbone and the
# classifier start from mmpretrain's DeiT-S checkpoint, each layer's Φp from its own initialisation.
# DeiT's data side and optimiser (configs/_base_/), shortened to a fine-tune: 30 epochs, lr 1e-4 at
# batch 1024, 2 warmup epochs. A starting point, not a tuned recipe: no accuracy is claimed for it.
_base_ = [
    '../_base_/classifier.py',
    '../_base_/imagenet_deit.py',
    '../_base_/schedule_deit_adamw.py',
    '../_base_/default_runtime.py',
]

# mmpretrain's DeiT-S ImageNet-1k classifier, with 'backbone.*' and 'head.layers.head.*' keys: the
# file deit-small_pt-4xb256_in1k_20220218-9425b9bb.pth of mmpretrain's model zoo, or one trained with
# its deit-small_4xb256_in1k.py. Put it here, or pass its path to both model.backbone.backbone.init_cfg.checkpoint
# and model.head.init_cfg.checkpoint (--cfg-options).
pretrained = 'checkpoints/deit-small_pt-4xb256_in1k.pth'

model = dict(
    backbone=dict(
        type='PosattnSwappedBackbone',
        backbone=dict(type='mmpretrain.VisionTransformer', arch='deit-small', img_size=224, patch_size=16,
                      drop_path_rate=0.1,
                      init_cfg=dict(type='Pretrained', checkpoint=pretrained, prefix='backbone.')),
        phi='peripheral'),
    neck=None,
    head=dict(type='VisionTransformerClsHead', num_classes=1000, in_channels=384,
              init_cfg=dict(_delete_=True, type='Pretrained', checkpoint=pretrained, prefix='head.')),
    train_cfg=dict(augments=[dict(type='Mixup', alpha=0.8), dict(type='CutMix', alpha=1.0)]),
)

warmup_epochs = 2
max_epochs = 30
optim_wrapper = dict(
    optimizer=dict(lr=5e-5 * 1024 / 512, weight_decay=0.05),
    paramwise_cfg=dict(custom_keys={'.cls_token': dict(decay_mult=0.0), '.pos_embed': dict(decay_mult=0.0)}),
)
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=True, end=warmup_epochs, convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=1e-6, by_epoch=True, begin=warmup_epochs, end=max_epochs),
]
train_cfg = dict(max_epochs=max_epochs)
