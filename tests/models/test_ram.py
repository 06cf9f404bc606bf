"""Recurrent Attention Model: retina glimpses (border padding), REINFORCE training of the location policy."""

import pytest
import torch

from attnkit.models import RecurrentAttentionModel
from attnkit.models.ram import glimpse_sensor, location_to_pixels


def test_glimpse_inside_image_is_the_patch_and_coarser_scales_average():
    x = torch.arange(16 * 16, dtype=torch.float64).view(1, 1, 16, 16)
    loc = torch.tensor([[0.0, 0.0]], dtype=torch.float64)  # pixel (round(7.5), round(7.5)) = (8, 8)
    assert location_to_pixels(loc, 16, 16).tolist() == [[8, 8]]
    g = glimpse_sensor(x, loc, size=4, scales=2)
    assert g.shape == (1, 2, 1, 4, 4)
    torch.testing.assert_close(g[0, 0, 0], x[0, 0, 6:10, 6:10])
    torch.testing.assert_close(g[0, 1, 0], torch.nn.functional.avg_pool2d(x[:, :, 4:12, 4:12], 2)[0, 0])


def test_glimpse_at_border_reads_zero_padding():
    x = torch.ones(1, 1, 10, 10)
    g = glimpse_sensor(x, torch.tensor([[-1.0, -1.0]]), size=4, scales=2)  # centre = pixel (0, 0)
    fine = g[0, 0, 0]
    assert torch.equal(fine[:2], torch.zeros(2, 4)) and torch.equal(fine[:, :2], torch.zeros(4, 2))
    assert torch.equal(fine[2:, 2:], torch.ones(2, 2))
    # scale 2: an 8x8 square from (-4, -4) to (3, 3), pooled by 2: only the bottom-right cells see the image
    torch.testing.assert_close(
        g[0, 1, 0], torch.tensor([[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1.0]])
    )
    # locations beyond [-1, 1] are clamped to the border pixel
    torch.testing.assert_close(glimpse_sensor(x, torch.tensor([[-3.0, -3.0]]), 4, 2), g)


def test_policy_gets_gradient_only_from_reinforce_and_eval_is_deterministic():
    torch.manual_seed(0)
    model = RecurrentAttentionModel(
        glimpse_size=4, scales=2, glimpses=3, hidden_dim=16, glimpse_dim=8, location_dim=8
    )
    x, y = torch.rand(6, 1, 12, 12), torch.randint(0, 10, (6,))
    loss, out = model.loss(x, y)
    assert out.locations.shape == (6, 3, 2) and out.glimpses.shape == (6, 3, 2, 1, 4, 4)
    loss.backward()
    assert model.policy.weight.grad.abs().sum() > 0
    model.eval()
    torch.testing.assert_close(model(x).locations, model(x).locations)
    with pytest.raises(ValueError, match="location_std"):
        RecurrentAttentionModel(location_std=0.0)


def test_tiny_ram_learns_under_fixed_seed():
    # digit-free toy: the class is which quadrant holds a bright square; 4 glimpses suffice
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)

    def batch(n):
        y = torch.randint(0, 4, (n,), generator=g)
        x = torch.zeros(n, 1, 12, 12)
        for i, q in enumerate(y.tolist()):
            r, c = divmod(q, 2)
            x[i, 0, r * 6 + 1 : r * 6 + 5, c * 6 + 1 : c * 6 + 5] = 1.0
        return x, y

    model = RecurrentAttentionModel(
        num_classes=4, glimpse_size=4, scales=2, glimpses=2, hidden_dim=32, glimpse_dim=16, location_dim=8
    )
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    for _ in range(150):
        x, y = batch(32)
        loss, _ = model.loss(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    x, y = batch(200)
    assert (model(x).logits.argmax(-1) == y).float().mean() > 0.9


def _small_ram():
    torch.manual_seed(0)
    return RecurrentAttentionModel(
        num_classes=3, glimpse_size=2, scales=2, glimpses=2, hidden_dim=8, glimpse_dim=8, location_dim=4
    )


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m: m.loss(torch.rand(2, 1, 8, 8), torch.tensor([0, 3])), r"labels holds ids in \[0, 3\]"),
        (lambda m: m.loss(torch.rand(2, 1, 8, 8), torch.tensor([0.0, 1.0])), r"expected a LongTensor \(B,\)"),
        (lambda m: m.loss(torch.rand(2, 1, 8, 8), torch.tensor([0])), r"labels \(1,\) for 2 images"),
        (lambda m: m.loss(torch.rand(0, 1, 8, 8), torch.zeros(0, dtype=torch.long)), r"empty batch \(B=0\)"),
        (lambda m: m(torch.rand(2, 3, 8, 8)), r"expected \(B, C=1, H, W\)"),
        # an empty image was named by its height alone ("height=0; expected a positive integer")
        (lambda m: m(torch.rand(2, 1, 0, 8)), r"images have shape \(2, 1, 0, 8\): an image with no pixels"),
        (lambda m: m(torch.rand(2, 1, 8, 0)), r"images have shape \(2, 1, 8, 0\): an image with no pixels"),
        (lambda m: RecurrentAttentionModel(location_std=float("inf")), "location_std=inf"),
        (lambda m: RecurrentAttentionModel(location_std=True), "location_std=True"),
        # a NaN pixel failed inside torch.distributions; a NaN location indexed at -9e18
        (lambda m: m(torch.full((2, 1, 8, 8), float("nan"))), "NaN or infinite pixels"),
        (lambda m: glimpse_sensor(torch.rand(2, 1, 8, 8), torch.tensor([[float("nan"), 0.0], [0.0, 0.0]]),
                                  2, 2), "non-finite or integer entries"),
        (lambda m: glimpse_sensor(torch.rand(2, 1, 8, 8), torch.zeros(2, 2, dtype=torch.long), 2, 2),
         "non-finite or integer entries"),
        (lambda m: glimpse_sensor(torch.rand(2, 1, 8, 8), [[0.0, 0.0], [0.0, 0.0]], 2, 2), "loc list"),
    ],
)
def test_bad_inputs_raise_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call(_small_ram())


