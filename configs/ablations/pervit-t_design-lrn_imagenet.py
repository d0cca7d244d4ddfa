# PerViT's Φp network designs (paper Table 5, bottom), Lrn: the learned embedding, one 1x1
# projection (77.6% top-1).
_base_ = ['../pervit_t_imagenet.py']
model = dict(backbone=dict(phi_embedding='lrn', phi_neighbourhood=False, phi_multi_layer=False))
