# PerViT's component study, Φp initialisations and Φp designs (the rows of ablations.py) on the harder
# set, PositionalRelations. Row (a) is the PerViT-T row of relations.py (the same config and
# clipping), so the two studies share its runs when they share a work dir's run records; every other
# row's config clips gradients to norm 1 itself.
_base_ = './ablations.py'
row_changes = dict(a=dict(config='study/pervit-t-half_shapes.py', options={'optim_wrapper.clip_grad.max_norm': 1.0}))
data = '../_base_/relations.py'
work_dir = 'work_dirs/compare_phis/relations_ablations'