def test_reinforce_gradient_is_unbiased_near_the_border():
    # reward = the x location looked at; exact dE[R]/d bias = P(|l| <= 1) (1 - mean^2) for l ~ N(mean, std^2)
    import math

    torch.manual_seed(0)
    model = RecurrentAttentionModel(
        num_classes=2, glimpse_size=2, scales=1, glimpses=1, hidden_dim=4, glimpse_dim=4, location_dim=4,
        location_std=0.15,
    ).double().train()
    mean = 0.9
    with torch.no_grad():
        model.policy.weight.zero_()
        model.policy.bias.fill_(math.atanh(mean))
    out = model(torch.zeros(100_000, 1, 4, 4, dtype=torch.float64))
    reward = out.locations[:, 0, 1].detach()
    (reward * out.log_probs[:, 0]).mean().backward()  # what REINFORCE differentiates
    normal = torch.distributions.Normal(torch.tensor(mean, dtype=torch.float64), 0.15)
    exact = float((normal.cdf(torch.tensor(1.0)) - normal.cdf(torch.tensor(-1.0))) * (1 - mean**2))  # 0.142
    # the estimate's standard error is about 0.004 here; the clamped sample's log-density gave -0.05
    assert abs(model.policy.bias.grad[1].item() - exact) < 0.02


def test_images_of_another_dtype_are_named():
    """float32 images into a float64 model raised torch's "mat1 and mat2 must have the same dtype"."""
    model = _small_ram().double()
    with pytest.raises(ValueError, match=r"images have dtype torch.float32 but RecurrentAttentionModel's "
                       r"parameters are torch.float64; cast the images with .to\(torch.float64\) or the"):
        model(torch.rand(2, 1, 8, 8))
    assert model(torch.rand(2, 1, 8, 8, dtype=torch.float64)).logits.dtype == torch.float64


def test_the_loss_is_cross_entropy_plus_reinforce_with_the_baseline_plus_the_baselines_squared_error():
    """Mnih et al. (arXiv:1406.6247), sec. 3: reward R = 1 for a right answer, the REINFORCE surrogate
    -sum_t (R - b_t) log pi(l_t) (summed over the glimpses, mean over the batch), and the baseline fitted by
    (b_t - R)^2; passing baseline 0 or dropping the sum over steps passed every test."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = RecurrentAttentionModel(num_classes=3, glimpse_size=2, scales=2, glimpses=3, hidden_dim=8,
                                    glimpse_dim=4, location_dim=4).double()
    images, labels = torch.randn(4, 1, 8, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 1])
    torch.manual_seed(1)
    loss, out = model.loss(images, labels)
    reward = (out.logits.argmax(-1) == labels).double()  # (B,)
    reinforce = -((reward[:, None] - out.baselines).detach() * out.log_probs).sum(1).mean()
    baseline = ((out.baselines - reward[:, None]) ** 2).mean()
    expected = F.cross_entropy(out.logits, labels) + reinforce + baseline
    torch.testing.assert_close(loss, expected, atol=1e-12, rtol=0)
    assert out.log_probs.shape == out.baselines.shape == (4, 3) and bool((out.baselines != 0).all())
