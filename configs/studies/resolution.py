# CPVT Table 3's last column: each Φp in DeiT-T at half width, with PerViT-T at half width,
# trained at 64 x 64 and tested, without fine-tuning, at 0.5 to 2 times that size (tools/test.py
# --img-size: the same test scenes drawn at each size).
rows = [
    dict(name='none', config='study/deit-t-half_none_shapes.py', label='no position (plain attention, no embedding)'),
    dict(name='ape', config='study/deit-t-half_ape_shapes.py', label='APE (learned absolute embedding)'),
    dict(name='peg', config='study/deit-t-half_peg_shapes.py', label='CPVT (PEG), no APE'),
    dict(name='irpe', config='study/deit-t-half_irpe_shapes.py', label='iRPE-K + APE'),
    dict(name='peripheral', config='study/deit-t-half_peripheral_shapes.py', label='PPE (peripheral) + APE'),
    dict(name='pervit_t', config='study/pervit-t-half_shapes.py', label='PerViT-T (conv stem, CPE, peripheral)'),
    dict(name='rope', config='study/deit-t-half_rope_shapes.py', label='RoPE-Mixed, no APE'),
    dict(name='rpb', config='study/deit-t-half_rpb_shapes.py', label='bias table (rpb), no APE'),
    dict(name='alibi', config='study/deit-t-half_alibi_shapes.py', label='2D ALiBi, no APE'),
    dict(name='gpsa', config='study/deit-t-half_gpsa_shapes.py', label='GPSA + APE'),
]
test_size_factors = (0.5, 0.75, 1.0, 1.5, 2.0)
work_dir = 'work_dirs/compare_phis/resolution'
