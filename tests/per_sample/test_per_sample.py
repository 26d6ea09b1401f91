"""docs/design.md, I2, without DeepSpeed: the engine's Σ_i clip(g_i) equals the torch.func oracle."""

import fnmatch
import math

import pytest
from unittest import mock
import torch
from torch import nn

from lightning_dpzero.per_sample import PerSampleEngine, UnsupportedLayerError
from oracle import backward, clipped_sum, per_example_grads


class TokenModel(nn.Module):
    def __init__(self, vocab=11, d=6, padding_idx=0):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=padding_idx)
        self.lin = nn.Linear(d, 8)
        self.ln = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.ln(torch.tanh(self.lin(self.emb(x))))
        return self.head(h).mean(1)


class ConvModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, stride=2, padding=1)
        self.gn = nn.GroupNorm(2, 4)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.gn(self.conv(x))).flatten(1))


def _data(kind, B, gen):
    if kind == "token":
        return TokenModel(), torch.randint(0, 11, (B, 5), generator=gen), torch.randint(0, 3, (B,), generator=gen)
    return ConvModel(), torch.randn(B, 1, 8, 8, generator=gen), torch.randint(0, 3, (B,), generator=gen)


CLIPPINGS = [("layer-wise", "book-keeping"), ("all-layer", "book-keeping"), ("all-layer", "two-pass")]


@pytest.mark.parametrize("kind", ["token", "conv"])
@pytest.mark.parametrize("clipping,mode", CLIPPINGS)
@pytest.mark.parametrize("clipping_fn", ["abadi", "automatic"])
def test_engine_matches_torch_func_oracle(kind, clipping, mode, clipping_fn):
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model, x, y = _data(kind, 7, gen)
    C = 0.05  # small enough that most examples are clipped
    ref = clipped_sum(model, per_example_grads(model, nn.functional.cross_entropy, x, y), C, clipping, clipping_fn)
    engine = PerSampleEngine(model, max_grad_norm=C, clipping=clipping, clipping_fn=clipping_fn,
                             clipping_mode=mode).attach()
    with engine.micro_batch(batch_size=7):
        backward(engine, nn.functional.cross_entropy(model(x), y))
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), ref[n], rtol=1e-4, atol=1e-6, msg=n)
    assert engine.stats["examples"] == 7 and engine.stats["clipped"] > 0


def test_unclipped_equals_sum_of_gradients():
    torch.manual_seed(1)
    model = TokenModel()
    x, y = torch.randint(0, 11, (4, 5)), torch.randint(0, 3, (4,))
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    engine = PerSampleEngine(model, max_grad_norm=math.inf).attach()
    with engine.micro_batch(batch_size=4):
        nn.functional.cross_entropy(model(x), y).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-5, atol=1e-6, msg=n)


def test_batchnorm_refused_by_name():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    with pytest.raises(UnsupportedLayerError, match=r"BatchNorm2d '1'.*GroupNorm"):
        PerSampleEngine(model).attach()


def test_flattened_batch_refused():
    model = nn.Linear(4, 2)
    engine = PerSampleEngine(model).attach()
    with engine.micro_batch(batch_size=3), pytest.raises(UnsupportedLayerError, match="first dimension is 6"):
        model(torch.randn(6, 4))


