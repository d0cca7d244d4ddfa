# PerViT Table 2 on the embedded set: the same ViT-Tiny with each Φp, and PerViT-T, from scratch.
# The default study of tools/compare_phis.py, whose docstring describes the format of these files.
rows = [
    dict(name='deit_t_none', config='deit_t_none_shapes.py', label='DeiT-T (abs. embedding)'),
    dict(name='deit_t_peg', config='deit_t_peg_shapes.py', label='DeiT-T + CPVT (PEG)'),
    dict(name='deit_t_irpe', config='deit_t_irpe_shapes.py', label='DeiT-T + iRPE-K'),
    dict(name='deit_t_peripheral', config='deit_t_peripheral_shapes.py', label='DeiT-T + PPE (peripheral)'),
    dict(name='pervit_t', config='pervit_t_shapes.py', label='PerViT-T'),
]
work_dir = 'work_dirs/compare_phis'
