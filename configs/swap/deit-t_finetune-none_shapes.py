# deit-t_shapes.py's trained DeiT-T fine-tuned on the embedded set with plain attention (Φp 'none':
# the same model trained on, the control),
# swapped into every attention layer by PosattnSwappedBackbone (its own position embedding kept).
# The budget and the starting checkpoint are deit-t_finetune_shapes.py's.
_base_ = ['./deit-t_finetune_shapes.py']

model = dict(backbone=dict(phi='none'))
