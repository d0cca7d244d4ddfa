# The embedded replication: row (a) with Φp designed as Euc + ML: no neighbourhood term (Table 5,
# bottom; row (a) is Euc + N + ML).
_base_ = ['./pervit-t_components-a_shapes.py']
model = dict(backbone=dict(phi_neighbourhood=False))
