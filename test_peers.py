"""peers.py against explicit slow formulas (float64), the authors' parameter names and shapes, and gradients;
the peers' models in models.py: the authors' counts, keys and MACs, their outputs against FLatten's own code
(golden/golden_peers.pt), the fast path's refusal, a training step.

    python -m pytest -q test_peers.py
"""
import gzip
import math
import os
import re

import pytest
import torch
import torch.nn.functional as F

import inline
import models
import peers
from conftest import GOLDEN

f64 = dict(dtype=torch.float64)


def slow_focusing(x, p):
    """f_p(x) = (x^p / |x^p|) |x|, one token and one channel at a time."""
    out = torch.empty_like(x)
    for index in torch.cartesian_prod(*(torch.arange(s) for s in x.shape[:-1])).reshape(-1, x.dim() - 1):
        token = x[tuple(index)]
        length = math.sqrt(sum(float(c) ** 2 for c in token))
        length_p = math.sqrt(sum(float(c) ** (2 * p) for c in token))
        out[tuple(index)] = torch.tensor([float(c) ** p / length_p * length for c in token], **f64)
    return out


def slow_focused_function(x, scale, p):
    """relu(x) + 1e-6, divided by log(1 + exp(scale)) channel by channel, then slow_focusing."""
    x = torch.where(x > 0, x, torch.zeros_like(x)) + 1e-6
    return slow_focusing(x / torch.log(1 + torch.exp(scale)), p)


def slow_depthwise(v, grid, weight, bias):
    """A k x k depthwise convolution of v (B, H, N, D) on grid, written as the sum over the neighbours:
    token (y, x), channel d gets bias_d + sum_{a, b} weight[d, 0, a, b] v(y + a - k//2, x + b - k//2),
    zero outside the grid."""
    B, H, N, D = v.shape
    h, w = grid
    r = weight.shape[-1] // 2
    planes = v.reshape(B, H, h, w, D)
    out = bias.expand(B, H, h, w, D).clone()
    for y in range(h):
        for x in range(w):
            for a in range(-r, r + 1):
                for b in range(-r, r + 1):
                    if 0 <= y + a < h and 0 <= x + b < w:
                        out[:, :, y, x] += weight[:, 0, a + r, b + r] * planes[:, :, y + a, x + b]
    return out.reshape(B, H, N, D)


