"""Classify images with a trained model: each image's top 5 classes, by name, with probabilities.

InLine attention: Han et al., "Bridging the Divide: Reconsidering Softmax and Linear Attention",
NeurIPS 2024, arXiv 2412.06590. A checkpoint of train.py rebuilds its model alone: the variant and
the create_model arguments it was built with, its image size, its class names (the folders it was
trained on) and the evaluation transform of its recipe (README, "Training"):
    python predict.py --checkpoint OUT/best.pt IMAGE [IMAGE ...]
The authors' released ImageNet-1K files record none of these: --model names the variant, which
gives its image size and the released transform; the classes are ImageNet-1K's, named as
torchvision's weights name them (no download):
    python predict.py --model inline_swin_t --checkpoint inline_swin_t.pth IMAGE [IMAGE ...]
In Python, as this file runs it:
    model, transform, classes = predict.load_classifier('OUT/best.pt')
    p = model(transform(data.load_rgb('IMAGE'))[None]).softmax(1)[0]  # (classes,)
    print([(classes[i], round(p[i].item(), 3)) for i in p.topk(5).indices])
"""
import argparse
import types

import torch
from torchvision.models import ResNet50_Weights

import data
import models
from checkpoints import EMA_KEYS, read_file, saved_record
from ranks import fail

# ImageNet-1K's class names in label order, as torchvision's weights carry them, offline
IMAGENET_CLASSES = ResNet50_Weights.IMAGENET1K_V2.meta['categories']
TOP = 5


def load_classifier(path, name=None):
    """(model, transform, classes) of the checkpoint at path: the model, in eval mode, with the
    file's EMA weights where it has them (as CSwin's released results are its EMA's), else its own;
    the evaluation transform of its recipe, an image to (3, H, W); the class names in label order.
    name: the variant of a file that records none (the authors'): its own image size, the released
    transform and, for 1000 classes, ImageNet-1K's names."""
    saved = read_file(path)
    flags, _ = saved_record(saved)
    held = (flags or {}).get('model')
    if name and held and name != held:
        raise ValueError(f'{path} holds a {held}, not a {name}: leave --model out')
    name = name or held
    if name is None:
        raise ValueError(f"{path} records no model, as the authors' released files do not: give "
                         f"its variant, --model NAME, one of {', '.join(models.MODELS)}")
    key = next((k for k in EMA_KEYS if saved.get(k) is not None), 'model')
    # the record (args, arch) with the chosen weights: create_model builds what the file holds
    model = models.create_model(name, checkpoint={**saved, 'model': saved[key]}).eval()
    recipe = (flags or {}).get('recipe', 'released')  # the authors' files: the released recipe
    transform = data.val_transform(types.SimpleNamespace(recipe=recipe, model=name,
                                                         img_size=model.img_size))
    classes = saved.get('classes')
    if classes is None and flags is None and model.num_classes == len(IMAGENET_CLASSES):
        classes = IMAGENET_CLASSES
    if classes is None:  # a checkpoint saved before train.py recorded the class names
        print(f'note: {path} records no class names: classes by number')
        classes = [f'class {i}' for i in range(model.num_classes)]
    return model, transform, list(classes)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('images', nargs='+', metavar='IMAGE', help='image files, any size and format '
                   'PIL reads')
    p.add_argument('--checkpoint', required=True,
                   help="train.py's checkpoint (OUTPUT_DIR/best.pt), or an authors' file")
    p.add_argument('--model', choices=sorted(models.MODELS), metavar='NAME',
                   help="the variant of a file that records none (the authors' released files)")
    p.add_argument('--batch-size', type=int, default=32, help='images per forward pass (32)')
    return p.parse_args(argv)


@torch.no_grad()
def classify(args):
    if args.batch_size < 1:
        fail(f'--batch-size {args.batch_size} is out of range: it must be >= 1')
    try:
        model, transform, classes = load_classifier(args.checkpoint, args.model)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        fail(f'cannot classify with {args.checkpoint}: {e}')
    device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    model.to(device)
    print(f'model: {model.name} from {args.checkpoint}, {data.pixels(model.img_size)}, '
          f'{len(classes)} classes')
    unread = []
    for start in range(0, len(args.images), args.batch_size):
        batch, images = args.images[start:start + args.batch_size], {}
        for path in batch:
            try:
                images[path] = transform(data.load_rgb(path))  # (3, H, W)
            except Exception as e:  # PIL's OSError, ValueError, ...: named, and the rest go on
                images[path] = str(e) or type(e).__name__
        read = [path for path in batch if isinstance(images[path], torch.Tensor)]
        if read:
            x = torch.stack([images[path] for path in read]).to(device)  # (B, 3, H, W)
            probs = model(x).softmax(1).cpu()  # (B, classes)
            top = dict(zip(read, zip(*probs.topk(min(TOP, len(classes)), dim=1))))
        for path in batch:
            if path not in read:
                print(f'{path}: cannot read it ({images[path]})')
                unread.append(path)
                continue
            print(path)
            for p, i in zip(*top[path]):
                print(f'  {p.item():.3f}  {classes[i]}')
    if unread:  # the others are classified; a script sees that some were not
        fail(f'{len(unread)} of {len(args.images)} image(s) could not be read')


if __name__ == '__main__':
    classify(parse_args())
