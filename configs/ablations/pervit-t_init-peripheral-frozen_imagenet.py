# PerViT's Φp initialisation study with Φp frozen (supplement Tab. A3): 'peripheral'
# initialisation, the release's, by layer (early layers local, late ones near uniform), and no Φp
# parameter trained (77.8% top-1).
_base_ = ['../pervit_t_imagenet.py']
model = dict(backbone=dict(phi_init='peripheral', phi_trainable=False))