class TiedNet(nn.Module):
    """Embedding tied to the output head, and one LayerNorm used twice."""

    def __init__(self, vocab=9, d=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        h = self.ln(self.emb(x))
        h = self.ln(torch.tanh(self.mix(h)) + h)
        return self.head(h).mean(1)


@pytest.mark.parametrize("clipping,mode", CLIPPINGS)
@pytest.mark.parametrize("clipping_fn", ["abadi", "automatic"])
def test_tied_and_reused_parameters_match_the_oracle(clipping, mode, clipping_fn):
    torch.manual_seed(3)
    model = TiedNet()
    x, y = torch.randint(0, 9, (5, 4)), torch.randint(0, 9, (5,))
    grads = per_example_grads(model, nn.functional.cross_entropy, x, y)  # tied: one entry, summed by autograd
    groups = None if clipping == "all-layer" else [["emb.weight"], ["mix.weight", "mix.bias"], ["ln.weight", "ln.bias"]]
    ref = clipped_sum(model, grads, 0.05, clipping, clipping_fn, groups=groups)
    engine = PerSampleEngine(model, max_grad_norm=0.05, clipping=clipping, clipping_fn=clipping_fn,
                             clipping_mode=mode).attach()
    assert engine.needs_deferred_writes == (clipping == "all-layer" and mode == "book-keeping")
    assert engine.two_pass == (mode == "two-pass")
    with engine.micro_batch(batch_size=5):
        backward(engine, nn.functional.cross_entropy(model(x), y))
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), ref[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("spec", ["patterns", "params"])
@pytest.mark.parametrize("mode", ["book-keeping", "two-pass"])
def test_group_wise_matches_the_oracle(spec, mode):
    torch.manual_seed(4)
    model = TokenModel()
    x, y = torch.randint(0, 11, (6, 5)), torch.randint(0, 3, (6,))
    names = [["emb.*", "lin.*"], ["ln.*", "head.*"]]
    groups = names if spec == "patterns" else [
        [model.emb.weight, model.lin.weight, model.lin.bias], [model.ln.weight, model.ln.bias, *model.head.parameters()]]
    ref_groups = [["emb.weight", "lin.weight", "lin.bias"], ["ln.weight", "ln.bias", "head.weight", "head.bias"]]
    ref = clipped_sum(model, per_example_grads(model, nn.functional.cross_entropy, x, y), 0.05, groups=ref_groups)
    engine = PerSampleEngine(model, max_grad_norm=0.05, clipping="group-wise", groups=groups,
                             clipping_mode=mode).attach()
    assert engine.needs_deferred_writes == (mode == "book-keeping")
    with engine.micro_batch(batch_size=6):
        backward(engine, nn.functional.cross_entropy(model(x), y))
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), ref[n], rtol=1e-4, atol=1e-6, msg=n)


def test_group_wise_refuses_unclaimed_parameters():
    with pytest.raises(ValueError, match=r"no group claims.*head\.weight"):
        PerSampleEngine(TokenModel(), clipping="group-wise", groups=[["emb.*", "lin.*", "ln.*"]]).attach()


@pytest.mark.parametrize("kind", ["token", "conv"])
def test_empty_micro_batch_gives_zero_gradients(kind):
    model, x, y = _data(kind, 0, torch.Generator().manual_seed(0))
    engine = PerSampleEngine(model, max_grad_norm=1.0).attach()
    with engine.micro_batch(batch_size=0):
        loss = nn.functional.cross_entropy(model(x), y)  # NaN: the mean over no examples
        torch.nan_to_num(loss).backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and not p.grad.any(), n
    flat = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2))  # 2-D inputs
    eng = PerSampleEngine(flat).attach()
    with eng.micro_batch(batch_size=0):
        torch.nan_to_num(flat(torch.randn(0, 4)).mean()).backward()
    assert all(not p.grad.any() for p in flat.parameters())


@pytest.mark.parametrize("kind", ["token", "conv"])
@pytest.mark.parametrize("clipping,mode", CLIPPINGS)
def test_an_empty_batch_stand_in_adds_nothing_whatever_its_values(kind, clipping, mode):
    """An empty micro-batch whose forward runs on a one-row stand-in: every parameter gets exactly the zero
    gradient of no example, even from a stand-in whose loss and gradients are NaN, and no norm is counted."""
    model, x, y = _data(kind, 1, torch.Generator().manual_seed(0))
    engine = PerSampleEngine(model, max_grad_norm=1.0, clipping=clipping, clipping_mode=mode).attach()
    engine.start_micro_batch(0, stand_in_rows=1)
    engine.set_loss_factors(1.0, 1.0)
    loss = nn.functional.cross_entropy(model(x), y) * math.nan  # the stand-in's values must not matter
    backward(engine, loss)
    engine.finalize()
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() == 0, n
    assert engine.stats["examples"] == 0
    with engine.micro_batch(batch_size=1):  # the next micro-batch is a real one again
        backward(engine, nn.functional.cross_entropy(model(x), y))
    assert engine.stats["examples"] == 1 and not engine.stand_in


