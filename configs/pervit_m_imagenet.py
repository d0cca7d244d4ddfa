# PerViT-M on ImageNet-1k, the paper's recipe (Table A6): 300 epochs, batch 1024 (8 x 128),
# warmup 20 epochs, weight decay 0.05, stochastic depth 0.2. Reported top-1: 82.9.
_base_ = [
    './_base_/pervit_classifier.py',
    './_base_/imagenet_deit.py',
    './_base_/schedule_deit_adamw.py',
    './_base_/default_runtime.py',
]
model = dict(backbone=dict(arch='medium', drop_path_rate=0.2), head=dict(in_channels=684))
optim_wrapper = dict(optimizer=dict(weight_decay=0.05))
warmup_epochs = 20
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=True, end=warmup_epochs, convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=1e-5, by_epoch=True, begin=warmup_epochs),
]