def randomise(module):
    """Every parameter random (the zero-initialised scale and positional_encoding too), so each one counts."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return module


@pytest.mark.parametrize('p', [2, 3])
def test_focusing_equals_slow_form_and_keeps_the_norm(p):
    torch.manual_seed(0)
    x = torch.rand(2, 5, 12, **f64) + 0.01
    torch.testing.assert_close(peers.focusing(x, p), slow_focusing(x, p))
    torch.testing.assert_close(peers.focusing(x, p).norm(dim=-1), x.norm(dim=-1))


def test_focused_function_equals_slow_form():
    torch.manual_seed(0)
    x, scale = torch.randn(2, 6, 12, **f64), torch.randn(1, 1, 12, **f64)
    torch.testing.assert_close(peers.focused_function(x, scale, 3), slow_focused_function(x, scale, 3))


@pytest.mark.parametrize('N,n', [(49, 49), (20, 5)], ids=['N49', 'N20-n5'])
def test_fp16_safe_form_is_the_division(N, n):
    """The authors' form (the means and n^-1/2) is the same number as q_i K^T V / (q_i . sum_t k_t + n eps),
    the explicit weights times v, and inline.linear_attention with eps n * 1e-6."""
    torch.manual_seed(0)
    q, k, v = torch.rand(2, 3, N, 8, **f64), torch.rand(2, 3, n, 8, **f64), torch.randn(2, 3, n, 8, **f64)
    safe = peers.focused_linear_attention(q, k, v)
    plain = (q @ (k.transpose(-2, -1) @ v)) / (q @ k.sum(2, keepdim=True).transpose(-2, -1) + n * 1e-6)
    torch.testing.assert_close(safe, plain)
    torch.testing.assert_close(safe, peers.focused_linear_weights(q, k) @ v)
    torch.testing.assert_close(safe, inline.linear_attention(q, k, v, eps=n * 1e-6))
    torch.testing.assert_close(peers.focused_linear_weights(q, k, eps=0).sum(-1), torch.ones(2, 3, N, **f64))


LAYOUTS = {  # id: (FocusedLinearAttention's layout arguments, grid)
    'swin-5x4': (dict(separate_q=False), (5, 4)),
    'pvt-4x6': (dict(separate_q=True), (4, 6)),
    'pvt-sr2-4x6': (dict(separate_q=True, sr_ratio=2), (4, 6)),
    'swin-5x4-subtraction': (dict(separate_q=False, normalisation='subtraction'), (5, 4)),
}


def explicit_flatten_weights(m, x, grid):
    """FLatten's weights built literally, entry by entry: projections, k + positional_encoding, the
    slow focused function, the N x n weights of the division (or of Eq. 5) per head. Returns them (B, H, N, n)
    and v (B, H, n, D)."""
    B, N, C = x.shape
    H = m.num_heads
    if hasattr(m, 'qkv'):
        q, k, v = F.linear(x, m.qkv.weight, m.qkv.bias).split(C, dim=-1)
    else:
        kv_input = x
        if m.sr_ratio > 1:
            planes = x.transpose(1, 2).reshape(B, C, *grid)
            planes = F.conv2d(planes, m.sr.weight, m.sr.bias, stride=m.sr_ratio)
            kv_input = F.layer_norm(planes.flatten(2).transpose(1, 2), (C,), m.norm.weight, m.norm.bias)
        q = F.linear(x, m.q.weight, m.q.bias)
        k, v = F.linear(kv_input, m.kv.weight, m.kv.bias).split(C, dim=-1)
    n = k.shape[1]
    q, k = slow_focused_function(q, m.scale, 3), slow_focused_function(k + m.positional_encoding, m.scale, 3)
    q, k, v = (t.reshape(B, -1, H, C // H).transpose(1, 2) for t in (q, k, v))  # (B, H, ., D)
    weights = torch.zeros(B, H, N, n, **f64)
    k_mean = k.mean(2)  # (B, H, D)
    for i in range(N):
        scores = torch.stack([(q[:, :, i] * k[:, :, j]).sum(-1) for j in range(n)], dim=-1)  # (B, H, n)
        if m.normalisation == 'division':
            weights[:, :, i] = scores / (scores.sum(-1, keepdim=True) + n * 1e-6)
        else:  # Eq. 5 with the released s/N: s/N (q_i.k_j - q_i.k_mean) + 1/N
            centred = scores - (q[:, :, i] * k_mean).sum(-1, keepdim=True)
            weights[:, :, i] = (C // H) ** -0.5 / n * centred + 1 / n
    return weights, v


def explicit_flatten(m, x, grid):
    """FLatten's attention built literally: the explicit weights times v, the slow dwc on v
    (resampled to N tokens with reduction), proj."""
    B, N, C = x.shape
    H = m.num_heads
    weights, v = explicit_flatten_weights(m, x, grid)
    o = weights @ v  # (B, H, N, D)
    n = v.shape[2]
    if n != N:
        v = F.interpolate(v.transpose(-2, -1).reshape(B * H, -1, n), size=N, mode='linear')
        v = v.reshape(B, H, -1, N).transpose(-2, -1)
    o = o + slow_depthwise(v, grid, m.dwc.weight, m.dwc.bias)
    return F.linear(o.transpose(1, 2).reshape(B, N, C), m.proj.weight, m.proj.bias)


@pytest.mark.parametrize('layout', LAYOUTS)
def test_flatten_attention_equals_explicit_form(layout):
    """The module's output, and its weights() (the matrix the lab draws), against the explicit form;
    every parameter random, so a weights() that left out the positional encoding would differ."""
    options, grid = LAYOUTS[layout]
    N = grid[0] * grid[1]
    m = randomise(peers.FocusedLinearAttention(12, 3, N, **options).double())
    assert m.positional_encoding.abs().min() > 0
    x = torch.randn(2, N, 12, **f64)
    with torch.no_grad():  # the slow forms read numbers one by one
        torch.testing.assert_close(m(x, grid), explicit_flatten(m, x, grid))
        weights = m.weights(x, grid)
        torch.testing.assert_close(weights, explicit_flatten_weights(m, x, grid)[0])
    B, H, n = 2, 3, N // options.get('sr_ratio', 1) ** 2
    assert weights.shape == (B, H, N, n)
    if options.get('normalisation') == 'subtraction':  # Eq. 5's rows sum to 1 exactly, and go negative
        torch.testing.assert_close(weights.sum(-1), torch.ones(B, H, N, **f64))


# The authors' parameters of one FocusedLinearAttention, read from their __init__ (models/flatten_swin.py,
# models/flatten_pvt.py): the truth the checkpoints hold
AUTHORS_SWIN_96_3_WINDOW56 = {  # FLatten-Swin-T stage 1: dim 96, 3 heads, window 56 (3136 tokens)
    'qkv.weight': (288, 96), 'qkv.bias': (288,), 'proj.weight': (96, 96), 'proj.bias': (96,),
    'dwc.weight': (32, 1, 5, 5), 'dwc.bias': (32,), 'scale': (1, 1, 96), 'positional_encoding': (1, 3136, 96),
}
AUTHORS_PVT_64_1_SR1 = {  # FLatten-PVT-T stage 1: dim 64, 1 head, 3136 patches, la_sr_ratio 1
    'q.weight': (64, 64), 'q.bias': (64,), 'kv.weight': (128, 64), 'kv.bias': (128,), 'proj.weight': (64, 64),
    'proj.bias': (64,), 'dwc.weight': (64, 1, 5, 5), 'dwc.bias': (64,), 'scale': (1, 1, 64),
    'positional_encoding': (1, 3136, 64),
}
AUTHORS_PVT_64_1_SR8 = {  # the same with sr_ratio 8 (their code allows it; no released model uses it)
    **AUTHORS_PVT_64_1_SR1, 'sr.weight': (64, 64, 8, 8), 'sr.bias': (64,), 'norm.weight': (64,),
    'norm.bias': (64,), 'positional_encoding': (1, 49, 64),
}


@pytest.mark.parametrize('module,truth', [
    (lambda: peers.FocusedLinearAttention(96, 3, 56 * 56), AUTHORS_SWIN_96_3_WINDOW56),
    (lambda: peers.FocusedLinearAttention(64, 1, 56 * 56, separate_q=True), AUTHORS_PVT_64_1_SR1),
    (lambda: peers.FocusedLinearAttention(64, 1, 56 * 56, separate_q=True, sr_ratio=8), AUTHORS_PVT_64_1_SR8),
], ids=['swin', 'pvt', 'pvt-sr8'])
def test_flatten_parameters_are_the_authors(module, truth):
    m = module()
    assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == truth
    assert not m.scale.any() and not m.positional_encoding.any()  # zeros at init, as theirs


def count(m):
    return sum(p.numel() for p in m.parameters())


def test_parameter_counts_of_single_attentions():
    # qkv 3C^2 + 3C, proj C^2 + C, dwc D*25 + D, scale C, positional_encoding N*C
    assert count(peers.FocusedLinearAttention(96, 3, 3136)) == 27_936 + 9_312 + 832 + 96 + 301_056 == 339_232
    assert count(peers.FocusedLinearAttention(192, 6, 784)) == (
        111_168 + 37_056 + 832 + 192 + 150_528) == 299_776
    # PVT-T stage 1: q C^2 + C, kv 2C^2 + 2C, proj, dwc (D = 64), scale, positional_encoding
    assert count(peers.FocusedLinearAttention(64, 1, 3136, separate_q=True)) == (
        4_160 + 8_320 + 4_160 + 1_664 + 64 + 200_704) == 219_072
    # NormAttention: qkv and proj, and LayerNorm's 2C or SimpleRMSNorm's nothing
    assert count(peers.NormAttention(384, 12)) == 443_520 + 147_840 == 591_360
    assert count(peers.NormAttention(384, 12, norm='layernorm')) == 591_360 + 768


def explicit_norm_attention(m, x, norm):
    """NormAttention built literally: phi = 1 + elu on each head's q and k, the unnormalised N x N products
    phi(q_i).phi(k_j) times v, the heads concatenated, the norm over all C, proj."""
    B, N, C = x.shape
    H = m.num_heads
    q, k, v = (t.reshape(B, N, H, C // H).transpose(1, 2)
               for t in F.linear(x, m.qkv.weight, m.qkv.bias).split(C, dim=-1))
    phi = lambda t: torch.where(t > 0, t + 1, torch.exp(t))  # noqa: E731  1 + elu
    o = (phi(q) @ phi(k).transpose(-2, -1)) @ v  # (B, H, N, D), no denominator
    o = o.transpose(1, 2).reshape(B, N, C)
    if norm == 'srmsnorm':
        o = o / torch.sqrt((o ** 2).mean(-1, keepdim=True) + 1e-6)
    else:
        mean, var = o.mean(-1, keepdim=True), o.var(-1, unbiased=False, keepdim=True)
        o = (o - mean) / torch.sqrt(var + 1e-5) * m.norm.weight + m.norm.bias
    return F.linear(o, m.proj.weight, m.proj.bias)


@pytest.mark.parametrize('norm', peers.NORMS)
def test_norm_attention_equals_explicit_form(norm):
    m = randomise(peers.NormAttention(12, 3, norm=norm).double())
    x = torch.randn(2, 20, 12, **f64)
    torch.testing.assert_close(m(x, (4, 5)), explicit_norm_attention(m, x, norm))
    torch.testing.assert_close(peers.norm_linear_attention(*m.project(x)), m.weights(x) @ m.project(x)[2])


MODULES = {
    'flatten-swin': (lambda: peers.FocusedLinearAttention(12, 3, 20), (5, 4)),
    'flatten-pvt-sr2': (lambda: peers.FocusedLinearAttention(12, 3, 24, separate_q=True, sr_ratio=2), (4, 6)),
    'norm-srmsnorm': (lambda: peers.NormAttention(12, 3), (5, 4)),
    'norm-layernorm-pvt': (lambda: peers.NormAttention(12, 3, norm='layernorm', separate_q=True), (5, 4)),
}


@pytest.mark.parametrize('name', MODULES)
def test_backward_reaches_every_parameter(name):
    build, grid = MODULES[name]
    m = randomise(build())
    torch.manual_seed(0)
    x = torch.randn(2, grid[0] * grid[1], 12, requires_grad=True)
    out = m(x, grid)
    assert out.shape == x.shape and torch.isfinite(out).all()
    out.backward(torch.randn_like(out))
    for key, p in [('x', x), *m.named_parameters()]:
        assert p.grad is not None and p.grad.abs().sum() > 0, key


def test_wrong_sizes_and_options_are_refused():
    with pytest.raises(ValueError, match='positional_encoding covers 20 keys'):
        peers.FocusedLinearAttention(12, 3, 20)(torch.randn(1, 16, 12), (4, 4))
    with pytest.raises(ValueError, match="PVT's layout"):
        peers.FocusedLinearAttention(12, 3, 16, sr_ratio=2)
    with pytest.raises(ValueError, match='grid'):
        peers.FocusedLinearAttention(12, 3, 20)(torch.randn(1, 20, 12), (4, 4))
    with pytest.raises(ValueError, match='unknown norm'):
        peers.NormAttention(12, 3, norm='batchnorm')
    with pytest.raises(ValueError, match="unknown normalisation 'none'"):
        peers.FocusedLinearAttention(12, 3, 16, normalisation='none')
    with pytest.raises(ValueError, match='as many keys as queries'):
        peers.FocusedLinearAttention(12, 3, 16, separate_q=True, sr_ratio=2, normalisation='subtraction')


# ---------------------------------------------------------------------------------------------------
# The peers' models (models.py's F and N letters): the authors' sizes, names and cost; ours builds and trains

PEERS = ['flatten_swin_t', 'flatten_pvt_t', 'flatten_pvt_s', 'transnormer_swin_t']
FLATTEN = [name for name in PEERS if name.startswith('flatten')]
# A few keys and shapes read off the authors' code (models/flatten_swin.py: FocusedLinearAttention in stages 1
# and 2 with window 56, so a 56x56 and a 28x28 positional_encoding, dwc over one head's D = 32 channels;
# models/flatten_pvt.py: q and kv, positional_encoding over num_patches, the unused final `norm`)
AUTHORS_KEYS = {
    'flatten_swin_t': {'layers.0.blocks.0.attn.qkv.weight': (288, 96), 'layers.0.blocks.1.attn.dwc.weight':
                       (32, 1, 5, 5), 'layers.0.blocks.0.attn.scale': (1, 1, 96),
                       'layers.1.blocks.1.attn.positional_encoding': (1, 784, 192),
                       'layers.0.blocks.0.attn.positional_encoding': (1, 3136, 96),
                       'layers.2.blocks.0.attn.relative_position_bias_table': (169, 12)},
    'flatten_pvt_t': {'block1.0.attn.q.weight': (64, 64), 'block1.0.attn.kv.weight': (128, 64),
                      'block1.0.attn.positional_encoding': (1, 3136, 64),
                      'block4.1.attn.dwc.weight': (64, 1, 5, 5), 'block3.0.attn.scale': (1, 1, 320),
                      'norm.weight': (512,)},
}


def key_table(name):
    """{key: (shape, kind)} of golden/keys/<name>.tsv.gz, the authors' state dict written from their code."""
    with gzip.open(os.path.join(GOLDEN, 'keys', f'{name}.tsv.gz'), 'rt') as f:
        rows = [line.rstrip('\n').split('\t') for line in f][1:]
    return {key: (tuple(int(n) for n in shape.split('x')), kind) for key, shape, kind in rows}


