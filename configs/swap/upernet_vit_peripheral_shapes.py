# The model of upernet_vit-b16_peripheral_512x512_160k_ade20k.py at DeiT-T's width (192 channels, 3
# heads, the same 12 layers and outputs), from scratch, on the embedded dense set with the data,
# heads and schedule of ../upernet_pervit-t_shapes.py (128 x 192 images of shapes, label maps,
# 600 iterations, mIoU): mmseg's ViT with peripheral attention swapped in by PosattnSwappedBackbone,
# mmseg's multi-level neck, UPerNet.
_base_ = ['../upernet_pervit-t_shapes.py']

channels = 128
model = dict(
    backbone=dict(
        _delete_=True,
        type='PosattnSwappedBackbone',
        backbone=dict(type='mmseg.VisionTransformer', img_size=(128, 192), patch_size=16, embed_dims=192,
                      num_layers=12, num_heads=3, out_indices=(2, 5, 8, 11), norm_cfg=dict(type='LN', eps=1e-6)),
        phi='peripheral'),
    neck=dict(_delete_=True, type='MultiLevelNeck', in_channels=[192] * 4, out_channels=channels,
              scales=[4, 2, 1, 0.5]),
    auxiliary_head=dict(in_index=3),  # mmseg's ViT configs read the last level
)
