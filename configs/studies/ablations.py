# PerViT's component study (Table 1 rows (a), (b), (c)), Φp initialisations (Table 5, top:
# peripheral is row (a), conv, rand) and Φp designs (Table 5, bottom: a Euclidean or a learned
# embedding of the offsets, with or without the neighbourhood term N and several layers ML; row (a)
# is Euc + N + ML), PerViT-T at half width. Each run is analysed (tools/analyze.py): the
# nonlocality of Φp and Φa per layer (the paper's Fig. A8) joins the tables.
rows = [
    dict(name='a', config='ablations/shapes/pervit-t_components-a_shapes.py', label='(a) PerViT-T, peripheral init'),
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
analyse = True
work_dir = 'work_dirs/compare_phis/ablations'
