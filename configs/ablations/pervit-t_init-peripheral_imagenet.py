# PerViT's Φp initialisation study (paper Table 5, top): 'peripheral' initialisation, the
# release's, by layer: early layers local, late ones near uniform (78.8% top-1).
_base_ = ['../pervit_t_imagenet.py']
model = dict(backbone=dict(phi_init='peripheral'))
