# The embedded replication, row (c): without Φc (attention by Φp alone, values projected only), each
# stage 8 channels wider than row (a)'s, as Table 1 (c) widens PerViT-T to its FLOPs (12 channels at
# full width; 8 keeps the widths divisible by the 4 heads).
_base_ = ['./pervit-t_components-a_shapes.py']
model = dict(
    backbone=dict(content=False,
                  arch=dict(_delete_=True, embed_dims=(72, 104, 120, 148), depths=(2, 2, 6, 2), num_heads=4,
                            stem_dims=(24, 32, 48, 64))),
    head=dict(in_channels=148))
