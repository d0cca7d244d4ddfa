# UPerNet with a PerViT-S backbone on ADE20K: the recipe of upernet_pervit-t_512x512_160k_ade20k.py
# with PerViT-S (C = 464 at stride 16) and stochastic depth 0.2.
_base_ = ['./upernet_pervit-t_512x512_160k_ade20k.py']

pretrained = 'checkpoints/pervit_small.pth'
model = dict(
    backbone=dict(arch='small', drop_path_rate=0.2, init_cfg=dict(checkpoint=pretrained)),
    neck=dict(in_channels=464),
)
