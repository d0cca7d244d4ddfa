# No position information: plain attention and no absolute embedding, so the model sees its patches
# as a set. The floor of the resolution study: it tells the two shapes apart, and their order only
# where one 16 x 16 patch shows parts of both.
_base_ = './deit-t-half_ape_shapes.py'
model = dict(backbone=dict(pos_embed=False))