@pytest.mark.parametrize('name', PEERS)
def test_peer_models_have_the_authors_counts_keys_and_macs(name):
    """Built on the meta device: the parameter count and GMACs of models.RELEASED (the authors' for FLatten,
    ours for TransNormer-Swin-T), MACs within 0.5%; FLatten's parameter keys and shapes as the authors'."""
    with torch.device('meta'):
        model = models.create_model(name)
    params, gmacs, _ = models.RELEASED[name]
    assert sum(p.numel() for p in model.parameters()) == params
    ours = models.count_macs(model) / 1e9
    print(f"{name}: {ours:.4f} GMACs, expected {gmacs:.3f}")
    assert abs(ours / gmacs - 1) < 0.005
    if name in FLATTEN:
        state = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        assert state == {k: shape for k, (shape, kind) in key_table(name).items() if kind == 'parameter'}
        assert all(state[k] == shape for k, shape in AUTHORS_KEYS.get(name, {}).items())


@pytest.mark.parametrize('name', ['flatten_swin_t', 'flatten_pvt_t'])
def test_flatten_checkpoint_layout_loads_strictly(name):
    """A state dict in the authors' layout, buffers (Swin's attn_mask, relative_position_index) included,
    loads with no key mapping, every parameter taken."""
    torch.manual_seed(0)
    state = {k: torch.randn(shape) if kind == 'parameter' else torch.zeros(shape)
             for k, (shape, kind) in key_table(name).items()}
    with torch.device('meta'):
        model = models.create_model(name)
    models.load_checkpoint(model.to_empty(device='cpu'), state)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def flatten_golden(name, config):
    """Our module, block or model for a case of golden/golden_peers.pt (built with the authors' FLatten code),
    from its config: F's defaults (focusing factor 3, kernel 5) are the cases'."""
    if name == 'pvt_model':
        return models.create_model('flatten_pvt_t', drop_path_rate=0., **config)
    dim, heads, (h, w) = config['dim'], config['num_heads'], config['grid']
    if name.startswith('swin_block'):
        options = models.attention_options('InLine-Swin', {}, 'F')
        window = config['window']
        return models.SwinBlock(dim, heads, 'F', window, config['shift'], config['mlp_ratio'], 0., options,
                                tokens=window * window)
    if name == 'pvt_block':
        return models.Block(dim, config['mlp_ratio'], 0., config['eps'],
                            peers.FocusedLinearAttention(dim, heads, h * w, separate_q=True))
    pvt = name.startswith('pvt')  # the attention alone: PVT's q and kv (and spatial reduction), or Swin's qkv
    return peers.FocusedLinearAttention(dim, heads, h * w, separate_q=pvt, sr_ratio=config.get('sr_ratio', 1))


