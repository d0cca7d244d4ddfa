# DeiT-T with a learned relative position bias table per layer and head (Φp = rpb), as Swin and
# BEiT use it, with BEiT's class-token entries, and no absolute embedding. Not a row of PerViT's
# Table 2: a scheme to compare beside them.
_base_ = './deit_t_none_imagenet.py'
model = dict(backbone=dict(phi='rpb', pos_embed=False))
