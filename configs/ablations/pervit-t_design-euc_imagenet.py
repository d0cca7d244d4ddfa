# PerViT's Φp network designs (paper Table 5, bottom), Euc: one 1x1 projection of the distances, no
# N and no ML (78.0% top-1).
_base_ = ['../pervit_t_imagenet.py']
model = dict(backbone=dict(phi_neighbourhood=False, phi_multi_layer=False))
