# Table 2 row "+ iRPE-K" on the embedded set: iRPE on the keys (product, contextual, shared heads).
_base_ = './deit_t_none_shapes.py'
model = dict(backbone=dict(
    phi='irpe', phi_cfg=dict(method='product', mode='ctx', on='k', shared_head=True, ratio=1.9)))
