# Decomposed relative position embeddings (one table per axis, read by the query), no absolute embedding.
# DeiT-T narrowed to half its width for the studies (tools/compare_phis.py): 96 channels, 3 heads
# (head width 32, as DeiT-T's), 12 blocks, patch 16. Learning rate 1e-3, as the other half-width rows.
_base_ = '../deit_t_decomposed_rpb_shapes.py'
model = dict(
    backbone=dict(arch=dict(_delete_=True, embed_dims=96, num_layers=12, num_heads=3, feedforward_channels=384)),
    head=dict(in_channels=96))
optim_wrapper = dict(optimizer=dict(lr=1e-3))
