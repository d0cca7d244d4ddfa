# PerViT Table 2, row "+ CPVT": DeiT-T without the absolute embedding, with CPVT's position
# encoding generator (Φp = peg) after blocks 0-4. Reported top-1: 73.4.
_base_ = './deit_t_none_imagenet.py'
model = dict(backbone=dict(phi='none', pos_embed=False, peg_after=(0, 1, 2, 3, 4)))
