# Table 2 row "+ PPE" on the embedded set: PerViT's peripheral Φp in every attention layer.
_base_ = './deit_t_none_shapes.py'
model = dict(backbone=dict(phi='peripheral'))
