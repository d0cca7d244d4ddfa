# PerViT's component study (paper Table 1), row (e): without CPE, with Φp, Φc and the C-stem
# (78.1% top-1, 1.6 GFLOPs).
_base_ = ['../pervit_t_imagenet.py']
model = dict(backbone=dict(cpe=False))
