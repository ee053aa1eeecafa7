"""The four backbones (models.py) against the authors' released models: golden blocks, parameter counts, keys,
MACs, every registered variant forward and backward, dense prediction.
"""
import gzip
import itertools
import os
import re
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import checkpoints
import dense
import inline
import kernels
import models
from conftest import GOLDEN

# ===================================================================================================
# models.py: the four backbones against the authors' released models

SLOW = pytest.mark.skipif(not os.environ.get('INLINE_SLOW'), reason="set INLINE_SLOW=1 for every variant")
TINY = ['inline_deit_t', 'inline_pvt_t', 'inline_swin_t', 'inline_cswin_t']  # one variant per family

# Small models of each family, for real forward and backward passes on a non-square image. They reach
# every code path: class token, separate q/kv, I, L, S and M letters, padded and shifted Swin windows,
# two-branch CSwin stripes that need padding (stage 3: a 4x6 map in stripes of 3).
SMALL_SIZES = {
    'inline_deit_t': dict(img_size=(48, 80), embed_dim=32, depth=2, num_heads=2, layout='I'),
    'inline_pvt_t': dict(img_size=(64, 96), embed_dims=(16, 32, 32, 64), depths=(1, 1, 1, 1),
                         num_heads=(1, 2, 2, 2), layout='ILII'),
    'inline_swin_t': dict(img_size=(64, 96), embed_dim=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4),
                          layout='SIMS1', softmax_window=3),
    'inline_cswin_t': dict(img_size=(64, 96), embed_dim=16, depths=(1, 2, 2, 1), num_heads=(2, 2, 4, 4),
                           layout='ILSS', stripes=(1, 2, 3, 3)),
}


def released_keys(name):
    """[(key, shape, kind)] of the authors' state dict for a variant."""
    with gzip.open(os.path.join(GOLDEN, 'keys', f'{name}.tsv.gz'), 'rt') as f:
        rows = [line.rstrip('\n').split('\t') for line in f][1:]
    return [(key, tuple(int(n) for n in shape.split('x')), kind) for key, shape, kind in rows]


def meta_model(name, **overrides):
    with torch.device('meta'):
        return models.create_model(name, **overrides)


