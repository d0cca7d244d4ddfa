# PerViT-T on your own images (configs/_base_/image_folder.py: data_root, num_classes and img_size
# are set there, or with --cfg-options data_root=... num_classes=... img_size=...). Trained from
# scratch with the DeiT / PerViT recipe (AdamW, warmup, cosine decay, Mixup, CutMix, label
# smoothing) for 100 epochs, lr 5e-4 x batch / 512 (DeiT's rule). See docs/your-data.md.
_base_ = [
    '../_base_/pervit_classifier.py',
    '../_base_/image_folder.py',
    '../_base_/schedule_deit_adamw.py',
    '../_base_/default_runtime.py',
]
phi = 'peripheral'  # PerViT's Φp: 'peripheral', or 'none' for plain attention (--cfg-options phi=none)
model = dict(backbone=dict(phi=phi), head=dict(num_classes={{_base_.num_classes}}))
optim_wrapper = dict(optimizer=dict(lr=5e-4 * 64 / 512))
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
# the keys that --cfg-options phi=... and warmup_epochs=... set (with the data's, _base_/image_folder.py)
linked_keys = dict(phi=['model.backbone.phi'], warmup_epochs=['param_scheduler.0.end', 'param_scheduler.1.begin'])