def test_frozen_parameters_cost_nothing_and_stay_untouched():
    model = TokenModel()
    for p in model.emb.parameters():
        p.requires_grad_(False)
    model.head.bias.requires_grad_(False)
    engine = PerSampleEngine(model, max_grad_norm=0.1).attach()
    assert "emb" not in {h.name for h in engine.hooks}
    with engine.micro_batch(batch_size=3):
        nn.functional.cross_entropy(model(torch.randint(0, 11, (3, 5))), torch.tensor([0, 1, 2])).backward()
    assert model.emb.weight.grad is None and model.head.bias.grad is None
    assert model.head.weight.grad is not None


@pytest.mark.parametrize("layer", [nn.BatchNorm1d(8, affine=False), nn.InstanceNorm1d(8, track_running_stats=True)])
def test_frozen_batch_mixing_or_running_stat_layers_are_refused(layer):
    for p in layer.parameters():
        p.requires_grad_(False)
    model = nn.Sequential(nn.Linear(4, 8), layer)
    with pytest.raises(UnsupportedLayerError, match=r"(?s)even frozen.*(GroupNorm|track_running_stats=False)"):
        PerSampleEngine(model).attach()


def test_position_ids_of_batch_one_are_expanded_per_example():
    class PosNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos, self.head = nn.Embedding(7, 4), nn.Embedding(5, 4), nn.Linear(4, 3)

        def forward(self, x):
            pos = torch.arange(x.shape[1]).unsqueeze(0)  # (1, T), as BERT's position_ids buffer
            return self.head(self.tok(x) + self.pos(pos)).mean(1)

    torch.manual_seed(5)
    model = PosNet()
    x, y = torch.randint(0, 7, (4, 5)), torch.randint(0, 3, (4,))
    ref = clipped_sum(model, per_example_grads(model, nn.functional.cross_entropy, x, y), 0.05, "all-layer")
    engine = PerSampleEngine(model, max_grad_norm=0.05, clipping="all-layer").attach()
    with engine.micro_batch(batch_size=4):
        nn.functional.cross_entropy(model(x), y).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), ref[n], rtol=1e-4, atol=1e-6, msg=n)


def test_group_thresholds_clip_each_group_to_its_own_bound():
    torch.manual_seed(5)
    model, x, y = TokenModel(), torch.randint(0, 11, (6, 5)), torch.randint(0, 3, (6,))
    groups = [["emb.*", "lin.*"], ["ln.*", "head.*"]]
    names = [[n for n, _ in model.named_parameters() if n.split(".")[0] in ("emb", "lin")],
             [n for n, _ in model.named_parameters() if n.split(".")[0] in ("ln", "head")]]
    grads = per_example_grads(model, nn.functional.cross_entropy, x, y)
    thresholds = [0.03, 0.04]  # sqrt(0.03² + 0.04²) = 0.05 = C
    ref = {}
    for grp, c in zip(names, thresholds):
        norms = sum(grads[n].flatten(1).pow(2).sum(1) for n in grp).sqrt()
        coef = (c / norms).clamp(max=1.0)
        for n in grp:
            ref[n] = (grads[n] * coef.view(-1, *[1] * (grads[n].dim() - 1))).sum(0)
    engine = PerSampleEngine(model, max_grad_norm=0.05, clipping="group-wise", groups=groups,
                             group_max_grad_norms=thresholds).attach()
    with engine.micro_batch(batch_size=6):
        nn.functional.cross_entropy(model(x), y).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), ref[n], rtol=1e-4, atol=1e-7, msg=n)
    with pytest.raises(ValueError, match="above max_grad_norm"):
        PerSampleEngine(TokenModel(), max_grad_norm=0.05, clipping="group-wise", groups=groups,
                        group_max_grad_norms=[0.05, 0.05]).attach()


