# PerViT's component study (paper Table 1), row (d): without the C-stem (a 16x16 patch embedding),
# with Φp, Φc and CPE (77.8% top-1; the paper gives 1.5 GFLOPs, posattn's counter 1.40).
_base_ = ['../pervit_t_imagenet.py']
model = dict(backbone=dict(stem='patch'))
