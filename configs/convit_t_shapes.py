# ConViT-Ti-like (four heads, gpsa in blocks 0-9, plain attention in 10-11) on the embedded set.
_base_ = './deit_t_none_shapes.py'
model = dict(backbone=dict(
    arch=dict(_delete_=True, embed_dims=192, num_layers=12, num_heads=4, feedforward_channels=768),
    phi='gpsa', phi_blocks=[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]))
