# PerViT's Φp network designs (paper Table 5, bottom), Euc + N + ML: PerViT's own design (the same
# model as pervit_t_imagenet.py) (78.8% top-1).
_base_ = ['../pervit_t_imagenet.py']
