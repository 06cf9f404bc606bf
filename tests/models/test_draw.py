"""DRAW generative model and the DRAW-read classifier: shapes, KL, and training under fixed seeds."""

import pytest
import torch

from attnkit.models import DRAW, DRAWClassifier


def test_draw_canvases_windows_and_kl():
    torch.manual_seed(0)
    model = DRAW(height=8, width=8, steps=3, read_n=2, write_n=3, hidden_dim=16, latent_dim=4)
    x = torch.rand(5, 1, 8, 8)
    loss, out = model.loss(x)
    assert out.canvases.shape == (5, 3, 1, 8, 8) and len(out.read_windows) == 3
    assert (out.kl >= 0).all() and torch.isfinite(loss)
    assert model.generate(2).shape == (2, 3, 1, 8, 8)


def test_tiny_draw_reduces_its_bound_under_fixed_seed():
    torch.manual_seed(0)
    from attnkit.data.digits_canvas import load_digit_images

    x = torch.from_numpy(load_digit_images("train")[0][:16]).unsqueeze(1)  # (16, 1, 8, 8) in [0, 1]
    model = DRAW(height=8, width=8, steps=4, read_n=3, write_n=3, hidden_dim=32, latent_dim=4)
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    first = None
    for _ in range(80):
        loss, _ = model.loss(x)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.8 * first


def test_tiny_draw_classifier_learns_where_the_square_is():
    torch.manual_seed(0)

    def batch(n):
        y = torch.randint(0, 4, (n,))
        x = torch.zeros(n, 1, 12, 12)
        for i, q in enumerate(y.tolist()):
            r, c = divmod(q, 2)
            x[i, 0, r * 6 + 1 : r * 6 + 5, c * 6 + 1 : c * 6 + 5] = 1.0
        return x, y

    model = DRAWClassifier(12, 12, num_classes=4, read_n=3, steps=2, hidden_dim=16)
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    for _ in range(60):
        x, y = batch(32)
        loss = torch.nn.functional.cross_entropy(model(x)[0], y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    x, y = batch(200)
    logits, windows = model(x)
    assert (logits.argmax(-1) == y).float().mean() > 0.9 and len(windows) == 2


def test_generate_follows_the_model_dtype():
    model = DRAW(height=8, width=8, steps=2, read_n=2, write_n=2, hidden_dim=8, latent_dim=2).double()
    samples = model.generate(3)
    assert samples.dtype == torch.float64 and samples.shape == (3, 2, 1, 8, 8)
    assert model.generate(0).shape == (0, 2, 1, 8, 8)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda d, c: d.generate(-1), "num=-1: expected a number of samples >= 0"),
        (lambda d, c: d.loss(torch.rand(0, 1, 8, 8)), r"empty batch \(B=0\)"),
        (lambda d, c: d.loss(torch.full((2, 1, 8, 8), 255.0)), r"values in \[255, 255\]; .* in \[0, 1\]"),
        (lambda d, c: d.loss(torch.rand(2, 1, 8, 8) - 0.5), r"needs pixel intensities in \[0, 1\]"),
        (lambda d, c: d.loss(torch.full((2, 1, 8, 8), float("nan"))), r"values in \[nan, nan\]"),
        (lambda d, c: c(torch.rand(2, 3, 8, 8)), r"expected \(B, C=1, H, W\)"),
    ],
)
def test_bad_inputs_raise_clear_errors(call, message):
    draw = DRAW(height=8, width=8, steps=2, read_n=2, write_n=2, hidden_dim=8, latent_dim=2)
    classifier = DRAWClassifier(8, 8, num_classes=3, read_n=2, steps=2, hidden_dim=8)
    with pytest.raises(ValueError, match=message):
        call(draw, classifier)


