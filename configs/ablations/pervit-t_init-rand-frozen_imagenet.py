# PerViT's Φp initialisation study with Φp frozen (supplement Tab. A3): 'rand' initialisation,
# every Φp parameter random, and no Φp parameter trained (75.8% top-1).
_base_ = ['../pervit_t_imagenet.py']
model = dict(backbone=dict(phi_init='rand', phi_trainable=False))
