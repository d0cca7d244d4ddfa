# PerViT's component study (paper Table 1), row (c): without Φc, the content-based attention:
# every layer attends by Φp alone, softmax(log Φp) v, and projects only values (76.8% top-1,
# 1.6 GFLOPs). The stages are 12 channels wider than PerViT-T's, which brings the FLOPs back to
# PerViT-T's (the paper's footnote widens the model without Φc).
_base_ = ['../pervit_t_imagenet.py']
model = dict(
    backbone=dict(content=False,
                  arch=dict(_delete_=True, embed_dims=(140, 204, 236, 292), depths=(2, 2, 6, 2), num_heads=4,
                            stem_dims=(48, 64, 96, 128))),
    head=dict(in_channels=292))
