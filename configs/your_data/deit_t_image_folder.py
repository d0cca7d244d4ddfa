# DeiT-T (ViT-Tiny: 192 channels, 3 heads, 12 blocks, patch 16, class token) with any registered Φp
# on your own images (configs/_base_/image_folder.py: data_root, num_classes and img_size are set
# there, or with --cfg-options data_root=... num_classes=... img_size=...). The Φp is set below or
# with --cfg-options phi=rope: posattn.list_phis() names them ('none' is plain attention with the
# learned absolute embedding alone). Recipe and schedule as configs/your_data/pervit_t_image_folder.py.
_base_ = [
    '../_base_/classifier.py',
    '../_base_/image_folder.py',
    '../_base_/schedule_deit_adamw.py',
    '../_base_/default_runtime.py',
]
phi = 'peripheral'
model = dict(
    backbone=dict(type='PosattnViT', arch='tiny', img_size={{_base_.img_size}}, out_type='cls_token',
                  drop_path_rate=0.1, phi=phi),
    neck=None,
    head=dict(num_classes={{_base_.num_classes}}, in_channels=192),
    train_cfg=dict(augments=[dict(type='Mixup', alpha=0.8), dict(type='CutMix', alpha=1.0)]),
)
optim_wrapper = dict(
    optimizer=dict(lr=5e-4 * 64 / 512),
    paramwise_cfg=dict(custom_keys={'.cls_token': dict(decay_mult=0.0), '.pos_embed': dict(decay_mult=0.0)}),
)
auto_scale_lr = dict(base_batch_size=64)  # tools/train.py --auto-scale-lr: the lr for another batch
train_cfg = dict(max_epochs=100)  # the cosine decay ends there; warmup_epochs=... sets the warmup
# the recipe's warm-up and cosine decay; a run no longer than the warm-up (train_cfg.max_epochs=1) is all
# warm-up, without the decay (posattn_openmmlab.schedules)
param_scheduler = [_base_.param_scheduler[0], dict(_base_.param_scheduler[1], type='CosineAfterWarmupLR')]
default_hooks = dict(checkpoint=dict(save_best='accuracy/top1', rule='greater'))
# recipe=position (_base_/image_folder.py): no Mixup or CutMix, no drop path, and an lr and schedule that
# learn from a few hundred images from scratch
recipes = dict(position={'model.train_cfg': None, 'model.backbone.drop_path_rate': 0.0,
                         'optim_wrapper.optimizer.lr': 1e-3, 'train_dataloader.batch_size': 32,
                         'warmup_epochs': 2, 'train_cfg.max_epochs': 30})
# the keys that --cfg-options phi=..., warmup_epochs=... and img_size=... set (with the data's,
# _base_/image_folder.py); the backbone's img_size is the grid of its learned position embedding
linked_keys = dict(phi=['model.backbone.phi'], warmup_epochs=['param_scheduler.0.end', 'param_scheduler.1.begin'],
                   img_size=[*_base_.linked_keys.img_size, 'model.backbone.img_size'])
