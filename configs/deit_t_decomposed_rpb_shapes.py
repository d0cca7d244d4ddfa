# DeiT-T + decomposed relative position embeddings (Φp = decomposed_rpb: one table per axis, read by
# the query, as MViTv2 and SAM; no absolute embedding) on the embedded set.
_base_ = './deit_t_none_shapes.py'
model = dict(backbone=dict(phi='decomposed_rpb', pos_embed=False))
