# Mask R-CNN (mmdet's R-50-FPN model) with PerViT-T as the backbone: windowed peripheral attention
# (14 x 14 windows, Φp shared by all windows) with global blocks 3, 7, 11, and ViTDet's simple
# feature pyramid from the one stride-16 map to strides 4-64 in place of the FPN.
_base_ = ['mmdet::_base_/models/mask-rcnn_r50_fpn.py']

custom_imports = dict(imports=['integrations.openmmlab', 'integrations.openmmlab.detection'],
                      allow_failed_imports=False)

model = dict(
    backbone=dict(
        _delete_=True,
        type='PosattnPerViT',
        arch='tiny',
        out_indices=-1,
        drop_path_rate=0.1,
        window_size=14,
        global_blocks=(3, 7, 11),
        with_cp=False),  # no init_cfg: from scratch; the COCO / ADE20K configs add a Pretrained one
    neck=dict(_delete_=True, type='PosattnSimpleFPN', in_channels=280, out_channels=256, num_outs=5),
)

