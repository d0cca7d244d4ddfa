# PerViT-T narrowed to half its width, for the embedded studies (tools/compare_phis.py --experiment
# resolution and ablations): stages of 64, 96, 112 and 140 channels, 4 heads, PerViT-T's depths, stem
# (four stride-2 convolutions: a 4 x 4 grid at 64 x 64), CPE and peripheral Φp. Budget as every
# *_shapes.py config, except the learning rate: 1e-3, where 3e-4 (full width's) left the half-width
# model still rising after 10 epochs (77% top-1; 99.7% after 5 epochs at 1e-3).
_base_ = '../pervit_t_shapes.py'
model = dict(
    backbone=dict(arch=dict(_delete_=True, embed_dims=(64, 96, 112, 140), depths=(2, 2, 6, 2), num_heads=4,
                            stem_dims=(24, 32, 48, 64))),
    head=dict(in_channels=140))
optim_wrapper = dict(optimizer=dict(lr=1e-3))