def cross_entropy_step(model, engine, x, y):
    """One micro-batch of cross-entropy on ``(x, y)`` through ``engine`` (``None``: plain training)."""
    def step():
        model.zero_grad(set_to_none=False)
        if engine is None:
            return nn.functional.cross_entropy(model(x), y).backward()
        with engine.micro_batch(batch_size=x.shape[0]):
            backward(engine, nn.functional.cross_entropy(model(x), y))
    return step


class MeanOverTime(nn.Module):
    def forward(self, x):
        return x.mean(1)


def norm_stack():
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.LayerNorm(64), nn.Tanh())], MeanOverTime(), nn.Linear(64, 3))


@pytest.mark.parametrize("clipping", ["all-layer", "group-wise"])
def test_book_keeping_drops_a_waiting_site_s_rows_where_its_kept_gradients_form_its_sums(clipping):
    """A LayerNorm (or a Linear on the reuse path) keeps its ``(B, p)`` per-example gradients for its clipped
    sum, so while it waits for the end of the backward pass its ``(B, T, d)`` input and output gradient are
    dropped: the step peaks within 1.2× plain training, not 1.5× above it. A layer whose weight and bias are in
    different groups keeps its rows (it forms two sums at two times), and the sums are the oracle's."""
    from benchmarks.common import profiler_peak_bytes

    x, y = torch.randn(16, 32, 64, generator=torch.Generator().manual_seed(1)), torch.arange(16) % 3
    names = [n for n, _ in norm_stack().named_parameters()]
    # group-wise: the first LayerNorm's weight and bias in two groups
    groups = [["0.weight", "2.*", "4.*"], ["0.bias", "6.*", "9.*"]] if clipping == "group-wise" else None
    model = norm_stack()
    ref = clipped_sum(model, per_example_grads(model, nn.functional.cross_entropy, x, y), 0.1,
                      groups=None if groups is None else [[n for n in names if any(fnmatch.fnmatch(n, pat) for pat in grp)]
                                                          for grp in groups])

    def peak(engine_kind, release=True):
        model = norm_stack()
        engine = None if engine_kind is None else PerSampleEngine(model, 0.1, clipping, groups=groups).attach()

        step = cross_entropy_step(model, engine, x, y)

        from lightning_dpzero.per_sample.normalization import _AffineNormRule

        with mock.patch.object(_AffineNormRule, "releases_rows", _AffineNormRule.releases_rows if release
                               else lambda self, site: False):
            step()
            if engine is not None:
                for n, p in model.named_parameters():
                    torch.testing.assert_close(p.grad.double(), ref[n], rtol=1e-4, atol=1e-6, msg=n)
            return profiler_peak_bytes(step)

    plain, released, kept = peak(None), peak("dp"), peak("dp", release=False)
    if clipping == "all-layer":
        assert released < 1.2 * plain < 1.4 * plain < kept, (plain, released, kept)
    else:
        assert released < kept, (plain, released, kept)