def test_draw_classifier_names_images_of_another_dtype():
    """float64 images into a float32 model raised torch's "mat1 and mat2 must have the same dtype"."""
    model = DRAWClassifier(8, 8, num_classes=3, read_n=2, steps=2, hidden_dim=8)
    with pytest.raises(ValueError, match=r"images have dtype torch.float64 but DRAWClassifier's parameters "
                       r"are torch.float32; cast the images with .to\(torch.float32\) or the model with"):
        model(torch.rand(2, 1, 8, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="images have dtype torch.int64; expected a floating tensor"):
        model(torch.zeros(2, 1, 8, 8, dtype=torch.long))
    logits, _ = model.double()(torch.rand(2, 1, 8, 8, dtype=torch.float64))
    assert logits.dtype == torch.float64


def test_draw_loss_is_exact_and_learns_where_the_canvas_saturates():
    torch.manual_seed(0)
    model = DRAW(height=4, width=4, steps=2, read_n=2, write_n=2, hidden_dim=8, latent_dim=2)
    with torch.no_grad():  # canvas logits above 17 everywhere: sigmoid rounds to 1 in float32
        model.write_patch.weight.zero_()
        model.write_patch.bias.fill_(300.0)
    x = torch.zeros(3, 1, 4, 4)  # dark pixels: -log(1 - sigmoid(c)) = softplus(c) nats each, gradient ~1
    loss, out = model.loss(x)
    assert torch.equal(torch.sigmoid(out.logits), out.canvases[:, -1])
    expected = (torch.nn.functional.softplus(out.logits.double()).flatten(1).sum(1) + out.kl.double()).mean()
    assert out.logits.min() > 17 and abs(loss.item() - expected.item()) < 1e-3 * expected.item()
    loss.backward()
    assert model.write_patch.bias.grad.abs().min() > 0.5  # the saturated pixels still push the canvas down


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_pixels_are_refused(steps, bad):
    """DRAWClassifier(steps=1) returned NaN logits silently; else the error blamed the recurrent state."""
    x = torch.rand(2, 1, 8, 8)
    x[1, 0, 3, 3] = bad
    message = r"images hold NaN or infinite pixels; replace them \(e\.g\. torch\.nan_to_num\) first"
    with pytest.raises(ValueError, match=message):
        DRAWClassifier(8, 8, num_classes=3, read_n=2, steps=steps, hidden_dim=4).eval()(x)
    with pytest.raises(ValueError, match=message):
        DRAW(8, 8, steps=steps, hidden_dim=4, latent_dim=2)(x)


def test_the_loss_is_the_papers_reconstruction_plus_latent_loss_in_float64():
    """Eqs. 3-12 of "DRAW" (arXiv:1502.04623) as a loop: x_hat = x - sigmoid(c_{t-1}), reads of x and x_hat,
    the encoder LSTM, z = mu + sigma eps, the decoder LSTM, the write, and the loss L^x + L^z with
    L^z = sum_t 1/2 (mu^2 + sigma^2 - log sigma^2) - T/2 per latent; the KL with -log sigma, or x - c for
    x_hat, passed every test (which checked kl >= 0)."""
    from attnkit.nn.draw import draw_read, draw_write, window_from_params

    torch.manual_seed(14)
    model = DRAW(9, 7, steps=3, read_n=2, write_n=3, hidden_dim=5, latent_dim=2).double()
    with torch.no_grad():
        model.read.params.weight.normal_(0, 0.3)  # windows that move with the decoder state
    x = torch.rand(2, 1, 9, 7, dtype=torch.float64)
    torch.manual_seed(0)
    loss, out = model.loss(x)

    def lstm(cell, inp, h, c):
        gates = inp @ cell.weight_ih.T + cell.bias_ih + h @ cell.weight_hh.T + cell.bias_hh
        i, f, g, o = gates.chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c

    torch.manual_seed(0)
    B, zero = 2, torch.zeros(2, 5, dtype=torch.float64)
    c, (he, ce), (hd, cd), kl = torch.zeros_like(x), (zero, zero), (zero, zero), 0.0
    with torch.no_grad():
        for _ in range(3):
            x_hat = x - torch.sigmoid(c)
            read = window_from_params(hd @ model.read.params.weight.T + model.read.params.bias, 7, 9, 2)
            r = torch.cat([draw_read(x, read, 2).flatten(1), draw_read(x_hat, read, 2).flatten(1)], -1)
            he, ce = lstm(model.encoder, torch.cat([r, hd], -1), he, ce)
            mu, log_sigma = (he @ model.posterior.weight.T + model.posterior.bias).chunk(2, -1)
            z = mu + log_sigma.exp() * torch.randn_like(mu)
            hd, cd = lstm(model.decoder, z, hd, cd)
            write = window_from_params(hd @ model.write_params.weight.T + model.write_params.bias, 7, 9, 3)
            patch = (hd @ model.write_patch.weight.T + model.write_patch.bias).view(B, 1, 3, 3)
            c = c + draw_write(patch, write, 7, 9)
            kl = kl + 0.5 * (mu**2 + (2 * log_sigma).exp() - 2 * log_sigma).sum(-1) - 0.5 * 2
        p = torch.sigmoid(c)
        reconstruction = -(x * p.log() + (1 - x) * (1 - p).log()).flatten(1).sum(1)
    torch.testing.assert_close(loss.detach(), (reconstruction + kl).mean(), atol=1e-10, rtol=0)
    torch.testing.assert_close(out.canvases[:, -1], p, atol=1e-12, rtol=0)
