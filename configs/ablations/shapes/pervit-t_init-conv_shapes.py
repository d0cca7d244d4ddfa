# The embedded replication: row (a) with the "conv" initialisation of every Φp (Table 5, top).
_base_ = ['./pervit-t_components-a_shapes.py']
model = dict(backbone=dict(phi_init='conv'))