FLATTEN_GOLDEN = ['swin_attention', 'swin_block', 'swin_block_shifted', 'pvt_attention_sr1',
                  'pvt_attention_sr2', 'pvt_block', 'pvt_model']


@pytest.fixture(scope='module')
def golden_peers():
    return torch.load(os.path.join(GOLDEN, 'golden_peers.pt'), weights_only=True)


@pytest.mark.parametrize('name', FLATTEN_GOLDEN)
def test_flatten_golden_against_the_authors_code(golden_peers, name):
    """The authors' FLatten attention, blocks and a tiny FLatten-PVT (float64, random perturbed weights, their
    key names): ours, loaded strictly with the same weights, gives the same outputs."""
    torch.manual_seed(0)
    case = golden_peers[name]
    model = flatten_golden(name, case['config']).double().eval()
    model.load_state_dict(case['state_dict'], strict=True)  # their parameter names, unmapped
    grid = () if name == 'pvt_model' else (case['config']['grid'],)
    with torch.no_grad():
        out = model(*case['inputs'], *grid)
    print(f"{name}: max |ours - authors'| = {(out - case['output']).abs().max().item():.1e}")
    torch.testing.assert_close(out, case['output'], rtol=1e-10, atol=1e-10)


SMALL_PEERS = {  # small sizes for real passes; Swin's softmax window 2 tiles the 16x16 to 2x2 stages
    'flatten_swin_t': dict(img_size=64, embed_dim=16, num_heads=(1, 2, 2, 4), softmax_window=2),
    'flatten_pvt_t': dict(img_size=64, embed_dims=(16, 32, 40, 64), num_heads=(1, 2, 2, 4)),
    'transnormer_swin_t': dict(img_size=64, embed_dim=16, num_heads=(1, 2, 2, 4), softmax_window=2),
}


