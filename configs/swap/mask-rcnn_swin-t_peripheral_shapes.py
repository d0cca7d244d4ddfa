# The model of mask-rcnn_swin-t_peripheral_fpn_1x_coco.py, from scratch, on the embedded dense set
# with the data, heads and schedule of ../mask-rcnn_pervit-t_shapes.py (128 x 192 images of shapes,
# boxes and masks, heads at 128 channels, 500 iterations, COCO mAP): mmdet's Swin-T with peripheral
# attention swapped in by PosattnSwappedBackbone, mmdet's FPN, Mask R-CNN.
_base_ = ['../mask-rcnn_pervit-t_shapes.py']

model = dict(
    backbone=dict(
        _delete_=True,
        type='PosattnSwappedBackbone',
        backbone=dict(type='mmdet.SwinTransformer', embed_dims=96, depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24],
                      window_size=7, mlp_ratio=4, qkv_bias=True, qk_scale=None, drop_rate=0.0, attn_drop_rate=0.0,
                      drop_path_rate=0.2, patch_norm=True, out_indices=(0, 1, 2, 3), with_cp=False),
        phi='peripheral'),
    neck=dict(_delete_=True, type='FPN', in_channels=[96, 192, 384, 768], out_channels={{_base_.channels}},
              num_outs=5),
)
