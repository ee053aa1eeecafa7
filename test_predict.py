"""predict.py, run as a user runs it: a model train.py trained on a small ImageFolder names its held-out
images' classes by the folders it learnt, as its own validation judged them; the authors' released format
is named by ImageNet-1K's classes.
"""
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import data
import models
import predict
from checkpoints import read_metrics
from test_models import readme_block
from test_train import TINY_ARGS, run_train, write_image_folder

PREDICT = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'predict.py')


def top5(stdout):
    """{image: [(probability, class), ...]}, as predict.py printed them: the image, then a line each."""
    found, image = {}, None
    for line in stdout.splitlines()[1:]:  # after the model's line
        if m := re.fullmatch(r'  (\d\.\d{3})  (.+)', line):
            found[image].append((float(m.group(1)), m.group(2)))
        else:
            image = line
            found[image] = []
    return found


def test_predict_names_the_trained_classes_as_the_loops_evaluation_judged_them(tmp_path):
    """Trained at 32x48 px on red and blue folders, with one red image filed under val/blue (a label the
    model should get wrong): predict.py, from best.pt alone, names each held-out image by a folder name,
    and its top-1 is right exactly where the loop's validation was (val_correct.pt, in the ImageFolder's
    order), so its accuracy is the logged one."""
    root, out = str(tmp_path / 'data'), str(tmp_path / 'run')
    write_image_folder(root, {'train': 12, 'val': 4})
    shutil.move(os.path.join(root, 'val', 'red', '3.png'), os.path.join(root, 'val', 'blue', 'x.png'))
    run_train(TINY_ARGS + ['--data-path', root, '--epochs', '1', '--warmup-epochs', '0', '--img-size',
                           '32', '48', '--output-dir', out])  # one epoch: best.pt is the last validated
    images = sorted(glob.glob(os.path.join(root, 'val', '*', '*.png')))  # ImageFolder's order
    result = subprocess.run([sys.executable, PREDICT, '--checkpoint', os.path.join(out, 'best.pt'),
                             '--batch-size', '3', *images], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[0].endswith('best.pt, 32x48 px, 2 classes'), result.stdout
    found = top5(result.stdout)
    assert list(found) == images and all(len(top) == 2 for top in found.values())
    assert all({name for _, name in top} == {'blue', 'red'} for top in found.values())
    assert all(abs(sum(p for p, _ in top) - 1) < 2e-3 for top in found.values())  # 3 decimals each
    right = torch.tensor([top[0][1] == os.path.basename(os.path.dirname(image))
                          for image, top in found.items()])
    loop = torch.load(os.path.join(out, 'val_correct.pt'), weights_only=True)
    assert torch.equal(right, loop) and not right.all()  # the misfiled image is wrong for both
    print(f'top-1 right on {right.sum()} of {len(right)} held-out images')
    assert 100 * right.float().mean().item() == pytest.approx(read_metrics(out)[-1]['val_acc1'])
    # the README's three lines ("Using a trained model") give predict.py's top classes
    printed = []
    block = readme_block('## Using a trained model').replace('OUT/best.pt', os.path.join(out, 'best.pt'))
    exec(block.replace("'IMAGE'", repr(images[0])), {'data': data, 'predict': predict, 'print': printed.append})
    assert [name for name, _ in printed[0]] == [name for _, name in found[images[0]]]
    assert [p for _, p in printed[0]] == pytest.approx([p for p, _ in found[images[0]]], abs=1.1e-3)


def test_predict_names_imagenet_classes_for_the_authors_files_and_refuses_what_it_cannot_read(
        tmp_path, capsys):
    """The authors' format ({'model': state_dict}) records no model: --model names it, and the 1000 classes
    are ImageNet-1K's, by name (here a head that picks class 1, goldfish). Without --model, with a --model
    the file contradicts, or with an image it cannot read, it says so."""
    torch.manual_seed(0)
    model = models.create_model('inline_deit_t')  # its released size, 224 px
    with torch.no_grad():
        model.head.weight.zero_()
        model.head.bias.copy_(torch.arange(1000) == 1)  # logit 1 for goldfish, 0 elsewhere
    authors, ours = str(tmp_path / 'inline_deit_t.pth'), str(tmp_path / 'best.pt')
    torch.save({'model': model.state_dict()}, authors)
    torch.save({'model': model.state_dict(), 'args': {'model': 'inline_deit_t'}, 'arch': {}}, ours)
    write_image_folder(str(tmp_path / 'images'), {'val': 1})
    image, broken = str(tmp_path / 'images' / 'val' / 'red' / '0.png'), str(tmp_path / 'notes.txt')
    with open(broken, 'w') as f:
        f.write('not an image')
    predict.classify(predict.parse_args(['--model', 'inline_deit_t', '--checkpoint', authors, image]))
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith('inline_deit_t.pth, 224 px, 1000 classes'), out
    top = top5(out)[image]
    assert top[0][1] == 'goldfish' == predict.IMAGENET_CLASSES[1] and len(top) == 5
    assert top[0][0] == pytest.approx(torch.e / (torch.e + 999), abs=1e-3)
    for argv, said in ((['--checkpoint', authors, image], 'records no model, as the authors\' released '
                                                           'files do not: give its variant, --model NAME'),
                       (['--model', 'inline_swin_t', '--checkpoint', ours, image],
                        'holds a inline_deit_t, not a inline_swin_t: leave --model out'),
                       (['--checkpoint', ours, image, broken], '1 of 2 image(s) could not be read')):
        with pytest.raises(SystemExit) as e:
            predict.classify(predict.parse_args(argv))
        printed = capsys.readouterr()
        assert e.value.code == 1 and said in printed.err, printed.err
    # the image it could read is classified, the other named
    assert image in top5(printed.out) and f'{broken}: cannot read it (cannot identify' in printed.out
