# PerViT Table 2, row "+ PPE": DeiT-T with PerViT's peripheral position encoding
# (Φp = peripheral) in every attention layer. Reported top-1: 74.4.
_base_ = './deit_t_none_imagenet.py'
model = dict(backbone=dict(phi='peripheral'))
