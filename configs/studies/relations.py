# The harder benchmark: PositionalRelations (which of three target shapes is leftmost and which
# topmost, among outlined distractors; 9 classes), each Φp in DeiT-T at half width with PerViT-T at
# half width, on the study budget, gradients clipped to norm 1 in every row. Two generalisation tests
# without fine-tuning: scale (tools/test.py --img-size: the same scenes drawn larger or smaller) and
# extent (--extent: scenes of the training scale on a larger canvas, more tokens).
options = {'optim_wrapper.clip_grad.max_norm': 1.0}  # every row's
rows = [
    dict(name='none', config='study/deit-t-half_none_shapes.py', label='no position (plain attention, no embedding)'),
    dict(name='ape', config='study/deit-t-half_ape_shapes.py', label='APE (learned absolute embedding)'),
    dict(name='peg', config='study/deit-t-half_peg_shapes.py', label='CPVT (PEG), no APE'),
    dict(name='irpe', config='study/deit-t-half_irpe_shapes.py', label='iRPE-K + APE'),
    dict(name='peripheral', config='study/deit-t-half_peripheral_shapes.py', label='PPE (peripheral) + APE'),
    dict(name='pervit_t', config='study/pervit-t-half_shapes.py', label='PerViT-T (conv stem, CPE, peripheral)'),
    dict(name='rope', config='study/deit-t-half_rope_shapes.py', label='RoPE-Mixed, no APE'),
    dict(name='rpb', config='study/deit-t-half_rpb_shapes.py', label='bias table (rpb), no APE'),
    dict(name='decomposed_rpb', config='study/deit-t-half_decomposed_rpb_shapes.py',
         label='decomposed tables (MViTv2, SAM), no APE'),
    dict(name='alibi', config='study/deit-t-half_alibi_shapes.py', label='2D ALiBi, no APE'),
    dict(name='gpsa', config='study/deit-t-half_gpsa_shapes.py', label='GPSA + APE'),
]
data = '../_base_/relations.py'
test_size_factors = (0.5, 1.0, 1.5, 2.0)
test_extent_factors = (1.0, 1.5, 2.0)
work_dir = 'work_dirs/compare_phis/relations'
