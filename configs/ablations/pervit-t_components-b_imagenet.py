# PerViT's component study (paper Table 1), row (b): without Φp (plain multi-head attention), with
# Φc, C-stem and CPE (77.3% top-1, 1.6 GFLOPs).
_base_ = ['../pervit_t_imagenet.py']
model = dict(backbone=dict(phi='none'))
