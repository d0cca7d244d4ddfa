# DeiT-T with ConViT's gated positional self-attention (Φp = gpsa) in every attention layer,
# locality strength 1, beside the learned absolute embedding (ConViT keeps it). The ConViT layout
# (plain attention in the last two blocks, four heads) is convit_t_imagenet.py.
_base_ = './deit_t_none_imagenet.py'
model = dict(backbone=dict(phi='gpsa'))
