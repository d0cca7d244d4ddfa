# DeiT-T with 2D rotary position embeddings (Φp = rope) in every attention layer: RoPE-ViT's
# RoPE-Mixed (Heo et al., ECCV 2024), learnable per-head frequencies over both axes, and no
# absolute embedding. Not a row of PerViT's Table 2: a scheme to compare beside them.
_base_ = './deit_t_none_imagenet.py'
model = dict(backbone=dict(phi='rope', phi_cfg=dict(frequencies='mixed'), pos_embed=False))
