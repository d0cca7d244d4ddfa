# PerViT-T on ImageNet-1k, the paper's recipe (Table A6): 300 epochs, batch 1024 (8 x 128),
# warmup 5 epochs, weight decay 0.03, stochastic depth 0.0. Reported top-1: 78.8.
_base_ = [
    './_base_/pervit_classifier.py',
    './_base_/imagenet_deit.py',
    './_base_/schedule_deit_adamw.py',
    './_base_/default_runtime.py',
]
model = dict(backbone=dict(arch='tiny', drop_path_rate=0.0), head=dict(in_channels=280))
optim_wrapper = dict(optimizer=dict(weight_decay=0.03))
