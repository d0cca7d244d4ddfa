# The positional schemes of later ViTs in the same DeiT-T, from scratch, beside plain DeiT-T and a
# ConViT-T-like model.
rows = [
    dict(name='deit_t_none', config='deit_t_none_shapes.py', label='DeiT-T (abs. embedding)'),
    dict(name='deit_t_rope', config='deit_t_rope_shapes.py', label='DeiT-T + RoPE-Mixed (rope)'),
    dict(name='deit_t_rpb', config='deit_t_rpb_shapes.py', label='DeiT-T + bias table (rpb)'),
    dict(name='deit_t_alibi', config='deit_t_alibi_shapes.py', label='DeiT-T + 2D ALiBi (alibi)'),
    dict(name='deit_t_gpsa', config='deit_t_gpsa_shapes.py', label='DeiT-T + GPSA (gpsa)'),
    dict(name='convit_t', config='convit_t_shapes.py', label='ConViT-T-like (gpsa in blocks 0-9)'),
]
work_dir = 'work_dirs/compare_phis/schemes'
