# DeiT-T with 2D ALiBi (Φp = alibi): fixed per-head slopes times the Euclidean distance between
# patches, as CROMA uses it, and no absolute embedding. Not a row of PerViT's Table 2: a scheme to
# compare beside them.
_base_ = './deit_t_none_imagenet.py'
model = dict(backbone=dict(phi='alibi', pos_embed=False))
