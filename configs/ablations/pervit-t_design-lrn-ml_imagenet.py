# PerViT's Φp network designs (paper Table 5, bottom), Lrn + ML: the learned embedding, 1x1
# projections (77.5% top-1).
_base_ = ['../pervit_t_imagenet.py']
model = dict(backbone=dict(phi_embedding='lrn', phi_neighbourhood=False))
