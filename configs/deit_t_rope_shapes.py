# DeiT-T + RoPE-Mixed (Φp = rope, mixed frequencies, no absolute embedding) on the embedded set.
_base_ = './deit_t_none_shapes.py'
model = dict(backbone=dict(phi='rope', phi_cfg=dict(frequencies='mixed'), pos_embed=False))
