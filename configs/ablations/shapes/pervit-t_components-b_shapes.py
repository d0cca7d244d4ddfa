# The embedded replication, row (b): without Φp (plain multi-head attention), as Table 1 (b).
_base_ = ['./pervit-t_components-a_shapes.py']
model = dict(backbone=dict(phi='none'))
