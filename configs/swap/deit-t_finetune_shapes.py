# What the deit-t_finetune-*_shapes.py configs share: deit-t_shapes.py's DeiT-T inside
# PosattnSwappedBackbone, backbone and classifier from one checkpoint of deit-t_shapes.py (each Φp
# from its own initialisation), and a fine-tuning budget: 5 epochs (1 of warm-up), peak lr 1e-4,
# the same for every Φp. Not run alone: each of those configs sets the Φp.
# tools/compare_phis.py --experiment swap trains deit-t_shapes.py first and points both init_cfgs
# at its checkpoint; by hand, train it, then pass its checkpoint as
# model.backbone.backbone.init_cfg.checkpoint and model.head.init_cfg.checkpoint (--cfg-options).
_base_ = ['./deit-t_shapes.py']

pretrained = 'work_dirs/deit-t_shapes/epoch_10.pth'  # where tools/train.py leaves deit-t_shapes.py's last epoch

model = dict(
    backbone=dict(
        _delete_=True,
        type='PosattnSwappedBackbone',
        backbone=dict(type='mmpretrain.VisionTransformer', arch='deit-tiny', img_size={{_base_.img_size}},
                      patch_size=16, init_cfg=dict(type='Pretrained', checkpoint=pretrained, prefix='backbone.'))),
    head=dict(init_cfg=dict(_delete_=True, type='Pretrained', checkpoint=pretrained, prefix='head.')),
)

max_epochs = 5
optim_wrapper = dict(optimizer=dict(lr=1e-4))
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-2, by_epoch=True, end=1, convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=1e-6, by_epoch=True, begin=1, end=max_epochs,
         convert_to_iter_based=True),
]
train_cfg = dict(max_epochs=max_epochs)
