# DeiT-T + gated positional self-attention (Φp = gpsa, absolute embedding kept) on the embedded set.
_base_ = './deit_t_none_shapes.py'
model = dict(backbone=dict(phi='gpsa'))
