# PerViT's component study (paper Table 1 / supplement Tab. A1), row (a): Φp, Φc, C-stem and CPE,
# PerViT-T itself (78.8% top-1, 1.6 GFLOPs): the recipe of ../pervit_t_imagenet.py unchanged.
_base_ = ['../pervit_t_imagenet.py']
