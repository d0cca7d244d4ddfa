# Table 2 row "+ CPVT" on the embedded set: no absolute embedding, PEG after blocks 0-4.
_base_ = './deit_t_none_shapes.py'
model = dict(backbone=dict(phi='none', pos_embed=False, peg_after=(0, 1, 2, 3, 4)))
