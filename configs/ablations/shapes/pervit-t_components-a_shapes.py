# The embedded replication of PerViT's study (tools/compare_phis.py --experiment ablations), row (a):
# PerViT-T itself at half width (configs/study/pervit-t-half_shapes.py: learning rate 1e-3), with the
# data and budget of every *_shapes.py config (a 4 x 4 grid, 6000 images, 10 epochs) and gradients
# clipped to norm 1. Without the clipping, some seeds of rows (c), rand init and Euc + ML stayed at
# chance for the whole run; with it the same seed of rand init reached 96.9% in 3 epochs.
_base_ = ['../../study/pervit-t-half_shapes.py']
optim_wrapper = dict(clip_grad=dict(max_norm=1.0))
