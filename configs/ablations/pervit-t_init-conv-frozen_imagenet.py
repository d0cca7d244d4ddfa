# PerViT's Φp initialisation study with Φp frozen (supplement Tab. A3): 'conv' initialisation,
# s = -5, v = 3 in every layer, and no Φp parameter trained (77.1% top-1).
_base_ = ['../pervit_t_imagenet.py']
model = dict(backbone=dict(phi_init='conv', phi_trainable=False))
