# PerViT's Φp network designs (paper Table 5, bottom), Euc + ML: without the neighbourhood N: 1x1
# projections (77.9% top-1).
_base_ = ['../pervit_t_imagenet.py']
model = dict(backbone=dict(phi_neighbourhood=False))
