# PerViT's Φp network designs (paper Table 5, bottom), Lrn + N + ML: the learned embedding instead
# of the distances (77.8% top-1).
_base_ = ['../pervit_t_imagenet.py']
model = dict(backbone=dict(phi_embedding='lrn'))