def perturb(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return module


# ---------------------------------------------------------------------------------------------------
# The authors' blocks, reproduced from their weights

DEFAULTS = models.ATTENTION_OPTIONS  # the released models' attention: phi the identity, Eq. 6


def golden_block(name, cfg):
    """Our module for a golden case, built from its config."""
    dim, heads = cfg['dim'], cfg['heads']
    if name.startswith('swin_attention'):
        # the golden file names phi by the authors' word, its 'kernel'
        return inline.InLineAttention(dim, heads, feature_map=cfg['kernel'])
    if name.startswith('swin_block'):
        assert cfg['shift'] in (0, cfg['window'] // 2)
        return models.SwinBlock(dim, heads, cfg['attn'], cfg['window'], cfg['shift'] > 0, cfg['mlp_ratio'],
                                0., DEFAULTS)
    if name in ('deit_block', 'pvt_block'):
        attn = models.block_attention('I', dim, heads, DEFAULTS, separate_q=name == 'pvt_block',
                                     leading_tokens=int(name == 'deit_block'))  # DeiT's class token
        return models.Block(dim, cfg['mlp_ratio'], 0., cfg['norm_eps'], attn)
    if name.startswith('cswin_block'):
        return models.CSwinBlock(dim, heads, cfg['attn'], cfg['split'], cfg['grid'], cfg['mlp_ratio'],
                                 0., DEFAULTS)
    raise KeyError(name)


GOLDEN_CASES = ['swin_block_inline', 'swin_block_softmax_shifted', 'swin_attention_identity',
                'swin_attention_relu', 'swin_attention_leakyrelu', 'swin_attention_exp', 'deit_block',
                'pvt_block', 'cswin_block_inline', 'cswin_block_softmax_stripes']


@pytest.mark.parametrize('name', GOLDEN_CASES)
def test_golden_block(golden, name):
    torch.manual_seed(0)
    case = golden[name]
    block = golden_block(name, case['config']).double().eval()
    state = {k: v for k, v in case['state_dict'].items()
             if k.rsplit('.', 1)[-1] not in checkpoints.REBUILT_BUFFERS}
    block.load_state_dict(state, strict=True)  # the authors' key names, unmapped
    out = block(*case['inputs'], case['config']['grid'])
    error = (out - case['output']).abs().max().item()
    print(f"{name}: max |ours - authors'| = {error:.1e}")
    assert error < 1e-10


def test_rebuilt_buffers_equal_the_released_ones(golden):
    state = golden['swin_block_softmax_shifted']['state_dict']  # window 4, shift 2, 8x8 map
    assert torch.equal(models.window_mask(8, 8, 4, 4, 2, 2, 'cpu'), state['attn_mask'])
    assert torch.equal(models.relative_position_index(4, 4, 4, 'cpu'), state['attn.relative_position_index'])


# ---------------------------------------------------------------------------------------------------
# Windows that do not tile the map: padded and masked, checked against attention written without
# windows at all (global attention, a token pair allowed iff in the same window of the original frame)

def swin_reference(block, x, grid):
    (h, w), window = grid, block.window
    y, xx = (t.flatten() for t in torch.meshgrid(torch.arange(h), torch.arange(w), indexing='ij'))

    def group(c, L):  # which window a coordinate falls in: windows start at -shift, cut at the border
        size = min(window, L)
        shift = window // 2 if block.shift and size < L else 0
        return torch.div(c - shift, size, rounding_mode='floor')

    allowed = (group(y, h)[:, None] == group(y, h)[None]) & (group(xx, w)[:, None] == group(xx, w)[None])
    index = (y[:, None] - y[None] + window - 1) * (2 * window - 1) + (xx[:, None] - xx[None] + window - 1)
    bias = block.attn.relative_position_bias_table[torch.where(allowed, index, 0)].permute(2, 0, 1)
    B, N, C = x.shape
    q, k, v = block.attn.qkv(block.norm1(x)).view(B, N, 3, block.attn.num_heads, -1).permute(2, 0, 3, 1, 4)
    a = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5 + bias
    a = a.masked_fill(~allowed, float('-inf')).softmax(-1)
    x = x + block.attn.proj((a @ v).transpose(1, 2).reshape(B, N, C))
    return x + block.mlp(block.norm2(x))


@pytest.mark.parametrize('grid,window,shift', [((8, 8), 4, True), ((6, 10), 4, True), ((5, 7), 3, False),
                                               ((3, 9), 4, True), ((7, 5), 3, True)],
                         ids=['8x8-w4-shift', '6x10-w4-shift-pad', '5x7-w3-pad', '3x9-w4-one-axis-covered',
                              '7x5-w3-shift-pad'])
def test_swin_windows_against_global_masked_attention(grid, window, shift):
    torch.manual_seed(0)
    block = perturb(models.SwinBlock(16, 2, 'S', window, shift, 2., 0., DEFAULTS).double())
    x = torch.randn(2, grid[0] * grid[1], 16, dtype=torch.float64)
    torch.testing.assert_close(block(x, grid), swin_reference(block, x, grid), rtol=0, atol=1e-12)


def cswin_reference(block, x, grid):
    h, w = grid
    B, N, C = x.shape
    y, xx = (t.flatten() for t in torch.meshgrid(torch.arange(h), torch.arange(w), indexing='ij'))
    q, k, v = block.qkv(block.norm1(x)).chunk(3, dim=-1)
    outs = []
    for attn, q, k, v in zip(block.attns, q.chunk(2, -1), k.chunk(2, -1), v.chunk(2, -1)):
        stripe = torch.div(xx if attn.axis == 0 else y, attn.stripe, rounding_mode='floor')
        heads = [t.view(B, N, attn.num_heads, -1).transpose(1, 2) for t in (q, k, v)]  # (B, H, N, D)
        a = (heads[0] @ heads[1].transpose(-2, -1)) * heads[0].shape[-1] ** -0.5
        o = a.masked_fill(stripe[:, None] != stripe[None], float('-inf')).softmax(-1) @ heads[2]
        dim = 3 if attn.axis == 0 else 2  # LePE: the depthwise conv, one stripe at a time
        v_map = v.transpose(1, 2).reshape(B, -1, h, w)
        lepe = torch.cat([attn.get_v(part) for part in v_map.split(attn.stripe, dim=dim)], dim=dim)
        outs.append(o.transpose(1, 2).reshape(B, N, -1) + lepe.flatten(2).transpose(1, 2))
    x = x + block.proj(torch.cat(outs, dim=-1))
    return x + block.mlp(block.norm2(x))


@pytest.mark.parametrize('grid,stripe', [((8, 8), 2), ((4, 6), 3), ((5, 7), 2)],
                         ids=['8x8-s2', '4x6-s3-pad', '5x7-s2-pad'])
def test_cswin_stripes_against_global_masked_attention(grid, stripe):
    torch.manual_seed(0)
    block = perturb(models.CSwinBlock(16, 2, 'S', stripe, grid, 2., 0., DEFAULTS).double())
    assert len(block.attns) == 2
    x = torch.randn(2, grid[0] * grid[1], 16, dtype=torch.float64)
    torch.testing.assert_close(block(x, grid), cswin_reference(block, x, grid), rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------------
# The released variants: parameters, MACs, checkpoint layout

@pytest.mark.parametrize('name', list(models.RELEASED))
def test_param_count(name):
    model = meta_model(name)
    assert sum(p.numel() for p in model.parameters()) == models.RELEASED[name][0]


@pytest.mark.parametrize('name', [n if n in TINY else pytest.param(n, marks=SLOW) for n in models.RELEASED])
def test_macs(name):
    """FLOPs / 2 from torch.utils.flop_counter within 0.1% of the authors' count (the issue asks 0.5%;
    we are closer, and a missing or extra matmul anywhere would show). Ours is lower only by the released
    code's q.k_mean product (N*D per head), which the centred form of Eq. 5 does not compute."""
    gmacs = models.count_macs(meta_model(name)) / 1e9
    released = models.RELEASED[name][1]
    print(f"{name}: {gmacs:.3f} GMACs, released {released:.3f}")
    assert abs(gmacs / released - 1) < 0.001


# transnormer_swin_t is our construction: no released checkpoint, no keys
@pytest.mark.parametrize('name', [n for n in models.RELEASED if n != 'transnormer_swin_t'])
def test_keys_match_the_released_checkpoint(name):
    """Our state dict is the authors' parameters, key for key and shape for shape, with no mapping."""
    ours = {k: tuple(v.shape) for k, v in meta_model(name).state_dict().items()}
    assert ours == {k: shape for k, shape, kind in released_keys(name) if kind == 'parameter'}


@pytest.mark.parametrize('name', TINY)
def test_released_format_loads_strictly(name, tmp_path):
    torch.manual_seed(0)
    state = {k: torch.randn(shape) if kind == 'parameter' else torch.zeros(shape)  # buffers: rebuilt, ignored
             for k, shape, kind in released_keys(name)}
    path = tmp_path / 'released.pth'
    torch.save({'model': state, 'epoch': 299}, path)
    for source in (path, state):  # a file, or a state dict already in memory
        model = meta_model(name).to_empty(device='cpu')  # skips the random init, which the load overwrites
        models.load_checkpoint(model, source)
        for k, v in model.state_dict().items():
            assert torch.equal(v, state[k]), k


def test_checkpoint_with_wrong_keys_names_them(tmp_path):
    torch.manual_seed(0)
    state = models.create_model('inline_deit_t', **SMALL_SIZES['inline_deit_t']).state_dict()
    del state['blocks.0.attn.proj.bias']
    state['blocks.9.attn.qkv.weight'] = torch.zeros(1)
    torch.save({'model': state}, tmp_path / 'wrong.pth')
    with pytest.raises(RuntimeError, match=r"1 of its keys missing \(blocks\.0\.attn\.proj\.bias\), "
                                           r"1 unexpected \(blocks\.9\.attn\.qkv\.weight\)"):
        models.create_model('inline_deit_t', checkpoint=tmp_path / 'wrong.pth', **SMALL_SIZES['inline_deit_t'])


def test_a_checkpoint_of_other_sizes_names_them_and_how_to_rebuild(tmp_path):
    """train.py's checkpoint loaded into a model of other sizes: the sizes it stores, the call and the flags
    that rebuild them, in two lines rather than hundreds of keys; the call runs as printed and returns the
    file's model, its trained head included. A bare state dict of another variant says what to choose."""
    torch.manual_seed(0)
    small = SMALL_SIZES['inline_swin_t']
    model = perturb(models.create_model('inline_swin_t', **small, num_classes=7))
    path = tmp_path / 'checkpoint.pt'
    torch.save({'model': model.state_dict(), 'args': {'model': 'inline_swin_t'}, 'arch': model.arch}, path)
    with pytest.raises(RuntimeError) as e:
        models.load_checkpoint(models.create_model('inline_swin_t', img_size=small['img_size']), path)
    message = str(e.value)
    assert len(message.splitlines()) == 2 and 'keys missing' in message and '...' in message, message
    assert "embed_dim': 16" in message and "--model-kwargs" in message \
        and 'depths=(2,2,2,2)' in message, message
    call = re.search(r'build it with (models\.create_model\(.*\)), or train\.py', message).group(1)
    rebuilt = eval(call, {'models': models})  # as printed
    assert rebuilt.num_classes == 7 and rebuilt.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in rebuilt.state_dict().items())
    deit = models.create_model('inline_deit_t', **SMALL_SIZES['inline_deit_t'])
    torch.save(deit.state_dict(), tmp_path / 'deit.pth')
    with pytest.raises(RuntimeError, match="another variant's or another size's weights"):
        models.create_model('inline_swin_t', checkpoint=tmp_path / 'deit.pth', **small)


def test_create_model_builds_what_a_checkpoint_records_or_refuses_with_calls_that_run(tmp_path, capsys):
    """A train.py checkpoint, given its variant's name alone, builds the model it records: its sizes, image
    size and trained head. Another variant, other sizes or other classes are refused, naming what differs,
    and every call the refusal gives runs as printed: the file's model, or (other classes) a new head to
    fine-tune, announced. An authors' file records nothing: a head of other classes is refused the same
    way, never left random."""
    torch.manual_seed(0)
    small = dict(SMALL_SIZES['inline_deit_t'], num_classes=3)
    source = perturb(models.create_model('inline_deit_t', **small))
    path = tmp_path / 'best.pt'
    torch.save({'model': source.state_dict(), 'args': {'model': 'inline_deit_t'}, 'arch': source.arch,
                'classes': ['a', 'b', 'c']}, path)
    model = models.create_model('inline_deit_t', checkpoint=path)
    assert (model.num_classes, model.img_size, model.arch) == (3, (48, 80), source.arch)
    assert all(torch.equal(v, source.state_dict()[k]) for k, v in model.state_dict().items())
    authors = tmp_path / 'authors.pth'
    torch.save({'model': models.create_model('inline_deit_t', **SMALL_SIZES['inline_deit_t']).state_dict()}, authors)
    for name, overrides, differ, checkpoint in [
            ('inline_swin_t', {}, 'holds a inline_deit_t, not a inline_swin_t', path),
            ('inline_deit_t', {'embed_dim': 64}, 'built with embed_dim=32, not embed_dim=64', path),
            ('inline_deit_t', {'num_classes': 5}, 'built with num_classes=3, not num_classes=5', path),
            ('inline_deit_t', {**SMALL_SIZES['inline_deit_t'], 'num_classes': 5}, 'holds a head of 1000 classes, '
                                                                             'not 5', authors)]:
        with pytest.raises(ValueError, match=re.escape(differ)) as e:
            models.create_model(name, checkpoint=checkpoint, **overrides)
        calls = re.findall(r'models\.create_model\(.*?\)(?=;|$)', str(e.value))
        assert len(calls) == 1 + ('num_classes' in overrides), str(e.value)
        capsys.readouterr()
        built = [eval(call, {'models': models}) for call in calls]  # as printed
        if checkpoint == path:
            assert all(torch.equal(v, source.state_dict()[k]) for k, v in built[0].state_dict().items())
        if len(built) == 2:  # finetune=True: the file's head dropped, a new one of 5 classes, both said
            assert built[1].num_classes == 5
            assert [line.split(': ', 1)[1] for line in capsys.readouterr().out.splitlines()] == [
                f"dropped its head ({built[0].num_classes} classes x 32 features)",
                "a new head (5 classes x 32 features), initialised at random, to fine-tune"]


def test_a_file_that_is_not_a_checkpoint_says_so(tmp_path):
    """A text file, or a file of something else than tensors, is 'not a checkpoint', with its name."""
    text = tmp_path / 'notes.txt'
    text.write_text('epoch 1: 52%')
    with pytest.raises(ValueError, match=f"{text} is not a checkpoint: torch.load cannot read it"):
        models.create_model('inline_deit_t', checkpoint=text, **SMALL_SIZES['inline_deit_t'])
    torch.save([1, 2, 3], tmp_path / 'list.pt')
    with pytest.raises(ValueError, match="list.pt is not a checkpoint: it holds list"):
        models.create_model('inline_deit_t', checkpoint=tmp_path / 'list.pt', **SMALL_SIZES['inline_deit_t'])


@pytest.mark.parametrize('name', ['inline_deit_t', 'inline_pvt_t', 'inline_swin_t'])
def test_checkpoint_with_other_classes_and_size(name, tmp_path, capsys):
    """Fine-tuning (finetune=True) for another num_classes drops the head for a new one; another image
    size resizes position embeddings and relative position tables (bicubic); each change is said in a
    line, the tensor's name and its old and new grid; the rest loads unchanged."""
    torch.manual_seed(0)
    small = dict(SMALL_SIZES[name], num_classes=5)
    source = models.create_model(name, **small)
    path = tmp_path / 'project.pth'
    # train.py's format: its flags and its model's overrides, the image size among them
    torch.save({'model': source.state_dict(), 'args': {'model': name}, 'arch': source.arch,
                'epoch': 1}, path)
    H, W = small['img_size']  # twice the size: every grid the file records is resized
    bigger = dict(small, img_size=(2 * H, 2 * W), num_classes=7,
                  **({'softmax_window': 4} if name == 'inline_swin_t' else {}))
    capsys.readouterr()
    model = models.create_model(name, checkpoint=path, **bigger, finetune=True)
    said = capsys.readouterr().out.splitlines()
    assert said[:2] == [f"{path}: dropped its head (5 classes x {model.num_features} features)",
                        f"{path}: a new head (7 classes x {model.num_features} features), initialised "
                        f"at random, to fine-tune"]
    resized = []
    for k, v in model.state_dict().items():
        if not k.startswith('head.') and v.shape == source.state_dict()[k].shape:
            assert torch.equal(v, source.state_dict()[k]), k
        elif not k.startswith('head.'):
            resized.append(k)
    # one line each, 'resized NAME from its 12x20 grid to 24x40, bicubic' (tables: of offsets)
    lines = [re.fullmatch(rf"{re.escape(str(path))}: resized (\S+) from its (\d+)x(\d+) (grid|table of "
                          rf"offsets) to (\d+)x(\d+), bicubic(, the class token's vector kept)?", line)
             for line in said[2:]]
    assert all(lines) and sorted(m.group(1) for m in lines) == sorted(resized) and resized, said
    for m in lines:
        old, new = [int(g) for g in m.group(2, 3)], [int(g) for g in m.group(5, 6)]
        assert new == [2 * n for n in old] if m.group(4) == 'grid' else new[0] == new[1] > old[0]
    assert model(torch.randn(1, 3, 2 * H, 2 * W)).shape == (1, 7)
    with pytest.raises(ValueError, match=r'built with (\S+ )?num_classes=5, not (\S+ )?num_classes=7'):
        models.create_model(name, checkpoint=path, **bigger)  # a new head only to fine-tune
    if name == 'inline_deit_t':  # the class token's position embedding is kept, not resampled
        assert torch.equal(model.pos_embed[:, 0], source.pos_embed[:, 0])


def on_grid(tokens, grid):
    """(1, h*w, C) tokens, row-major on the (h, w) grid, laid out as a map (1, C, h, w) entry by
    entry: token y*w + x is the map's (y, x)."""
    h, w = grid
    return torch.stack([torch.stack([tokens[0, y * w + x] for x in range(w)], dim=-1)
                        for y in range(h)], dim=-2)[None]  # (1, C, h, w)


def bicubic(tokens, old, new):
    """The expected resize of tokens on grid `old` to `new`: F.interpolate of the explicit map, as
    timm resamples position embeddings (bicubic, align_corners=False, no antialiasing)."""
    out = F.interpolate(on_grid(tokens, old), size=new, mode='bicubic', align_corners=False,
                        antialias=False)  # (1, C, h', w')
    return out.flatten(2).transpose(1, 2)  # (1, h'*w', C), row-major


DEIT = dict(embed_dim=32, depth=1, num_heads=2)  # patch 16


def saved_deit(tmp_path, img_size, record=True):
    """A DeiT trained at img_size, saved as train.py saves it (record: its arch, the image size in
    it) or as a bare state dict (the authors' format)."""
    torch.manual_seed(0)
    source = models.create_model('inline_deit_t', img_size=img_size, **DEIT)
    path = tmp_path / 'deit.pth'
    record = {'args': {'model': 'inline_deit_t'}, 'arch': source.arch} if record else {}
    torch.save({'model': source.state_dict(), **record}, path)
    return source.pos_embed.detach(), path


def test_deit_position_embedding_is_resized_from_the_grid_the_checkpoint_records(tmp_path):
    """Trained at 144x256 px: a 9x16 grid of 144 vectors (a perfect square, which is not its shape).
    At 288x512 px it is the bicubic resize of the 9x16 grid to 18x32, the class token's vector kept;
    at 192x192 px, 12x12 of the same count, it is resized too, not taken as it is."""
    pos, path = saved_deit(tmp_path, (144, 256))
    for img_size, grid in (((288, 512), (18, 32)), ((192, 192), (12, 12))):
        model = models.create_model('inline_deit_t', img_size=img_size, checkpoint=path, **DEIT)
        torch.testing.assert_close(model.pos_embed[:, 1:], bicubic(pos[:, 1:], (9, 16), grid))
        assert torch.equal(model.pos_embed[:, :1], pos[:, :1])  # the class token's, off the grid
        model(torch.randn(1, 3, *img_size))
    # the top-right token of the 9x16 grid lands at the top right, not at column 11.5 of 12x12
    model = models.create_model('inline_deit_t', img_size=(288, 512), checkpoint=path, **DEIT)
    assert model.pos_embed[0, 1 + 31].sub(pos[0, 1 + 15]).norm() < model.pos_embed[0, 1 + 31].sub(
        pos[0, 1 + 11]).norm()


def test_a_grid_the_checkpoint_does_not_record_is_refused_naming_both(tmp_path):
    """A bare state dict records no image size: another count is refused, naming the grids the count
    could be and the model's; given the size it was trained at (train.py gives the variant's own),
    it resizes from that grid."""
    pos, path = saved_deit(tmp_path, (144, 256), record=False)
    model = models.create_model('inline_deit_t', img_size=(288, 512), **DEIT)
    with pytest.raises(RuntimeError, match=re.escape(
            "cannot tell the grid pos_embed's 144 position vectors were trained on (it could be "
            "6x24 or 8x18 or 9x16 or 12x12 or 16x9 or 18x8 or 24x6), so it cannot be resized to "
            "this model's 18x32 (288x512 px): the file records no image size")):
        models.load_checkpoint(model, path)
    with pytest.raises(RuntimeError, match=re.escape("records no image size, and the 224x224 px "
                                                     "given for it make 14x14")):
        models.load_checkpoint(model, path, img_size=224)  # a size given that does not fit
    models.load_checkpoint(model, path, img_size=(144, 256))
    torch.testing.assert_close(model.pos_embed[:, 1:], bicubic(pos[:, 1:], (9, 16), (18, 32)))
    # a file that records a size its vectors do not fit is refused, naming both grids
    state = torch.load(path, weights_only=True)
    torch.save(dict(state, arch={'img_size': (160, 256)}), path)
    with pytest.raises(RuntimeError, match=r"holds 144 position vectors, but the 160x256 px the "
                                           r"checkpoint records make a 10x16 grid of 160"):
        models.load_checkpoint(model, path)


def test_pvt_position_embeddings_are_resized_stage_by_stage(tmp_path):
    torch.manual_seed(0)
    small = SMALL_SIZES['inline_pvt_t']
    source = models.create_model('inline_pvt_t', **small)  # 64x96 px: stage grids 16x24 ... 2x3
    torch.save({'model': source.state_dict(), 'arch': source.arch}, tmp_path / 'pvt.pth')
    model = models.create_model('inline_pvt_t', checkpoint=tmp_path / 'pvt.pth',
                                **dict(small, img_size=(128, 160)))
    for i, (old, new) in enumerate([((16, 24), (32, 40)), ((8, 12), (16, 20)), ((4, 6), (8, 10)),
                                    ((2, 3), (4, 5))]):
        stored, loaded = (getattr(m, f'pos_embed{i + 1}') for m in (source, model))
        torch.testing.assert_close(loaded, bicubic(stored.detach(), old, new))


@pytest.mark.parametrize('residual', ['none', 'plain'])
def test_swin_ape_ablation_is_resized_at_twice_the_size(residual, tmp_path):
    """Swin's ablations without Eq. 6 carry the authors' APE, one vector per token of the stage
    (the InLine window covers it): fine-tuned at twice the size, each is the bicubic resize of its
    grid."""
    torch.manual_seed(0)
    small = dict(SMALL_SIZES['inline_swin_t'], eq6=residual, layout='IIIS')
    source = models.create_model('inline_swin_t', **small)  # 64x96 px: stage 1 is 16x24
    assert source.ape
    torch.save({'model': source.state_dict(), 'arch': source.arch}, tmp_path / 'swin.pth')
    model = models.create_model('inline_swin_t', checkpoint=tmp_path / 'swin.pth',
                                **dict(small, img_size=(128, 192)))
    apes = [k for k in source.state_dict() if k.endswith('.ape')]
    assert len(apes) == 6  # the I blocks of stages 1 to 3
    for k in apes:
        old = models.stage_grids((64, 96))[int(k.split('.')[1])]
        new = models.stage_grids((128, 192))[int(k.split('.')[1])]
        torch.testing.assert_close(model.state_dict()[k], bicubic(source.state_dict()[k], old, new))
    model(torch.randn(1, 3, 128, 192))


def test_swin_at_384_takes_the_released_window_and_resizes_its_tables(tmp_path):
    """At 384 px the softmax stage takes the authors' window 12 (inline_swin_b_384's); elsewhere
    Swin's 7 is kept. A 224 px checkpoint's 13x13 tables of offsets are resized to 23x23, each head
    apart, bicubic (timm's resize_rel_pos_bias_table)."""
    small = dict(embed_dim=16, depths=(1, 1, 1, 2), num_heads=(1, 1, 2, 2))
    last = {size: meta_model('inline_swin_t', img_size=size, **small).layers[3]
            for size in (224, 384, 448)}  # the softmax stage
    windows = {size: {block.window for block in stage.blocks} for size, stage in last.items()}
    assert windows == {224: {7}, 384: {12}, 448: {7}}
    torch.manual_seed(0)
    source = models.create_model('inline_swin_t', **small)
    torch.save({'model': source.state_dict(), 'arch': source.arch}, tmp_path / 'swin224.pth')
    model = models.create_model('inline_swin_t', img_size=384, checkpoint=tmp_path / 'swin224.pth',
                                **small)
    for j in range(2):
        k = f'layers.3.blocks.{j}.attn.relative_position_bias_table'
        stored, loaded = source.state_dict()[k], model.state_dict()[k]  # (13^2, H), (23^2, H)
        heads = stored.T.reshape(1, -1, 13, 13)  # (1, H, 13, 13): head h's offsets (dy, dx)
        expected = F.interpolate(heads, size=(23, 23), mode='bicubic', align_corners=False)
        torch.testing.assert_close(loaded, expected.reshape(-1, 23 * 23).T)


# ---------------------------------------------------------------------------------------------------
# Every family at a small size: forward, backward, other input sizes, errors

@pytest.mark.parametrize('name', TINY)
def test_forward_backward_non_square(name):
    torch.manual_seed(0)
    # no stochastic depth: at batch 2 it can drop a branch for both samples, zeroing its gradients
    model = models.create_model(name, num_classes=10, drop_path_rate=0., **SMALL_SIZES[name])
    x = torch.randn(2, 3, *model.img_size)  # non-square
    out = model(x)
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    out.backward(torch.randn_like(out))
    # DeiT's head reads only the class token, and Eq. 6 never touches it, so nothing of the last
    # block's residual MLP reaches the output: its gradient is zero by construction.
    exempt = 'blocks.1.attn.residual.' if name == 'inline_deit_t' else None
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
        assert (exempt and n.startswith(exempt)) or p.grad.abs().sum() > 0, n


@pytest.mark.parametrize('name', TINY[1:])
def test_hierarchical_stage_maps_and_other_input_size(name):
    torch.manual_seed(0)
    model = models.create_model(name, num_classes=3, **SMALL_SIZES[name]).eval()
    with torch.no_grad():
        stages = model.forward_features(torch.randn(1, 3, 64, 96), return_stages=True)
        config = SMALL_SIZES[name]
        dims = config.get('embed_dims') or [config['embed_dim'] * 2 ** i for i in range(4)]
        assert [tuple(s.shape[1:]) for s in stages] == [(dims[0], 16, 24), (dims[1], 8, 12), (dims[2], 4, 6),
                                                        (dims[3], 2, 3)]
        assert model(torch.randn(1, 3, 128, 64)).shape == (1, 3)  # a size the model was not built for


@pytest.mark.parametrize('name', TINY)
def test_bad_input_size_is_a_clear_error(name):
    torch.manual_seed(0)
    model = models.create_model(name, **SMALL_SIZES[name])
    stride = 16 if name == 'inline_deit_t' else 32
    with pytest.raises(ValueError, match=f"divisible by {stride}"):
        model(torch.randn(1, 3, 70, 100))
    with pytest.raises(ValueError, match=f"divisible by {stride}"):
        models.create_model(name, img_size=200)
    if name == 'inline_deit_t':
        with pytest.raises(ValueError, match=r"built for 48x80 images got 64x64: .* img_size=\(64, 64\)"):
            model(torch.randn(1, 3, 64, 64))


def test_unknown_name_and_bad_overrides():
    with pytest.raises(ValueError, match=r"unknown model 'inline_vit_t'; choose one of inline_deit_t, "
                                         r".*inline_cswin_b_384"):
        models.create_model('inline_vit_t')
    with pytest.raises(ValueError, match=r"layout 'IIX'"):
        meta_model('inline_swin_t', layout='IIX')
    with pytest.raises(ValueError, match=r"layout 'IIMS'"):
        meta_model('inline_swin_t', layout='IIMS')
    with pytest.raises(ValueError, match=r"layout 'IIMS7'"):  # stage 3 of Swin-T has 6 blocks
        meta_model('inline_swin_t', layout='IIMS7')
    with pytest.raises(ValueError, match="needs a non-negative feature map"):
        meta_model('inline_cswin_t', layout='LISS', feature_map='identity')


def test_layouts_and_ablation_switches():
    """'IIMS2' puts two InLine blocks before Swin-B's stage-3 softmax blocks; L is the linear baseline
    (phi relu); eq6='none' removes Eq. 6 everywhere (Table 4)."""
    assert models.parse_layout('IIMS2', [2, 2, 5, 2], 'ILSM')[2] == ['I', 'I', 'S', 'S', 'S']
    swin_b = meta_model('inline_swin_b')
    letters = [block.letter for block in swin_b.layers[2].blocks]
    assert letters == ['I', 'I'] + ['S'] * 16
    baseline = meta_model('inline_swin_t', layout='LLLS', eq6='none')
    attns = [m for m in baseline.modules() if isinstance(m, inline.InLineAttention)]
    assert len(attns) == 10 and all(type(a) is inline.LinearAttention and a.feature_map == 'relu'
                                    and a.residual is None for a in attns)
    cswin = meta_model('inline_cswin_t', feature_map='relu')
    branches = [m for m in cswin.modules() if isinstance(m, models.CSwinInLine)]
    assert len(branches) == 6 and all(b.feature_map == 'relu' and b.fast is None for b in branches)
    assert meta_model('inline_deit_t', layout='L').blocks[0].attn.attention == 'linear'


def test_model_api():
    torch.manual_seed(0)
    for name in TINY:
        model = models.create_model(name, **SMALL_SIZES[name])
        assert model.family == name.split('_')[1] and model.img_size == SMALL_SIZES[name]['img_size']
        model.reset_classifier(4)
        assert model.num_classes == 4 and model(torch.randn(1, 3, *model.img_size)).shape == (1, 4)
        assert model.no_weight_decay() <= {n for n, _ in model.named_parameters()}
    assert meta_model('inline_deit_t').no_weight_decay() == {'pos_embed', 'cls_token'}
    assert len(meta_model('inline_swin_t').no_weight_decay()) == 2  # the two S blocks' bias tables
    # PVT decays its position embeddings, as released
    assert meta_model('inline_pvt_t').no_weight_decay() == set()


def test_fast_switch_turns_on_every_inline_module():
    torch.manual_seed(0)
    model = models.create_model('inline_cswin_t', fast='compile', **dict(SMALL_SIZES['inline_cswin_t'], layout='IISS'))
    switches = [m.fast for m in model.modules() if isinstance(m, inline.InLineBase)]
    # the I blocks of stages 1, 2
    assert switches == ['compile'] * (1 + 2)


# ---------------------------------------------------------------------------------------------------
# Dense prediction: timm's features_only backbones, torchvision's detectors, the Semantic FPN head

DENSE_LAYOUTS = [('inline_pvt_t', {}), ('inline_pvt_t', dict(layout='SSSS', num_heads=(1, 2, 5, 8))),
                 ('inline_pvt_t', dict(layout='LLLL')), ('inline_swin_t', {}),
                 ('inline_swin_t', dict(layout='SSSS')), ('inline_swin_t', dict(layout='LLLS')),
                 ('inline_swin_b', {}), ('inline_cswin_t', {}),
                 ('inline_cswin_t', dict(layout='SSSS', depths=(1, 2, 21, 1)))]


@pytest.mark.parametrize('name,overrides', DENSE_LAYOUTS,
                         ids=[f"{n}-{o.get('layout', 'released')}" for n, o in DENSE_LAYOUTS])
def test_features_only_at_coco_size_every_family_and_layout(name, overrides):
    """On the meta device: 800x1333 (padded to 800x1344) gives the four maps at strides 4-32 with the
    channels feature_info states, a LayerNorm on each where the family's own dense backbone has one."""
    with torch.device('meta'):
        model = dense.create_backbone(name, **overrides)
        maps = model(torch.zeros(1, 3, 800, 1333))
        subset = dense.create_backbone(name, out_indices=(1, 2, 3), **overrides)
    channels = model.feature_info.channels()
    assert model.feature_info.reduction() == [4, 8, 16, 32] and subset.feature_info.channels() == channels[1:]
    assert [tuple(m.shape) for m in maps] == [(1, c, 800 // r, 1344 // r)
                                              for c, r in zip(channels, (4, 8, 16, 32))]
    norm = nn.Identity if name.startswith('inline_pvt') else nn.LayerNorm
    assert all(type(n) is norm for n in model.norms)
    assert not any(k.startswith('model.head.') or k.startswith('model.norm.') for k in model.state_dict())


def test_features_only_refuses_deit_and_bad_out_indices():
    with torch.device('meta'):
        with pytest.raises(ValueError, match='isotropic .* pvt, swin, cswin'):
            dense.create_backbone('inline_deit_t')
        with pytest.raises(ValueError, match='out_indices'):
            dense.create_backbone('inline_pvt_t', out_indices=(2, 1))
    with pytest.raises(ValueError, match=r"features_only is dense\.create_backbone"):
        meta_model('inline_pvt_t', features_only=True)


@pytest.mark.parametrize('name', TINY[1:])
def test_features_only_at_another_size_equals_a_model_built_for_it(name):
    """Built at one size and fed another (96x64), a backbone gives the maps of the same weights built for
    that size: PVT's position embeddings resized bilinearly, as its forward resizes them."""
    torch.manual_seed(0)
    built = dense.create_backbone(name, drop_path_rate=0., **SMALL_SIZES[name]).eval()
    sized = dense.create_backbone(name, drop_path_rate=0.,
                                **{**SMALL_SIZES[name], 'img_size': (96, 64)})
    state = built.state_dict()
    for i, key in enumerate(k for k in state if re.fullmatch(r'model\.pos_embed\d', k)):
        state[key] = models.resize_grid(state[key], built.model.grids[i], sized.model.grids[i], 'bilinear')
    sized.load_state_dict(state)
    x = torch.randn(2, 3, 96, 64)
    with torch.no_grad():
        for a, b in zip(built(x), sized.eval()(x)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_features_only_loads_a_checkpoint_and_drops_the_head(tmp_path):
    torch.manual_seed(0)
    full = models.create_model('inline_pvt_t', **SMALL_SIZES['inline_pvt_t']).eval()
    torch.save({'model': full.state_dict()}, tmp_path / 'pvt.pth')
    backbone = dense.create_backbone('inline_pvt_t', checkpoint=str(tmp_path / 'pvt.pth'),
                                   **SMALL_SIZES['inline_pvt_t']).eval()
    assert not any('head' in k for k in backbone.state_dict())
    x = torch.randn(1, 3, 64, 96)
    with torch.no_grad():
        for a, b in zip(backbone(x), full.forward_features(x, return_stages=True)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # PVT's detection backbone has no output norms


def readme_block(heading):
    """The first ```python block under a README heading."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'README.md')) as f:
        section = f.read().split(f'\n{heading}\n', 1)[1]
    return section.split('```python\n', 1)[1].split('\n```', 1)[0]


def docstring_example(module):
    """The indented code block of a module's docstring that follows a line ending in 'as written):'."""
    lines = module.__doc__.split('as written):\n', 1)[1].splitlines()
    block = list(itertools.takewhile(lambda line: not line or line.startswith('    '), lines))
    return textwrap.dedent('\n'.join(block)).strip('\n') + '\n'


def test_detection_example_trains_mask_rcnn_with_inline_swin_t(monkeypatch, capsys):
    """dense.py's example, run as written: Mask R-CNN with the real InLine-Swin-T takes a training step on
    two images of different sizes (finite losses, gradients in the backbone's attention), predicts on an
    image file, and the Semantic FPN example gives logits at the image's size."""
    torch.manual_seed(0)
    monkeypatch.chdir(os.path.dirname(os.path.abspath(__file__)))
    scope = {}
    exec(docstring_example(dense), scope)
    losses, model = scope['losses'], scope['model']
    assert set(losses) == {'loss_classifier', 'loss_box_reg', 'loss_mask', 'loss_objectness',
                           'loss_rpn_box_reg'}
    assert all(torch.isfinite(v) for v in losses.values())
    attention = [p for n, p in model.backbone.named_parameters() if '.attn.' in n]
    assert attention and all(p.grad is not None for p in attention)
    # Every InLine stage's attention learns: its qkv and Eq. 6's residual MLP. (Drop path, on as in training,
    # can skip all of a stage's attention for both images: stage 4's two softmax blocks, with this seed.)
    for stage in model.backbone.body.model.layers[:3]:
        assert sum(b.attn.qkv.weight.grad.abs().sum() for b in stage.blocks) > 0
        assert sum(p.grad.abs().sum() for b in stage.blocks for p in b.attn.residual.parameters()) > 0
    image = scope['image']  # masks come back in the image file's own pixels
    assert scope['prediction']['masks'].shape[1:] == (1, *image.shape[1:]) and 'boxes' in scope['prediction']
    assert scope['logits'].shape == (2, 150, 96, 128) and torch.isfinite(scope['loss'])
    # untrained scores are near 1/91: keep every box to see boxes and masks
    model.roi_heads.score_thresh = 0.0
    model.roi_heads.detections_per_img = 5  # of 100: the mask head's cost is per box
    with torch.no_grad():
        out = model(scope['images'])
    for o, image in zip(out, scope['images']):
        assert len(o['boxes']) > 0 and o['masks'].shape == (len(o['boxes']), 1, *image.shape[1:])


def test_semantic_fpn_trains_with_inline_pvt_t():
    """Semantic FPN on the real InLine-PVT-T: a training step (finite loss, gradients in the attention of
    every stage), then eval logits at the input's size for two sizes, one not a multiple of 32."""
    torch.manual_seed(0)
    model = dense.SemanticFPN(dense.create_backbone('inline_pvt_t'), num_classes=5)
    x, y = torch.rand(2, 3, 64, 96), torch.randint(0, 5, (2, 64, 96))
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    assert torch.isfinite(loss)
    for i in range(1, 5):
        attn = getattr(model.backbone.model, f'block{i}')[0].attn
        assert attn.q.weight.grad.abs().sum() > 0 and attn.kv.weight.grad.abs().sum() > 0
    model.eval()
    with torch.no_grad():
        assert model(torch.rand(1, 3, 70, 100)).shape == (1, 5, 70, 100)
        assert model(torch.rand(2, 3, 32, 64)).shape == (2, 5, 32, 64)


def test_faster_rcnn_and_retinanet_take_the_adapter():
    """FasterRCNN with the default adapter (four levels and 'pool'); RetinaNet as torchvision builds it,
    stages 2-4 and P6, P7: five levels for its five anchor sizes. A training step and a prediction each."""
    from torchvision.models.detection import FasterRCNN, RetinaNet
    from torchvision.ops.feature_pyramid_network import LastLevelP6P7
    torch.manual_seed(0)
    small = dict(SMALL_SIZES['inline_pvt_t'], layout='IIII')
    images = [torch.rand(3, 64, 96), torch.rand(3, 80, 64)]
    targets = [dict(boxes=torch.tensor([[8., 8., 40., 50.]]), labels=torch.tensor([1]))] * 2
    retina_backbone = dense.create_backbone('inline_pvt_t', out_indices=(1, 2, 3), **small)
    size = dict(min_size=64, max_size=96)  # small images and few boxes: seconds on a CPU
    faster = FasterRCNN(dense.BackboneWithFPN(dense.create_backbone('inline_pvt_t', **small),
                                              out_channels=32), num_classes=3, rpn_post_nms_top_n_train=50,
                        rpn_post_nms_top_n_test=50, box_batch_size_per_image=32, box_detections_per_img=10,
                        **size)
    retina = RetinaNet(dense.BackboneWithFPN(retina_backbone, out_channels=32,
                                             extra_blocks=LastLevelP6P7(32, 32)),
                       num_classes=3, topk_candidates=50, detections_per_img=10, **size)
    for model in (faster, retina):
        losses = model(images, targets)
        assert all(torch.isfinite(v) for v in losses.values())
        sum(losses.values()).backward()
        assert model.backbone.body.model.block1[0].attn.q.weight.grad.abs().sum() > 0  # stage 1 feeds stage 2
        with torch.no_grad():
            assert all('boxes' in o for o in model.eval()(images))


# ---------------------------------------------------------------------------------------------------
# The paper's experiments (paper/experiments.py): each switch against an explicit construction

def test_shifted_inline_windows_equal_an_explicit_loop():
    """Table 4's windows, as the authors' code has them: odd blocks roll by window/2 with no mask, so tokens
    wrapped across the border share a window; each window is its own InLine attention with its own means and
    Eq. 6 weights."""
    torch.manual_seed(0)
    B, (h, w), C, window, shift = 2, (8, 8), 16, 4, 2
    block = perturb(models.SwinBlock(C, 2, 'I', window, True, 2., 0., DEFAULTS).double())
    attn = block.attn
    x = torch.randn(B, h * w, C, dtype=torch.float64)
    rolled = torch.roll(block.norm1(x).view(B, h, w, C), (-shift, -shift), dims=(1, 2))
    expected = torch.zeros_like(rolled)
    for i in range(0, h, window):
        for j in range(0, w, window):
            y = rolled[:, i:i + window, j:j + window].reshape(B, window * window, C)  # one window, row-major
            q, k, v = (t.view(B, -1, 2, C // 2).transpose(1, 2) for t in attn.qkv(y).chunk(3, dim=-1))
            r = inline.residual_weights(attn.residual, y.mean(1))  # this window's own Eq. 6 weights
            o = inline.inline_core(q, k, v, r, (window, window)).transpose(1, 2).reshape(B, -1, C)
            expected[:, i:i + window, j:j + window] = attn.proj(o).view(B, window, window, C)
    expected = x + torch.roll(expected, (shift, shift), dims=(1, 2)).reshape(B, h * w, C)
    expected = expected + block.mlp(block.norm2(expected))
    torch.testing.assert_close(block(x, (h, w)), expected, rtol=0, atol=1e-12)
    # wrapped: token (0, 0) and token (7, 7) share a window in the shifted block, not in the unshifted one
    x2 = x.clone()
    # not a constant, which the LayerNorm would remove
    x2[:, 7 * w + 7] += torch.randn(C, dtype=torch.float64)
    assert (block(x2, (h, w)) - block(x, (h, w)))[:, 0].abs().max() > 1e-6
    block.shift = False
    assert (block(x2, (h, w)) - block(x, (h, w)))[:, 0].abs().max() == 0


def test_nonneg_inline_weights_are_non_negative_and_rows_sum_to_one():
    torch.manual_seed(0)
    attn = perturb(inline.InLineAttention(32, 2, nonneg=True, leading_tokens=1).double())
    x = 5 * torch.randn(3, 1 + 36, 32, dtype=torch.float64)  # large inputs: plain InLine goes negative here
    w = attn.weights(x, (6, 6))
    assert w.shape == (3, 2, 37, 37) and w.min() >= 0
    torch.testing.assert_close(w.sum(-1), torch.ones(3, 2, 37, dtype=torch.float64), rtol=0, atol=1e-12)
    plain = perturb(inline.InLineAttention(32, 2, leading_tokens=1).double())
    assert plain.weights(x, (6, 6)).min() < 0  # without the switch the same inputs give negative weights


def test_normalised_q_in_swin_gives_q_and_2q_the_same_weights():
    """T1 in Swin: with normalise_q='S' (windowed softmax) or 'I' (InLine), doubling q in those blocks leaves
    the logits as they were; without it they change. The fast core follows InLine's option (enable_fast checks
    it)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 64)
    for letters, layout, kind in (('S', 'SSSS', models.WindowAttention), ('I', 'IIIS', inline.InLineBase),
                                  ('', 'IIIS', inline.InLineBase)):
        model = models.create_model('inline_swin_t', img_size=64, embed_dim=16, depths=(1, 1, 1, 1),
                                    num_heads=(2, 2, 2, 2), softmax_window=4, layout=layout, num_classes=3,
                                    normalise_q=letters).eval()
        if kind is inline.InLineBase:
            assert kernels.enable_fast(model, log=None) == 3
        attns = [m for m in model.modules() if isinstance(m, kind)]
        assert len(attns) == len(layout.replace('S' if kind is inline.InLineBase else 'I', ''))
        assert all((getattr(m, 'normalise_q', None) is not None) == bool(letters) for m in attns)
        with torch.no_grad():
            before = model(x)
            for m in attns:  # q is the first third of qkv's outputs
                m.qkv.weight[:m.qkv.out_features // 3] *= 2
                m.qkv.bias[:m.qkv.out_features // 3] *= 2
            after = model(x)
        assert torch.allclose(before, after, rtol=0, atol=1e-5) == bool(letters), letters


def test_normalised_q_softmax_is_not_injective():
    """T1: softmax over L2-normalised queries gives q and 2q identical weights; plain softmax does not."""
    torch.manual_seed(0)
    x = torch.randn(2, 10, 24, dtype=torch.float64)
    for normalise_q, same in ((True, True), (False, False)):
        attn = models.SoftmaxAttention(24, 3, normalise_q=normalise_q, leading_tokens=1).double()
        nn.init.zeros_(attn.qkv.bias)
        w, w2 = attn.weights(x, (3, 3)), None
        with torch.no_grad():
            attn.qkv.weight[:24] *= 2  # q -> 2q, k and v unchanged
        w2 = attn.weights(x, (3, 3))
        assert torch.allclose(w, w2, rtol=0, atol=1e-12) == same
        # the forward applies the same weights
        q, k, v = attn.project(x, (3, 3))
        o = (w2 @ v).transpose(1, 2).reshape(2, 10, 24)
        torch.testing.assert_close(attn(x, (3, 3)), attn.proj(o), rtol=0, atol=1e-12)


def test_relu_affine_starts_as_relu_and_trains():
    torch.manual_seed(0)
    attn = inline.InLineAttention(16, 2, feature_map='relu_affine')
    x = torch.randn(2, 9, 16)
    q = torch.randn(2, 2, 9, 8)
    torch.testing.assert_close(attn.phi(q), torch.relu(q), rtol=0, atol=0)
    optimizer = torch.optim.SGD(attn.parameters(), lr=0.1)
    out = attn(x, (3, 3))
    out.backward(torch.randn_like(out))
    assert attn.phi.weight.grad.abs().sum() > 0 and attn.phi.bias.grad.abs().sum() > 0
    optimizer.step()
    assert not torch.equal(attn.phi.weight, torch.eye(8)) and attn.phi.bias.abs().sum() > 0
    # A starts at the identity: not decayed to zero
    assert models.InLineDeiT(img_size=32, embed_dim=16, depth=1, num_heads=2,
                             feature_map='relu_affine').no_weight_decay() \
        == {'pos_embed', 'cls_token', 'blocks.0.attn.phi.weight'}


def test_ape_per_stage_and_window_reaches_qkv_not_the_shortcut():
    swin = meta_model('inline_swin_t', window=7, eq6='none')
    for i, layer in enumerate(swin.layers):
        for block in layer.blocks:
            if block.letter == 'I':
                assert block.attn.ape.shape == (1, 49, 96 * 2 ** i)  # 7x7 windows in every stage
    assert meta_model('inline_swin_t', eq6='none').layers[0].blocks[0].attn.ape.shape == (1, 56 * 56, 96)
    assert meta_model('inline_swin_t').layers[0].blocks[0].attn.ape is None  # the released models: none
    assert meta_model('inline_swin_t', ape=False, eq6='none').layers[0].blocks[0].attn.ape is None
    torch.manual_seed(0)
    block = perturb(models.SwinBlock(16, 2, 'I', None, False, 2., 0., dict(DEFAULTS, eq6='none'),
                                     ape_tokens=16).double())
    x = torch.randn(2, 16, 16, dtype=torch.float64)
    seen = []
    block.attn.qkv.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    out = block(x, (4, 4))
    torch.testing.assert_close(seen[0], block.norm1(x) + block.attn.ape)  # the APE reaches q, k and v
    with torch.no_grad():
        block.attn.proj.weight.zero_(), block.attn.proj.bias.zero_()  # the attention branch now adds nothing
        block.attn.ape.add_(1.0)
    without_attention = block(x, (4, 4))
    with torch.no_grad():
        block.attn.ape.zero_()
    # the shortcut never sees it
    torch.testing.assert_close(block(x, (4, 4)), without_attention, rtol=0, atol=0)
    assert not torch.allclose(out, without_attention)


def test_softmax_originals_have_the_known_sizes():
    """Layout all-S gives each backbone's softmax original: Swin-T 28,288,354 parameters (timm's); the DeiT
    skeleton with softmax is InLine-DeiT without its residual MLPs; PVT S adds the spatial reductions."""
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(meta_model('inline_swin_t', layout='SSSS')) == 28_288_354
    deit = meta_model('inline_deit_t')
    residual = sum(p.numel() for n, p in deit.named_parameters() if '.residual.' in n)
    assert count(meta_model('inline_deit_t', layout='S')) == count(deit) - residual
    assert count(meta_model('inline_deit_t', **dict(layout='S', num_heads=3))) == 5_717_416  # DeiT-T's
    pvt = meta_model('inline_pvt_t', layout='SSSS', num_heads=(1, 2, 5, 8))
    sr = [b.attn.sr.kernel_size[0] for i in range(1, 4) for b in getattr(pvt, f'block{i}')]
    assert sr == [8, 8, 4, 4, 2, 2] and not hasattr(pvt.block4[0].attn, 'sr')


def test_fast_path_refuses_what_it_does_not_cover_when_the_model_is_built():
    """Vanilla linear attention has no fast core: create_model(fast='compile') refuses it, naming the option,
    before any forward; every InLine option builds fast."""
    with pytest.raises(ValueError, match=r"layers\.0\.blocks\.0\.attn \(LinearAttention, attention='linear': "
                                         r"vanilla linear attention\): inline\.linear_core has no fast twin "
                                         r"'compile'.*Build the model with fast=None \(train\.py: --fast none\)"):
        meta_model('inline_swin_t', layout='LISS', fast='compile')
    with pytest.raises(ValueError, match=r"\(CSwinInLine, attention='linear': vanilla linear attention\)"):
        meta_model('inline_cswin_t', layout='LISS', fast='compile')
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        model = meta_model('inline_swin_t', window=7, eq6='plain', nonneg=True, feature_map='relu_affine',
                           fast='compile')
        assert all(m.fast == 'compile' for m in model.modules() if isinstance(m, inline.InLineBase))
        meta_model('inline_swin_t', local_size=7, dilation=2, fast='compile')
