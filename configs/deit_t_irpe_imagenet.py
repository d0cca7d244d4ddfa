# PerViT Table 2, row "+ iRPE-K": DeiT-T with iRPE on the keys (Φp = irpe; product method,
# contextual mode, shared over heads, ratio 1.9). Reported top-1: 73.7.
_base_ = './deit_t_none_imagenet.py'
model = dict(backbone=dict(
    phi='irpe', phi_cfg=dict(method='product', mode='ctx', on='k', shared_head=True, ratio=1.9)))
