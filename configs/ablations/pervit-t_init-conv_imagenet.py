# PerViT's Φp initialisation study (paper Table 5, top): 'conv' initialisation, s = -5, v = 3 in every layer
# (78.6% top-1).
_base_ = ['../pervit_t_imagenet.py']
model = dict(backbone=dict(phi_init='conv'))
