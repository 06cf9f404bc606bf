"""RAM pixel centres: bf16 locations reach every pixel; empty images and NaN locations are refused."""

import pytest
import torch

from attnkit.models.ram import glimpse_sensor, location_to_pixels


def test_bf16_location_plus_one_maps_to_last_pixel():
    loc = torch.ones(1, 2, dtype=torch.bfloat16)
    assert location_to_pixels(loc, 300, 300).tolist() == [[299, 299]]


def test_empty_image_is_refused():
    with pytest.raises(ValueError, match="height=0"):
        location_to_pixels(torch.zeros(1, 2), 0, 10)
    with pytest.raises(ValueError, match="width=0"):
        glimpse_sensor(torch.zeros(1, 1, 5, 0), torch.zeros(1, 2), 2, 1)


def test_nan_location_is_refused():
    with pytest.raises(ValueError, match="non-finite"):
        location_to_pixels(torch.tensor([[float("nan"), 0.0]]), 10, 10)