@pytest.mark.parametrize("deferred_zeros", [False, True])
def test_all_layer_frees_each_site_as_soon_as_its_sums_are_written(monkeypatch, deferred_zeros):
    """The deferred writes go site by site: when a layer call's clipped sums reach ``p.grad`` its kept input and
    output gradient are already released (no second copy of every gradient beside every site's records); a
    Linear weight's sum becomes ``p.grad``, or where the sites returned zeros into it (``deferred_zeros``) is
    added into it in place, and the result is still the oracle's."""
    import weakref

    from lightning_dpzero.per_sample.linear import LinearRule

    gen = torch.Generator().manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 3))
    x, y = torch.randn(4, 5, generator=gen), torch.randint(0, 3, (4,), generator=gen)
    ref = clipped_sum(model, per_example_grads(model, nn.functional.cross_entropy, x, y), 0.1, "all-layer")
    engine = PerSampleEngine(model, max_grad_norm=0.1, clipping="all-layer").attach()
    engine.deferred_zeros = deferred_zeros
    sites, alive_at_write, written = [], [], []
    original_clipped, original_write = LinearRule.clipped_grads, engine.window.write

    def clipped_grads(self, site, coef, mask):
        sites.append(weakref.ref(site))
        return original_clipped(self, site, coef, mask)

    def write(sums):
        alive_at_write.append([ref() is not None for ref in sites])
        sums = list(sums)
        written.extend(id(p) for p, _ in sums)
        original_write(sums)

    monkeypatch.setattr(LinearRule, "clipped_grads", clipped_grads)
    monkeypatch.setattr(engine.window, "write", write)
    with engine.micro_batch(batch_size=4):
        nn.functional.cross_entropy(model(x), y).backward()
    assert len(sites) == 3 and alive_at_write == [[False], [False, False], [False, False, False]]
    # with zeros in p.grad each sum was added into it in place (one addmm_ for a weight, one for a bias), none
    # went through window.write; without, every sum did, as the parameter's first gradient
    assert sorted(written) == sorted(id(p) for k in (0, 2, 4) for p in model[k].parameters()
                                     if deferred_zeros is False)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), ref[n], rtol=1e-4, atol=1e-6, msg=n)


def test_two_pass_all_layer_keeps_the_peak_memory_of_non_private_training():
    # book-keeping keeps every layer's input and output gradient until the last layer's backward; two-pass keeps
    # nothing, so its step peaks where plain training's does (plus its first pass's transients)
    from benchmarks.common import profiler_peak_bytes

    def deep():
        torch.manual_seed(0)
        return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(128, 128), nn.Tanh())], nn.Linear(128, 4))

    x, y = torch.randn(16, 32, 128), torch.randn(16, 32, 4)

    def peak(mode):
        model = deep()
        engine = None if mode is None else PerSampleEngine(model, 0.1, "all-layer", clipping_mode=mode).attach()

        def step():
            if engine is None:
                return ((model(x) - y) ** 2).mean().backward()
            with engine.micro_batch(batch_size=16):
                backward(engine, ((model(x) - y) ** 2).mean())

        step()  # p.grad exists from here on in every case
        return profiler_peak_bytes(step)

    plain, book_keeping, two_pass = peak(None), peak("book-keeping"), peak("two-pass")
    assert book_keeping > 1.5 * plain  # what two-pass is for
    assert two_pass < 1.15 * plain, (plain, book_keeping, two_pass)


def small_cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.GroupNorm(8, 32), nn.ReLU(),  # the benchmark CNN
                         nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.GroupNorm(8, 64), nn.ReLU(),
                         nn.Conv2d(64, 64, 3, stride=2, padding=1), nn.GroupNorm(8, 64), nn.ReLU(),
                         nn.Flatten(), nn.Linear(64 * 8 * 8, 10))


@pytest.mark.parametrize("clip", [("layer-wise", "book-keeping"), ("all-layer", "book-keeping"),
                                  ("all-layer", "two-pass")])
