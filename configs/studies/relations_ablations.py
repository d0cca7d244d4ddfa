# PerViT's component study, Φp initialisations and Φp designs (the rows of ablations.py) on the harder
# set, PositionalRelations. Row (a) is the PerViT-T row of relations.py (the same config and
# clipping), so the two studies share its runs when they share a work dir's run records; every other
# row's config clips gradients to norm 1 itself.
_clipped = {'optim_wrapper.clip_grad.max_norm': 1.0}
rows = [
    dict(name='a', config='study/pervit-t-half_shapes.py', label='(a) PerViT-T, peripheral init', options=_clipped),
    dict(name='b', config='ablations/shapes/pervit-t_components-b_shapes.py', label='(b) without Φp'),
    dict(name='c', config='ablations/shapes/pervit-t_components-c_shapes.py', label='(c) without Φc'),
    dict(name='init_conv', config='ablations/shapes/pervit-t_init-conv_shapes.py', label='(a), conv init'),
    dict(name='init_rand', config='ablations/shapes/pervit-t_init-rand_shapes.py', label='(a), rand init'),
    dict(name='design_euc_ml', config='ablations/shapes/pervit-t_design-euc-ml_shapes.py', label='(a), Φp Euc + ML'),
    dict(name='design_euc', config='ablations/shapes/pervit-t_design-euc_shapes.py', label='(a), Φp Euc'),
    dict(name='design_lrn_n_ml', config='ablations/shapes/pervit-t_design-lrn-n-ml_shapes.py',
         label='(a), Φp Lrn + N + ML'),
    dict(name='design_lrn_ml', config='ablations/shapes/pervit-t_design-lrn-ml_shapes.py', label='(a), Φp Lrn + ML'),
    dict(name='design_lrn', config='ablations/shapes/pervit-t_design-lrn_shapes.py', label='(a), Φp Lrn'),
]
data = '../_base_/relations.py'
analyse = True
work_dir = 'work_dirs/compare_phis/relations_ablations'
