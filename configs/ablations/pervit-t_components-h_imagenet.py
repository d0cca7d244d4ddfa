# PerViT's component study (paper Table 1), row (h): without the C-stem and CPE, with Φp and Φc
# (76.5% top-1, 1.5 GFLOPs); stages 8 channels wider than PerViT-T's, as in row (f).
_base_ = ['../pervit_t_imagenet.py']
model = dict(
    backbone=dict(stem='patch', cpe=False,
                  arch=dict(_delete_=True, embed_dims=(136, 200, 232, 288), depths=(2, 2, 6, 2), num_heads=4,
                            stem_dims=(48, 64, 96, 128))),
    head=dict(in_channels=288))