def test_convolutions_form_per_example_work_a_part_of_the_batch_at_a_time(clip):
    # a convolution's per-example gradients (the grouped kernel copies its inputs: 2-4x its output), its ghost
    # norm's unfolded rows and its clipped sum's kernel are formed for part of the batch at a time: layer-wise
    # clipping then peaks where plain training does (it peaked 1.27x above it on the benchmark CNN), and the parts
    # give the oracle's gradients
    from benchmarks.common import profiler_peak_bytes
    from lightning_dpzero.per_sample import paths as paths_mod

    x, y = torch.randn(32, 3, 32, 32, generator=torch.Generator().manual_seed(1)), torch.arange(32) % 10
    model = small_cnn()
    ref = clipped_sum(model, per_example_grads(model, nn.functional.cross_entropy, x, y), 0.1, clip[0],
                      groups=None if clip[0] == "all-layer" else [[f"{i}.weight", f"{i}.bias"] for i in (0, 1, 3, 4, 6, 7, 10)])

    def peak(clipping, mode, whole=False):
        model = small_cnn()
        engine = None if clipping is None else PerSampleEngine(model, 0.1, clipping, clipping_mode=mode).attach()

        step = cross_entropy_step(model, engine, x, y)

        with mock.patch.object(paths_mod, "NORM_CHUNK_FACTOR", 1e9 if whole else paths_mod.NORM_CHUNK_FACTOR):
            step()  # p.grad exists from here on in every case
            if engine is not None and not whole:
                for n, p in model.named_parameters():
                    torch.testing.assert_close(p.grad.double(), ref[n], rtol=1e-3, atol=1e-5, msg=n)
            return profiler_peak_bytes(step)

    plain, parts, whole = peak(None, None), peak(*clip), peak(*clip, whole=True)
    assert parts < whole, (plain, parts, whole)
    # the input gradient too, on the CPU: its kernel copies its result (and the output gradient), which at the
    # widest layer was plain training's own peak; formed in parts, every clipping stays within it (before: 1.00,
    # 1.14 and 1.23 of plain's peak in the order of the parameters). Layer-wise: 0.89 with parts of 3 examples on
    # the third layer, 0.99 with its larger parts of 11 (ConvRule._parts, "reuse"), within plain's peak
    bound = {("layer-wise", "book-keeping"): 1.0, ("all-layer", "book-keeping"): 1.0,
             ("all-layer", "two-pass"): 1.1}[clip]
    assert parts <= bound * plain < 1.15 * plain < whole, (plain, parts, whole)


def test_convolution_parts_grow_towards_16_examples_only_within_the_kept_per_example_gradients():
    # a site that keeps its per-example gradients forms them in parts grown towards REUSE_PART_TARGET examples (the
    # grouped kernel is slow on few groups) as far as a part's temporaries stay within what it keeps; norms alone
    # (all-layer, nothing kept) stay within the memory bound of norm_chunk
    from lightning_dpzero.per_sample.conv import REUSE_PART_TARGET, ConvRule

    rule = ConvRule()

    def sizes(conv, B, hw, work):
        x = torch.empty(B, conv.in_channels, hw, hw)
        g = torch.empty(B, conv.out_channels, *conv(torch.empty(1, conv.in_channels, hw, hw)).shape[2:])
        parts = rule._parts(conv, x, g, work)
        assert torch.cat([torch.arange(B)[s] for s in parts]).tolist() == list(range(B))  # in order, once each
        return [len(range(B)[s]) for s in parts]

    third = nn.Conv2d(64, 64, 3, stride=2, padding=1)  # the benchmark CNN's third layer, 16×16 inputs
    assert sizes(third, 64, 16, "reuse") == [REUSE_PART_TARGET] * 4  # 5.9 ms against about 6.5 in parts of 6
    assert sizes(third, 64, 16, "instantiate") == [6] * 10 + [4]
    # per example: the kept gradients, a part's temporaries (its input and output gradient, the kernel's result
    # and its copy); parts stop growing where a part's temporaries would exceed what the site keeps
    kept, per = 64 * 64 * 9, 64 * 16 * 16 + 64 * 8 * 8 + 2 * 64 * 64 * 9
    assert max(sizes(third, 32, 16, "reuse")) * per <= 32 * kept < REUSE_PART_TARGET * per
    assert sizes(third, 32, 16, "reuse") == [11, 11, 10] and sizes(third, 8, 16, "reuse") == [3, 3, 2]
    # where the kept gradients are small beside a part's temporaries the memory bound's parts stay: a wide layer
    # (the new bound computed, and smaller)
    wide = nn.Conv2d(32, 64, 3, stride=2, padding=1)
    assert sizes(wide, 16, 64, "reuse") == sizes(wide, 16, 64, "instantiate") == [6, 6, 4]


