"""Dense prediction with the InLine backbones, as the paper ran it on COCO and ADE20K.

InLine attention: Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention",
NeurIPS 2024, arXiv 2412.06590. The paper puts PVT and Swin in Mask R-CNN and Semantic FPN; the
authors released no dense-prediction code. Here the backbones follow timm's features_only
convention (create_backbone, FeatureBackbone), torchvision's FPN goes under them for its MaskRCNN,
FasterRCNN and RetinaNet (BackboneWithFPN), and SemanticFPN is the Semantic FPN head. An example
that runs in seconds on a CPU (test_models.py's
test_detection_example_trains_mask_rcnn_with_inline_swin_t runs it as written):

    import torch
    import torch.nn.functional as F
    from PIL import Image
    from torchvision.models.detection import MaskRCNN
    from torchvision.transforms.v2.functional import pil_to_tensor

    import dense

    # InLine-Swin-T under FPN in Mask R-CNN (checkpoint='inline_swin_t.pth': the ImageNet weights;
    # layout='SSSS': Swin-T), at sizes that run in seconds on a CPU (COCO: 800, 1333, 2000, 1000,
    # 512)
    backbone = dense.create_backbone('inline_swin_t')
    model = MaskRCNN(dense.BackboneWithFPN(backbone), num_classes=91, min_size=128, max_size=192,
                     rpn_post_nms_top_n_train=200, rpn_post_nms_top_n_test=100,
                     box_batch_size_per_image=64)

    # One training step on two images of different sizes, each with one box and its mask.
    images = [torch.rand(3, 120, 160), torch.rand(3, 160, 120)]
    targets = []
    for image in images:
        mask = torch.zeros(1, *image.shape[1:], dtype=torch.uint8)
        mask[:, 20:80, 30:100] = 1
        box = torch.tensor([[30., 20., 100., 80.]])
        targets.append(dict(boxes=box, labels=torch.tensor([1]), masks=mask))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05)
    model.train()
    # loss_classifier, loss_box_reg, loss_mask, loss_objectness, loss_rpn_box_reg
    losses = model(images, targets)
    sum(losses.values()).backward()
    optimizer.step()

    # Inference on an image file, in the image's pixels
    model.eval()
    # any RGB image
    image = pil_to_tensor(Image.open('figures/maps.png').convert('RGB')).float() / 255
    with torch.no_grad():
        # boxes, labels, scores, masks (untrained: few pass its score threshold)
        prediction = model([image])[0]

    # Semantic segmentation: InLine-PVT-T under the Semantic FPN head, 150 classes as ADE20K.
    backbone = dense.create_backbone('inline_pvt_t')
    segmenter = dense.SemanticFPN(backbone, num_classes=150)
    logits = segmenter(torch.rand(2, 3, 96, 128))  # (2, 150, 96, 128)
    loss = F.cross_entropy(logits, torch.randint(0, 150, (2, 96, 128)))
    loss.backward()

A COCO run goes through torchvision's references/detection/train.py with this model for
get_model(...).

A backbone is any hierarchical model of models.py, which gives its four stage maps with
forward_features(x, return_stages=True); create_backbone builds one by name and wraps it.
Shapes: B batch, C_i stage i's channels, r_i = 4, 8, 16, 32 its stride, (H, W) the image.
"""
import math
from collections import OrderedDict

import torch.nn as nn
import torch.nn.functional as F
from torchvision.ops import FeaturePyramidNetwork
from torchvision.ops.feature_pyramid_network import LastLevelMaxPool
from torchvision.ops.misc import Conv2dNormActivation

import models

# A LayerNorm on each output stage where the family's own dense backbone has one: Swin's detection
# backbone (norm0..norm3) and CSwin's segmentation backbone (norm1..norm4) do; PVT's (v1, the
# lineage of InLine-PVT: whai362/PVT detection/pvt.py) returns the raw stage maps. DeiT is
# isotropic, one stride-16 map and a class token: the paper's dense results use PVT and Swin, so it
# is refused rather than given a feature pyramid (ViTDet's) that no InLine result was measured with.
OUTPUT_NORMS = {'pvt': False, 'swin': True, 'cswin': True}


