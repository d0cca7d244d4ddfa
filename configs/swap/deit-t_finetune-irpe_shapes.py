# deit-t_shapes.py's trained DeiT-T fine-tuned on the embedded set with iRPE-K (PerViT Table 2's
# row: contextual product buckets on the keys, one table shared by the heads),
# swapped into every attention layer by PosattnSwappedBackbone (its own position embedding kept).
# The budget and the starting checkpoint are deit-t_finetune_shapes.py's.
_base_ = ['./deit-t_finetune_shapes.py']

model = dict(backbone=dict(phi='irpe',
                           phi_cfg=dict(method='product', mode='ctx', on='k', shared_head=True, ratio=1.9)))
