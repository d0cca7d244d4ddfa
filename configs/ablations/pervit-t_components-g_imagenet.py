# PerViT's component study (paper Table 1), row (g): without Φp and CPE, with Φc and the C-stem
# (76.7% top-1, 1.6 GFLOPs).
_base_ = ['../pervit_t_imagenet.py']
model = dict(backbone=dict(phi='none', cpe=False))