def test_a_few_channel_convolutions_strided_patches_count_in_its_parts_temporaries():
    # a layer with few input channels forms its per-example gradients from strided patches of its input, T·d
    # values an example (49× the input of a one-channel 7×7 layer): they count among a part's temporaries for
    # the norms alone as for kept gradients (before, norms alone took parts of 11 here, 3.4× the bound)
    from lightning_dpzero.per_sample.conv import ConvRule
    from lightning_dpzero.per_sample.paths import NORM_CHUNK_FACTOR

    few, B = nn.Conv2d(1, 2, 7), 64
    x, g = torch.empty(B, 1, 10, 10), torch.empty(B, 2, 4, 4)
    T, d, p = 16, 49, 2
    per = (x.numel() + g.numel()) // B + 2 * p * d + T * d  # input and output gradient, kernel result, patches
    budget = NORM_CHUNK_FACTOR * (x.numel() + g.numel())
    norms_only = [len(range(B)[s]) for s in ConvRule()._parts(few, x, g, "instantiate")]
    kept = [len(range(B)[s]) for s in ConvRule()._parts(few, x, g, "reuse")]
    assert max(norms_only) * per <= budget < (max(norms_only) + 1) * per and norms_only == [3] * 21 + [1]
    # kept gradients (B·p·d values) grow the parts only as far as a part's temporaries, patches included, fit in them
    assert max(kept) * per <= B * p * d < (max(kept) + 1) * per and kept == [5] * 12 + [4]


def test_two_pass_with_activation_checkpointing_matches_the_oracle():
    # non-reentrant checkpointing recomputes the block in each of the two backward passes
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)

        def forward(self, x):
            h = checkpoint(lambda t: torch.tanh(self.b(torch.tanh(self.a(t)))), x, use_reentrant=False)
            return self.head(h).mean(1)

    from oracle import per_example_grads_loop  # torch.func does not run through checkpointing's hooks

    torch.manual_seed(0)
    model, x, y = Checkpointed(), torch.randn(5, 4, 8), torch.randint(0, 3, (5,))
    ref = clipped_sum(model, per_example_grads_loop(model, nn.functional.cross_entropy, x, y), 0.05, "all-layer")
    engine = PerSampleEngine(model, 0.05, "all-layer", clipping_mode="two-pass").attach()
    with engine.micro_batch(batch_size=5):
        backward(engine, nn.functional.cross_entropy(model(x), y))
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), ref[n], rtol=1e-4, atol=1e-6, msg=n)
    assert engine.stats["clipped"] == 5


def test_two_pass_refuses_a_backward_without_its_norms_pass():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    engine = PerSampleEngine(model, 1.0, "all-layer", clipping_mode="two-pass").attach()
    with pytest.raises(RuntimeError, match=r"norms_pass\(loss\) before loss.backward"), engine.micro_batch(batch_size=3):
        model(torch.randn(3, 4)).sum().backward()
    assert all(p.grad is None for p in model.parameters())


