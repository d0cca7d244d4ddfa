# The embedded replication of PerViT's study (tools/compare_phis.py --experiment ablations), row (a):
# PerViT-T itself at half width (configs/study/pervit-t-half_shapes.py: learning rate 1e-3), with the
# data and budget of every *_shapes.py config: a 4 x 4 grid, 6000 images, 10 epochs. At this budget a
# row's seeds agree; an 8 x 8 grid (a stride-8 stem) made each run wait for a step whose epoch the
# seed decided.
_base_ = ['../../study/pervit-t-half_shapes.py']
