# DeiT-T + relative position bias tables (Φp = rpb, no absolute embedding) on the embedded set.
_base_ = './deit_t_none_shapes.py'
model = dict(backbone=dict(phi='rpb', pos_embed=False))
