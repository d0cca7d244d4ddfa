# ConViT-Ti-like (d'Ascoli et al., ICML 2021; 73.1 top-1 in PerViT's Table 3): 192 channels in
# 4 heads, 12 blocks, gated positional self-attention (Φp = gpsa, locality strength 1) in blocks
# 0-9 and plain attention in blocks 10-11, a learned absolute embedding, DeiT's recipe. Where it
# differs from ConViT: the class token is there from the first block (ConViT adds it before
# block 10), and the values start from the usual random init (ConViT's local init sets the
# GPSA layers' value projections to the identity).
_base_ = './deit_t_none_imagenet.py'
model = dict(backbone=dict(
    arch=dict(_delete_=True, embed_dims=192, num_layers=12, num_heads=4, feedforward_channels=768),
    phi='gpsa', phi_blocks=[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]))
