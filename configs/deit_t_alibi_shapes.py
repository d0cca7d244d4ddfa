# DeiT-T + 2D ALiBi (Φp = alibi, no absolute embedding) on the embedded set.
_base_ = './deit_t_none_shapes.py'
model = dict(backbone=dict(phi='alibi', pos_embed=False))
