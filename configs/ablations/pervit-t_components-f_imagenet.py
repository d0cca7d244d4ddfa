# PerViT's component study (paper Table 1), row (f): without Φp and the C-stem, with Φc and CPE
# (76.3% top-1, 1.5 GFLOPs). The stages are 8 channels wider than PerViT-T's, which brings the
# FLOPs back to 1.5 G (the paper's footnote widens the models without the C-stem).
_base_ = ['../pervit_t_imagenet.py']
model = dict(
    backbone=dict(phi='none', stem='patch',
                  arch=dict(_delete_=True, embed_dims=(136, 200, 232, 288), depths=(2, 2, 6, 2), num_heads=4,
                            stem_dims=(48, 64, 96, 128))),
    head=dict(in_channels=288))