@pytest.mark.parametrize('name', SMALL_PEERS)
def test_peer_models_train_a_step(name):
    """Forward to (B, classes), backward reaches every parameter but FLatten-PVT's unused, frozen norm, and an
    SGD step changes the loss."""
    torch.manual_seed(0)
    model = models.create_model(name, num_classes=5, drop_path_rate=0., **SMALL_PEERS[name])
    x, y = torch.randn(4, 3, 64, 64), torch.tensor([0, 1, 2, 3])
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    for key, p in model.named_parameters():
        frozen = key.startswith('norm.') and name.startswith('flatten_pvt')
        assert (not p.requires_grad and p.grad is None) if frozen else p.grad.abs().sum() > 0, key
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert torch.isfinite(loss) and F.cross_entropy(model(x), y).item() != loss.item()


def test_transnormer_swin_t_says_it_is_our_construction():
    """No code of TransNormer's for vision was released: the registry's docs and the README's table say so."""
    assert 'transnormer_swin_t, our construction' in ' '.join(models.create_model.__doc__.split())
    row = next(line for line in open(os.path.join(os.path.dirname(__file__), 'README.md'))
               if 'transnormer_swin_t' in line)
    assert 'our construction' in row and '79.9' in row, row


@pytest.mark.parametrize('name,letter', [('flatten_pvt_t', 'F'), ('flatten_swin_t', 'F'),
                                         ('transnormer_swin_t', 'N')])
def test_fast_path_refuses_the_peers_by_name(name, letter):
    with torch.device('meta'), pytest.raises(ValueError, match=rf"\(layout letter {letter}\) has none"):
        models.create_model(name, fast='compile')


@pytest.mark.parametrize('name,layout', [('inline_deit_t', 'F'), ('inline_cswin_t', 'INSS')])
def test_families_without_the_peers_refuse_their_letters(name, layout):
    with pytest.raises(ValueError, match=re.escape('built in the PVT and Swin families only')):
        models.create_model(name, layout=layout)
