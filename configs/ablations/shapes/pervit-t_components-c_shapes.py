# The embedded replication, row (c): without Φc (attention by Φp alone, values projected only),
# 12 channels wider a stage to PerViT-T's FLOPs, as Table 1 (c).
_base_ = ['./pervit-t_components-a_shapes.py']
model = dict(
    backbone=dict(content=False,
                  arch=dict(_delete_=True, embed_dims=(140, 204, 236, 292), depths=(2, 2, 6, 2), num_heads=4,
                            stem_dims=(48, 64, 96))),
    head=dict(in_channels=292))
