# PerViT-T as the backbone of the detection and segmentation configs (mask_rcnn_pervit.py,
# upernet_pervit.py): windowed peripheral attention (14 x 14 windows, Φp shared by all windows)
# with global blocks 3, 7, 11 (ViTDet's recipe), one stride-16 map out. No init_cfg: from scratch;
# the COCO / ADE20K configs add a Pretrained one.
pervit_backbone = dict(
    type='PosattnPerViT',
    arch='tiny',
    out_indices=-1,
    drop_path_rate=0.1,
    window_size=14,
    global_blocks=(3, 7, 11),
    with_cp=False,
)
