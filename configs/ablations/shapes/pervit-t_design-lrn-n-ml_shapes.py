# The embedded replication: row (a) with Φp designed as Lrn + N + ML: a learned position embedding
# in place of the Euclidean distance (Table 5, bottom; row (a) is Euc + N + ML).
_base_ = ['./pervit-t_components-a_shapes.py']
model = dict(backbone=dict(phi_embedding='lrn'))
