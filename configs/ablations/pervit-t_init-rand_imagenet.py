# PerViT's Φp initialisation study (paper Table 5, top): 'rand' initialisation, every Φp parameter random
# (78.5% top-1).
_base_ = ['../pervit_t_imagenet.py']
model = dict(backbone=dict(phi_init='rand'))