def test_a_parameter_frozen_after_attach_gets_no_gradient_and_two_pass_matches_book_keeping():
    # freezing a layer after the engine attached (e.g. from a callback): the frozen weight is left untouched in every
    # mode (book-keeping's deferred write gave it a gradient, so the optimizer moved it), the norms pass still runs
    # (torch.autograd.grad refuses an input that does not require grad), and two-pass's update equals book-keeping's
    def run(clipping, mode):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        engine = PerSampleEngine(model, 0.05, clipping, clipping_mode=mode).attach()
        model[0].weight.requires_grad_(False)
        x, y = torch.randn(5, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 0, 1])
        with engine.micro_batch(batch_size=5):
            backward(engine, nn.functional.cross_entropy(model(x), y))
        assert model[0].weight.grad is None, (clipping, mode)
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, engine.stats

    run("layer-wise", "book-keeping")
    (two_pass, two_stats), (book, book_stats) = run("all-layer", "two-pass"), run("all-layer", "book-keeping")
    assert two_stats == pytest.approx(book_stats)
    for n in two_pass:
        torch.testing.assert_close(two_pass[n], book[n], msg=n)


def test_two_pass_refuses_reentrant_checkpointing_naming_the_fix():
    from torch.utils.checkpoint import checkpoint

    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    engine = PerSampleEngine(model, 1.0, "all-layer", clipping_mode="two-pass").attach()
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match=r"two-pass.*use_reentrant=False.*book-keeping"), \
            engine.micro_batch(batch_size=3):
        h = torch.tanh(model[0](x))
        out = model[2](checkpoint(torch.tanh, h, use_reentrant=True))
        backward(engine, out.sum())
    assert all(p.grad is None for p in model.parameters())


def test_a_parameter_unfrozen_after_attach_is_refused_at_the_next_micro_batch():
    # e.g. Lightning's BaseFinetuning unfreezing a backbone during fit: no clipping group holds the parameter, so it
    # would silently never train
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model[0].requires_grad_(False)
    engine = PerSampleEngine(model, 1.0).attach()
    with engine.micro_batch(batch_size=3):
        model(torch.randn(3, 4)).sum().backward()
    model[0].requires_grad_(True)
    with pytest.raises(UnsupportedLayerError, match=r"2 parameter\(s\) became trainable.*'0.weight', '0.bias'.*"
                                                     r"Set requires_grad before trainer.fit"):
        engine.start_micro_batch(3)


def _linear_stack() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3))


@pytest.mark.parametrize("clipping", ["layer-wise", "all-layer"])
def test_a_backward_forms_no_zeros_for_the_gradients_it_returns_and_sums_each_bias_s_rows_once(clipping):
    """The engine's per-call overhead: where a site returns its clipped sums (layer-wise) it forms no
    parameter-sized tensor of zeros beside them (a zero default evaluated for every parameter cost a memset of
    the whole model per step), and each call sums its output gradient over the rows once for a bias, at its norm,
    not again for its clipped sum (under all-layer clipping, when those rows are no longer in cache). The
    gradients stay the oracle's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_dpzero.per_sample.linear import LinearRule

    x, y = torch.randn(8, 5, 16, generator=torch.Generator().manual_seed(2)), torch.arange(8) % 3
    model = _linear_stack()
    ref = clipped_sum(model, per_example_grads(model, lambda o, t: nn.functional.cross_entropy(o.mean(1), t), x, y),
                      0.5, clipping=clipping)

    class Zeros(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.zeros_like.default, torch.ops.aten.zeros.default):
                self.shapes.append(tuple(args[0].shape) if func is torch.ops.aten.zeros_like.default else args[0])
            return func(*args, **(kwargs or {}))

    model = _linear_stack()
    engine = PerSampleEngine(model, 0.5, clipping).attach()
    calls = []
    real = LinearRule._bias_rows
    with mock.patch.object(LinearRule, "_bias_rows", lambda self, m, g: calls.append(m) or real(self, m, g)):
        with engine.micro_batch(batch_size=8):
            loss = nn.functional.cross_entropy(model(x).mean(1), y)
            with Zeros() as zeros:
                loss.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), ref[n], rtol=1e-4, atol=1e-6, msg=n)
    assert len(calls) == 3, f"{len(calls)} row sums for 3 biases"
    if clipping == "layer-wise":
        assert not zeros.shapes, zeros.shapes
