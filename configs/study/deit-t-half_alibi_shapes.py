# 2D ALiBi (fixed distance penalties), no absolute embedding.
# DeiT-T narrowed to half its width for the resolution study (tools/compare_phis.py --experiment
# resolution): 96 channels, 3 heads (head width 32, as DeiT-T's), 12 blocks, patch 16: a 4 x 4 grid
# at 64 x 64. Budget as every *_shapes.py config, except the learning rate: 1e-3 (3e-4 at full width;
# at half width 1e-3 reached 95.9% top-1 after 7 epochs, 6e-4 92.3%).
_base_ = '../deit_t_alibi_shapes.py'
model = dict(
    backbone=dict(arch=dict(_delete_=True, embed_dims=96, num_layers=12, num_heads=3, feedforward_channels=384)),
    head=dict(in_channels=96))
optim_wrapper = dict(optimizer=dict(lr=1e-3))