def stage_channels(model):
    if model.family == 'pvt':
        return [getattr(model, f'patch_embed{i + 1}').proj.out_channels for i in range(4)]
    # Swin and CSwin double C at each merge
    return [model.num_features // 2 ** (3 - i) for i in range(4)]


class FeatureInfo(list):
    """timm's model.feature_info, the part detection code reads: one dict per output (num_chs,
    reduction, module) and the lists channels() and reduction()."""

    def channels(self):
        return [f['num_chs'] for f in self]

    def reduction(self):
        return [f['reduction'] for f in self]


class FeatureBackbone(nn.Module):
    """timm's features_only model: images (B, 3, H, W) -> [(B, C_i, H / r_i, W / r_i)] for i in
    out_indices, r_i = 4, 8, 16, 32, with the output norms of OUTPUT_NORMS (keys norms.j). Any image
    size: H and W not multiples of 32 are zero-padded at the bottom and right first, as Swin's
    detection backbone pads (so maps are ceil(H / r_i)); PVT's position embeddings are resized per
    input. The classifier's head and final norm are removed; stages after the last selected one
    still run."""

    def __init__(self, model, out_indices=(0, 1, 2, 3)):
        super().__init__()
        if model.family not in OUTPUT_NORMS:
            raise ValueError(f"dense prediction: {type(model).__name__} is isotropic (one "
                             f"stride-16 map); dense prediction supports the hierarchical families "
                             f"{', '.join(OUTPUT_NORMS)}, as the paper used them")
        increasing = list(out_indices) == sorted(set(out_indices))
        if not out_indices or not increasing or not set(out_indices) <= {0, 1, 2, 3}:
            raise ValueError(f"out_indices must be increasing stage indices from 0-3, "
                             f"got {out_indices}")
        model.reset_classifier(0)
        if hasattr(model, 'norm'):  # the classifier's final norm, which no output goes through
            model.norm = nn.Identity()
        self.model, self.out_indices = model, tuple(out_indices)
        channels = stage_channels(model)
        blocks = {'pvt': 'model.block{}', 'swin': 'model.layers.{}',
                  'cswin': 'model.stage{}'}[model.family]
        self.feature_info = FeatureInfo(dict(num_chs=channels[i], reduction=2 ** (i + 2),
                                             module=blocks.format(i if model.family == 'swin'
                                                                  else i + 1))
                                        for i in out_indices)
        self.norms = nn.ModuleList([nn.LayerNorm(channels[i]) if OUTPUT_NORMS[model.family]
                                    else nn.Identity()
                                    for i in out_indices])

    def forward(self, x):
        # H' and W' multiples of 32
        x = F.pad(x, (0, -x.shape[3] % 32, 0, -x.shape[2] % 32))  # (B, 3, H', W')
        # 4 x (B, C_i, H' / r_i, W' / r_i)
        stages = self.model.forward_features(x, return_stages=True)
        # LayerNorm over C, channels last
        return [norm(stages[i].permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
                for norm, i in zip(self.norms, self.out_indices)]


def create_backbone(name, *, out_indices=(0, 1, 2, 3), **kwargs):
    """timm's create_model(name, features_only=True): models.create_model(name, **kwargs) (a
    checkpoint, fast, sizes, ...) as a FeatureBackbone of the stages out_indices."""
    return FeatureBackbone(models.create_model(name, **kwargs), out_indices)


def fpn_inputs(features):
    # torchvision's names: '0', '1', ...
    return OrderedDict((str(i), f) for i, f in enumerate(features))


class BackboneWithFPN(nn.Module):
    """A FeatureBackbone under torchvision's FeaturePyramidNetwork: images -> OrderedDict of maps of
    out_channels each, '0', '1', ... for the selected stages, then extra_blocks' ('pool' by default,
    LastLevelMaxPool as in torchvision's Mask R-CNN). It has what torchvision's MaskRCNN, FasterRCNN
    and RetinaNet ask of a backbone (forward to an OrderedDict, out_channels). For RetinaNet, as
    torchvision builds it: out_indices=(1, 2, 3) and extra_blocks=LastLevelP6P7(out_channels,
    out_channels), five levels."""

    def __init__(self, backbone, out_channels=256, extra_blocks=None):
        super().__init__()
        self.body = backbone
        extra_blocks = LastLevelMaxPool() if extra_blocks is None else extra_blocks
        self.fpn = FeaturePyramidNetwork(backbone.feature_info.channels(), out_channels,
                                         extra_blocks=extra_blocks)
        self.out_channels = out_channels

    def forward(self, x):
        return self.fpn(fpn_inputs(self.body(x)))


class SemanticFPN(nn.Module):
    """The semantic branch of Panoptic FPN (Kirillov et al., CVPR 2019), the paper's ADE20K head for
    PVT: an FPN of fpn_channels over the stages; from each level, repeated until stride 4, a 3x3
    conv to `channels` + GroupNorm(32) + ReLU + 2x bilinear upsampling (one conv, no upsampling, at
    stride 4); their sum -> dropout -> 1x1 conv -> bilinear to the image: (B, 3, H, W) -> logits
    (B, classes, H, W). GroupNorm as in Kirillov et al.; the PVT authors' mmseg config (fpn_pvt_*)
    uses SyncBN there."""

    def __init__(self, backbone, num_classes, fpn_channels=256, channels=128, dropout=0.1):
        super().__init__()
        self.backbone = backbone
        self.fpn = FeaturePyramidNetwork(backbone.feature_info.channels(), fpn_channels)
        self.scale_heads = nn.ModuleList()
        self.stride = min(backbone.feature_info.reduction())  # 4 with stage 1 selected
        for reduction in backbone.feature_info.reduction():
            layers = []
            # one per 2x to the finest
            for j in range(max(1, int(math.log2(reduction // self.stride)))):
                layers.append(Conv2dNormActivation(fpn_channels if j == 0 else channels, channels,
                                                   3, norm_layer=lambda c: nn.GroupNorm(32, c)))
                if reduction > self.stride:
                    layers.append(nn.Upsample(scale_factor=2, mode='bilinear', align_corners=False))
            self.scale_heads.append(nn.Sequential(*layers))
        self.classifier = nn.Sequential(nn.Dropout2d(dropout), nn.Conv2d(channels, num_classes, 1))

    def forward(self, x):
        H, W = x.shape[2:]
        # (B, fpn_channels, H' / r, W' / r) each
        levels = self.fpn(fpn_inputs(self.backbone(x))).values()
        # (B, channels, H' / 4, W' / 4)
        y = sum(head(level) for head, level in zip(self.scale_heads, levels))
        y = self.classifier(y)  # (B, classes, H' / 4, W' / 4)
        y = F.interpolate(y, scale_factor=self.stride, mode='bilinear')  # (B, classes, H', W')
        return y[:, :, :H, :W]  # the padding to multiples of 32 cut off


